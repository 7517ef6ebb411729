#!/usr/bin/env python3
"""The web playground in a real browser: Debian's chromium + chromedriver (headless),
driven by python3-selenium, against the real fwserve binary with its HTTP port on
loopback. Loads the page, sends a prompt with Enter (Shift+Enter adds a line and sends
nothing), checks that the reply streamed (at least two deltas arrived before the end),
continues, forks from the first reply and continues there (the fork reads no history
again: cached_tokens > 0); the page then shows that branch (the first turn, then the
new one) with a "‹ 2/2 ›" switcher, and switching back shows the other branch, which a
next turn continues. Exports the session, fails on any browser console error, and
saves a screenshot as the test's artefact. A second server with API keys checks that
the page asks for the key and sends it. A third serves a small RWKV-7 with the world
vocabulary and RWKV's G1 chat template (issue 38): a multilingual prompt goes through
the template and the world tokenizer, and the session continues. A fourth serves a
Gated DeltaNet with a SentencePiece vocabulary (issue 49): a chat streams and continues.

Usage: playground_test.py --fwserve PATH --model DIR --proto-dir DIR --screenshot PNG
           --fwmodel PATH
"""
import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
from fwserve_process import add_server_arguments, start_server, stop_server  # noqa: E402

from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

ARGS = None


def start_http_server(work, name, extra=(), model=None):
    """Starts fwserve with --http-listen on a port of its choosing; returns (process, base)."""
    log_path = os.path.join(work, name + ".log")
    started = start_server(ARGS.fwserve, model or ARGS.model, log_path,
                           extra=["--http-listen", "127.0.0.1:0", *extra])
    if started.http_port is None:
        stop_server(started.process)
        raise AssertionError("fwserve did not log its HTTP port")
    return started.process, "http://127.0.0.1:%d" % started.http_port


def start_browser(work):
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu",
                     "--disable-dev-shm-usage", "--window-size=1280,860",
                     f"--user-data-dir={work}/chromium"):
        options.add_argument(argument)
    options.add_experimental_option(
        "prefs", {"download.default_directory": f"{work}/downloads",
                  "download.prompt_for_download": False})
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)


def console_errors(driver):
    return [entry for entry in driver.get_log("browser")
            if entry.get("level") in ("SEVERE", "ERROR")]


class PlaygroundTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.work = tempfile.mkdtemp(prefix="fwserve-playground-")
        cls.server, cls.base = start_http_server(cls.work, "server")
        try:
            cls.driver = start_browser(cls.work)
        except Exception:
            stop_server(cls.server)
            raise

    @classmethod
    def tearDownClass(cls):
        try:
            cls.driver.quit()
        finally:
            stop_server(cls.server)
            shutil.rmtree(cls.work, ignore_errors=True)

    def open_with_max_tokens(self, base, max_tokens):
        """Loads the page from `base`, waits for its model list, sets max tokens."""
        self.driver.get(base + "/")
        WebDriverWait(self.driver, 30).until(
            lambda d: len(d.find_elements(By.CSS_SELECTOR, "#model option")) > 0)
        self.driver.find_element(By.ID, "max-tokens").clear()
        self.driver.find_element(By.ID, "max-tokens").send_keys(str(max_tokens))

    def send(self, text, requests_before):
        prompt = self.driver.find_element(By.ID, "prompt")
        prompt.clear()
        prompt.send_keys(text)
        prompt.send_keys(Keys.ENTER)  # Enter sends
        WebDriverWait(self.driver, 60).until(
            lambda d: d.find_element(By.ID, "error").text != "" or d.execute_script(
                "const r = window.fwPlayground.requests;"
                "return r.length > arguments[0] && r[r.length - 1].completed !== null;",
                requests_before))
        self.assertEqual(self.driver.find_element(By.ID, "error").text, "")
        return self.driver.execute_script(
            "const r = window.fwPlayground.requests; return r[r.length - 1];")

    def test_page_is_self_contained(self):
        with urllib.request.urlopen(self.base + "/", timeout=10) as response:
            self.assertEqual(response.status, 200)
            self.assertEqual(response.headers["Content-Type"], "text/html; charset=utf-8")
            policy = response.headers["Content-Security-Policy"]
            page = response.read().decode()
        # Nothing is fetched from elsewhere: the policy allows only this origin.
        self.assertIn("connect-src 'self'", policy)
        self.assertIn("default-src 'none'", policy)
        self.assertNotRegex(page, r"(src|href)=\"https?://")

    def test_streams_forks_continues_and_exports(self):
        self.driver.get(self.base + "/")
        WebDriverWait(self.driver, 30).until(
            lambda d: len(d.find_elements(By.CSS_SELECTOR, "#model option")) > 0)
        self.driver.find_element(By.ID, "max-tokens").clear()
        self.driver.find_element(By.ID, "max-tokens").send_keys("120")

        # Shift+Enter adds a line and sends nothing; Enter then sends both lines.
        prompt = self.driver.find_element(By.ID, "prompt")
        prompt.send_keys("ROMEO:" + Keys.SHIFT + Keys.ENTER + Keys.NULL + "JULIET:")
        time.sleep(0.3)
        self.assertEqual(prompt.get_property("value"), "ROMEO:\nJULIET:")
        self.assertEqual(self.driver.execute_script(
            "return window.fwPlayground.requests.length"), 0)
        self.assertEqual(self.driver.find_elements(By.CSS_SELECTOR, "#log .turn"), [])
        prompt.clear()

        first = self.send("ROMEO:", 0)
        deltas = first["deltas"]
        self.assertGreaterEqual(len(deltas), 2, "the reply did not stream: " + json.dumps(first))
        # At least two deltas arrived before the request ended.
        self.assertLess(deltas[1]["at"], first["completed"])
        self.assertGreater(first["usage"]["output_tokens"], 0)
        self.assertEqual(first["usage"]["input_tokens_details"]["cached_tokens"], 0)
        text = "".join(d["text"] for d in deltas)
        self.assertIn(text.strip(), self.driver.find_element(By.ID, "log").text)
        WebDriverWait(self.driver, 10).until(
            lambda d: d.find_element(By.ID, "state-bytes").text != "–")
        state_bytes = int(re.sub(r"\D", "", self.driver.find_element(By.ID, "state-bytes").text))
        self.assertGreater(state_bytes, 0)
        self.assertRegex(self.driver.find_element(By.ID, "tokens-per-second").text,
                         r"^\d+ tok/s$")

        second = self.send(" What light", 1)
        # Continuing a stored response reads no history again: every token of the first
        # turn is already in the state.
        first_total = first["usage"]["input_tokens"] + first["usage"]["output_tokens"]
        self.assertEqual(second["usage"]["input_tokens_details"]["cached_tokens"], first_total)

        # Fork from the first reply and continue from there: a new branch.
        forks = self.driver.find_elements(By.CSS_SELECTOR, "button.fork")
        self.assertEqual(len(forks), 2)
        self.assertEqual(self.driver.find_elements(By.CSS_SELECTOR, ".branch-index"), [])
        forks[0].click()
        self.assertIn(first["responseId"], self.driver.find_element(By.ID, "branch").text)
        branch = self.send(" JULIET:", 2)
        # The branch continues the first reply's session, not the second's.
        self.assertEqual(branch["usage"]["input_tokens_details"]["cached_tokens"], first_total)
        self.assertNotIn(branch["responseId"], (first["responseId"], second["responseId"]))
        self.assertEqual(self.driver.find_element(By.ID, "cached-tokens").text, str(first_total))
        # The page shows the branch: the first turn, then the new one, and a switcher.
        def prompts():
            return [e.text.strip() for e in self.driver.find_elements(
                By.CSS_SELECTOR, "#log .user pre")]

        def replies():
            return [e.text for e in self.driver.find_elements(
                By.CSS_SELECTOR, "#log .assistant pre")]

        def reply_text(record):
            return "".join(d["text"] for d in record["deltas"]).strip()

        self.assertEqual(prompts(), ["ROMEO:", "JULIET:"])
        self.assertEqual([r.strip() for r in replies()], [reply_text(first), reply_text(branch)])
        self.assertEqual(self.driver.find_element(By.CSS_SELECTOR, ".branch-index").text, "2/2")
        self.assertIn(branch["responseId"].replace("resp_", ""),
                      self.driver.find_element(By.ID, "session-id").text)
        # The other branch is reachable: "‹" shows the second turn where the branch was.
        self.driver.find_element(By.CSS_SELECTOR, "button.branch-previous").click()
        self.assertEqual(prompts(), ["ROMEO:", "What light"])
        self.assertEqual([r.strip() for r in replies()], [reply_text(first), reply_text(second)])
        self.assertEqual(self.driver.find_element(By.CSS_SELECTOR, ".branch-index").text, "1/2")
        # A next turn continues the branch shown (the second reply's session).
        # (The input counts the cached tokens, OpenAI's rule: input + output is the whole
        # session after the second turn.)
        second_total = second["usage"]["input_tokens"] + second["usage"]["output_tokens"]
        third = self.send(" Hark", 3)
        self.assertEqual(third["usage"]["input_tokens_details"]["cached_tokens"], second_total)
        self.assertEqual(prompts(), ["ROMEO:", "What light", "Hark"])
        self.assertEqual(self.driver.find_element(By.CSS_SELECTOR, ".branch-index").text, "1/2")
        self.driver.find_element(By.CSS_SELECTOR, "button.branch-next").click()
        self.assertEqual(prompts(), ["ROMEO:", "JULIET:"])

        self.driver.find_element(By.ID, "export").click()
        WebDriverWait(self.driver, 20).until(
            lambda d: d.execute_script("return window.fwPlayground.exportedBytes || 0") > 0)

        self.driver.save_screenshot(ARGS.screenshot)
        self.assertTrue(os.path.getsize(ARGS.screenshot) > 0)
        self.assertEqual(console_errors(self.driver), [], "browser console errors")

    def test_asks_for_the_key_on_a_keyed_server(self):
        keys = os.path.join(self.work, "keys.txt")
        digest = hashlib.sha256(b"playground-key-1").hexdigest()
        with open(keys, "w") as f:
            f.write(f"sha256:{digest} tenant=alice\n")
        os.chmod(keys, 0o600)
        server, base = start_http_server(self.work, "keyed", extra=["--api-keys-file", keys])
        try:
            self.driver.get(base + "/")
            # Without a key the model list is refused, and the page says so.
            WebDriverWait(self.driver, 20).until(
                lambda d: "could not list models" in d.find_element(By.ID, "error").text)
            self.driver.get_log("browser")  # the 401 is an expected console error
            self.driver.find_element(By.ID, "api-key").send_keys("playground-key-1")
            self.driver.find_element(By.ID, "model").click()  # blur: the key's change event
            WebDriverWait(self.driver, 20).until(
                lambda d: len(d.find_elements(By.CSS_SELECTOR, "#model option")) > 0)
            self.assertEqual(self.driver.find_element(By.ID, "error").text, "")
            reply = self.send("ROMEO:", 0)
            self.assertGreater(reply["usage"]["output_tokens"], 0)
            self.assertEqual(console_errors(self.driver), [], "browser console errors")
        finally:
            stop_server(server)

    def test_world_vocabulary_chat_through_the_template(self):
        model = os.path.join(self.work, "rwkv7-world")
        config_path = os.path.join(self.work, "rwkv7-world.json")
        with open(config_path, "w") as f:
            json.dump({"format_version": 1, "architecture": "rwkv7", "d_model": 64,
                       "n_layers": 1, "n_heads": 1, "d_ff": 64, "vocab_size": 65536,
                       "tokenizer": "rwkv_world", "bos_token_id": 0,
                       "decay_low_rank_dim": 4, "a_low_rank_dim": 4, "v_low_rank_dim": 4,
                       "gate_low_rank_dim": 4, "tie_embeddings": True,
                       "chat_template": {"message": "{Role}: {content}\n\n",
                                         "generation_prompt": "Assistant:",
                                         "stop": ["\n\n"]}}, f)
        subprocess.run([ARGS.fwmodel, "init", model, "--config", config_path, "--seed", "3",
                        "--storage-dtype", "BF16"], check=True, stdout=subprocess.DEVNULL)
        shutil.copy(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data",
                                 "rwkv", "rwkv_vocab_v20230424.txt"), model)

        def template_tokens(content):
            path = os.path.join(self.work, "rendered.txt")
            with open(path, "w", encoding="utf-8") as f:
                f.write("User: %s\n\nAssistant:" % content)
            out = subprocess.run([ARGS.fwmodel, "tokenize", model, "--text-file", path,
                                  "--json"], check=True, capture_output=True, text=True).stdout
            return len(json.loads(out)["ids"])

        server, base = start_http_server(self.work, "world", model=model)
        try:
            self.open_with_max_tokens(base, 24)
            prompt_text = "Grüße 😀, 你好! Как дела?"
            requests_before = self.driver.execute_script(
                "return window.fwPlayground.requests.length")
            first = self.send(prompt_text, requests_before)
            # The prompt went through the template, tokenized by the world vocabulary.
            self.assertEqual(first["usage"]["input_tokens"], template_tokens(prompt_text))
            self.assertGreater(first["usage"]["output_tokens"], 0)
            reply = "".join(d["text"] for d in first["deltas"])
            self.assertNotIn("\n\n", reply, "the reply runs past the template's end marker")
            turns = [e.text.strip() for e in self.driver.find_elements(
                By.CSS_SELECTOR, "#log .user pre")]
            self.assertEqual(turns, [prompt_text])
            # The next turn continues the session: the first turn is not read again.
            second = self.send("Ещё раз", requests_before + 1)
            self.assertEqual(second["usage"]["input_tokens_details"]["cached_tokens"],
                             first["usage"]["input_tokens"] + first["usage"]["output_tokens"])
            self.assertEqual(console_errors(self.driver), [], "browser console errors")
        finally:
            stop_server(server)


    def test_gated_deltanet_with_sentencepiece(self):
        """A Gated DeltaNet (issue 49) with a SentencePiece vocabulary in the playground: the
        reply streams, and the next turn continues the session without reading the first
        again."""
        model = os.path.join(self.work, "gated-deltanet")
        config_path = os.path.join(self.work, "gated-deltanet.json")
        with open(config_path, "w") as f:
            json.dump({"format_version": 1, "architecture": "gated_deltanet", "d_model": 32,
                       "n_layers": 2, "n_heads": 2, "head_k_dim": 16, "head_v_dim": 16,
                       "num_v_heads": 4, "d_ff": 64, "ffn": "swiglu", "use_short_conv": True,
                       "conv_size": 4, "use_gate": True, "vocab_size": 400,
                       "tokenizer": "sentencepiece", "bos_token_id": 1, "eos_token_id": 2}, f)
        subprocess.run([ARGS.fwmodel, "init", model, "--config", config_path, "--seed", "5",
                        "--storage-dtype", "BF16"], check=True, stdout=subprocess.DEVNULL)
        shutil.copy(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data",
                                 "sentencepiece", "shakespeare-bpe400.model"),
                    os.path.join(model, "tokenizer.model"))
        server, base = start_http_server(self.work, "gated-deltanet", model=model)
        try:
            self.open_with_max_tokens(base, 24)
            requests_before = self.driver.execute_script(
                "return window.fwPlayground.requests.length")
            first = self.send("KING HENRY: What says the", requests_before)
            self.assertGreater(first["usage"]["input_tokens"], 1)
            self.assertGreater(first["usage"]["output_tokens"], 0)
            second = self.send("And then?", requests_before + 1)
            self.assertEqual(second["usage"]["input_tokens_details"]["cached_tokens"],
                             first["usage"]["input_tokens"] + first["usage"]["output_tokens"])
            self.assertEqual(console_errors(self.driver), [], "browser console errors")
        finally:
            stop_server(server)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    parser.add_argument("--screenshot", required=True)
    parser.add_argument("--fwmodel", required=True, help="build/tools/fwmodel (world model)")
    ARGS, rest = parser.parse_known_args()
    unittest.main(argv=[sys.argv[0]] + rest)
