#!/usr/bin/env python3
"""CORS as a browser application meets it: Debian's headless chromium (python3-selenium)
loads a page from another origin (a local static server) that runs the official openai
npm package itself (tests/openai_client/node_modules, its browser ESM build) against the
real fwserve with --http-cors-origins. The SDK sends its own headers (x-stainless-*,
Authorization), so every call is preflighted: a chat completion, a streamed one and a
response must succeed, and a page from an origin not on the list must be refused by the
browser. Fails on any failed call.

Usage: cors_browser_test.py --fwserve PATH --model DIR --node-modules DIR
"""
import argparse
import functools
import http.server
import os
import shutil
import sys
import tempfile
import threading
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
from fwserve_process import start_server, stop_server  # noqa: E402

from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

ARGS = None

PAGE = """<!doctype html>
<meta charset="utf-8"><title>fwserve CORS</title>
<script type="module">
import OpenAI from "/node_modules/openai/index.mjs";
const out = window.fwCors = { done: false, steps: [], error: null };
try {
  const client = new OpenAI({ baseURL: "%(api)s/v1", apiKey: "browser-key",
                              dangerouslyAllowBrowser: true, maxRetries: 0 });
  const chat = await client.chat.completions.create({
    model: "aft-shakespeare", messages: [{ role: "user", content: "Good morrow" }],
    max_tokens: 8, temperature: 0 });
  out.steps.push("chat:" + chat.usage.total_tokens);
  const stream = await client.chat.completions.create({
    model: "aft-shakespeare", messages: [{ role: "user", content: "Good morrow" }],
    max_tokens: 8, temperature: 0, stream: true });
  let text = "";
  for await (const chunk of stream) text += chunk.choices[0]?.delta?.content ?? "";
  out.steps.push("stream:" + (text === chat.choices[0].message.content));
  const response = await client.responses.create({
    model: "aft-shakespeare", input: "Good morrow", max_output_tokens: 4 });
  out.steps.push("responses:" + response.status);
} catch (e) {
  out.error = String(e && e.stack || e);
}
out.done = true;
</script>
"""


class Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def serve_static(root):
    """A static server for `root` on a free loopback port; returns (server, origin)."""
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Quiet, directory=root))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, "http://127.0.0.1:%d" % server.server_address[1]


def start_browser(work):
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu",
                     "--disable-dev-shm-usage", f"--user-data-dir={work}/chromium"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)


class CorsBrowserTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.work = tempfile.mkdtemp(prefix="fwserve-cors-")
        root = os.path.join(cls.work, "site")
        os.makedirs(os.path.join(root, "node_modules"))
        os.symlink(os.path.abspath(os.path.join(ARGS.node_modules, "openai")),
                   os.path.join(root, "node_modules", "openai"))
        cls.static, cls.origin = serve_static(root)
        cls.other, cls.other_origin = serve_static(root)
        cls.root = root
        started = start_server(ARGS.fwserve, ARGS.model, os.path.join(cls.work, "fwserve.log"),
                               extra=["--http-listen", "127.0.0.1:0",
                                      "--http-cors-origins", cls.origin])
        cls.server = started.process
        if started.http_port is None:
            stop_server(cls.server)
            raise AssertionError("fwserve did not log its HTTP port")
        cls.api = "http://127.0.0.1:%d" % started.http_port
        with open(os.path.join(root, "index.html"), "w") as f:
            f.write(PAGE % {"api": cls.api})
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
            cls.static.shutdown()
            cls.other.shutdown()
            shutil.rmtree(cls.work, ignore_errors=True)

    def run_page(self, origin):
        self.driver.get(origin + "/index.html")
        try:
            WebDriverWait(self.driver, 60).until(
                lambda d: d.execute_script("return window.fwCors && window.fwCors.done"))
        except Exception:
            raise AssertionError("the page did not finish: %r, console: %r" % (
                self.driver.execute_script("return window.fwCors"),
                self.driver.get_log("browser")))
        return self.driver.execute_script("return window.fwCors")

    def test_sdk_calls_pass_the_preflight(self):
        result = self.run_page(self.origin)
        self.assertIsNone(result["error"], result)
        self.assertEqual(len(result["steps"]), 3, result)
        self.assertTrue(result["steps"][0].startswith("chat:"), result)
        self.assertEqual(result["steps"][1], "stream:true", result)
        self.assertIn(result["steps"][2], ("responses:completed", "responses:incomplete"))

    def test_an_origin_not_listed_is_refused(self):
        result = self.run_page(self.other_origin)
        self.assertIsNotNone(result["error"], result)
        self.assertIn("Connection error", result["error"])


def main():
    global ARGS
    parser = argparse.ArgumentParser()
    parser.add_argument("--fwserve", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--node-modules", required=True)
    ARGS, rest = parser.parse_known_args()
    unittest.main(argv=[sys.argv[0], *rest], verbosity=2)


if __name__ == "__main__":
    main()
