#!/usr/bin/env python3
"""The web playground in a real browser: Debian's chromium + chromedriver (headless),
driven by python3-selenium, against a real fwserve binary with its HTTP port on
loopback. Loads the page, sends a prompt, checks that the reply streamed (at least two
deltas arrived before the end), forks from the first reply and continues (the fork reads
no history again: cached_tokens > 0), fails on any browser console error, and saves a
screenshot as the test's artefact.

Usage: playground_test.py --fwserve PATH --model DIR --proto-dir DIR --screenshot PNG
"""
import argparse
import json
import os
import socket
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
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

ARGS = None


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_http(base, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"{base}/health did not answer within {timeout} s")


class PlaygroundTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.work = tempfile.mkdtemp(prefix="fwserve-playground-")
        port = free_port()
        cls.base = f"http://127.0.0.1:{port}"
        cls.server, _ = start_server(ARGS.fwserve, ARGS.model, os.path.join(cls.work, "server.log"),
                                     extra=["--http-listen", f"127.0.0.1:{port}"])
        wait_for_http(cls.base)
        options = webdriver.ChromeOptions()
        options.binary_location = "/usr/bin/chromium"
        for argument in ("--headless=new", "--no-sandbox", "--disable-gpu",
                         "--disable-dev-shm-usage", "--window-size=1280,860",
                         f"--user-data-dir={cls.work}/chromium"):
            options.add_argument(argument)
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        cls.driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)

    @classmethod
    def tearDownClass(cls):
        try:
            cls.driver.quit()
        finally:
            stop_server(cls.server)

    def send(self, text, requests_before):
        prompt = self.driver.find_element(By.ID, "prompt")
        prompt.clear()
        prompt.send_keys(text)
        self.driver.find_element(By.ID, "send").click()
        WebDriverWait(self.driver, 60).until(
            lambda d: d.execute_script(
                "const r = window.fwPlayground.requests;"
                "return r.length > arguments[0] && r[r.length - 1].completed !== null;",
                requests_before))
        self.assertEqual(self.driver.find_element(By.ID, "error").text, "")
        return self.driver.execute_script(
            "const r = window.fwPlayground.requests; return r[r.length - 1];")

    def test_streams_forks_and_continues(self):
        self.driver.get(self.base + "/")
        WebDriverWait(self.driver, 30).until(
            lambda d: len(d.find_elements(By.CSS_SELECTOR, "#model option")) > 0)
        self.driver.find_element(By.ID, "max-tokens").clear()
        self.driver.find_element(By.ID, "max-tokens").send_keys("120")

        first = self.send("ROMEO:", 0)
        deltas = first["deltas"]
        self.assertGreaterEqual(len(deltas), 2, "the reply did not stream: " + json.dumps(first))
        # At least two deltas arrived before the end of the request.
        self.assertLess(deltas[1]["at"], first["completed"])
        self.assertGreater(first["usage"]["output_tokens"], 0)
        text = "".join(d["text"] for d in deltas)
        self.assertIn(text, self.driver.find_element(By.ID, "log").text)
        state_bytes = self.driver.find_element(By.ID, "state-bytes").text
        self.assertNotEqual(state_bytes, "–")

        second = self.send(" What light", 1)
        # Continuing a stored response reads no history again.
        self.assertGreater(second["usage"]["input_tokens_details"]["cached_tokens"], 0)

        # Fork from the first reply and continue from there: a new branch.
        forks = self.driver.find_elements(By.CSS_SELECTOR, "button.fork")
        self.assertGreaterEqual(len(forks), 2)
        forks[0].click()
        self.assertIn(first["responseId"], self.driver.find_element(By.ID, "branch").text)
        branch = self.send(" JULIET:", 2)
        cached = branch["usage"]["input_tokens_details"]["cached_tokens"]
        self.assertGreater(cached, 0)
        # The branch continues the first reply's session, not the second's.
        self.assertLess(cached, second["usage"]["input_tokens_details"]["cached_tokens"] +
                        second["usage"]["output_tokens"])
        self.assertNotEqual(branch["responseId"], second["responseId"])
        self.assertTrue(int(self.driver.find_element(By.ID, "cached-tokens").text) > 0)

        self.driver.save_screenshot(ARGS.screenshot)
        errors = [entry for entry in self.driver.get_log("browser")
                  if entry.get("level") in ("SEVERE", "ERROR")]
        self.assertEqual(errors, [], "browser console errors")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    parser.add_argument("--screenshot", required=True)
    ARGS, rest = parser.parse_known_args()
    unittest.main(argv=[sys.argv[0]] + rest)
