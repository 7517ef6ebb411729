#!/usr/bin/env python3
"""Cross-language proof: a Python gRPC client, with stubs generated at test time from
proto/fwserve/v1/fwserve.proto and proto/grpc/health/v1/health.proto, drives the real
fwserve binary (shipped model, port 0).

Needs python3-grpcio and python3-protobuf (scripts/install-deps.sh installs them); the
test fails if they are missing. Stubs come from `python3 -m grpc_tools.protoc` when
grpcio-tools is installed, else from protoc with grpc_python_plugin (Debian's
protobuf-compiler-grpc).

Usage: python_client_test.py --fwserve PATH --proto-dir DIR --model DIR [--protoc PATH]
"""
import argparse
import math
import os
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
from fwserve_stubs import ensure_grpc, generate_stubs  # noqa: E402
from fwserve_process import start_server, stop_server  # noqa: E402

TARGET = None


class PythonClientTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        import grpc
        from fwserve.v1 import fwserve_pb2, fwserve_pb2_grpc
        from fwtest_health import health_pb2, health_pb2_grpc
        cls.grpc = grpc
        cls.pb = fwserve_pb2
        cls.health_pb = health_pb2
        cls.channel = grpc.insecure_channel(TARGET)
        grpc.channel_ready_future(cls.channel).result(timeout=30)
        cls.stub = fwserve_pb2_grpc.FwserveStub(cls.channel)
        cls.health = health_pb2_grpc.HealthStub(cls.channel)

    @classmethod
    def tearDownClass(cls):
        cls.channel.close()

    def generate(self, **fields):
        """Runs a Generate; returns (text, token ids, logprobs, last message)."""
        messages = list(self.stub.Generate(self.pb.GenerateRequest(**fields), timeout=60))
        text = "".join(m.text for m in messages)
        tokens = [t for m in messages for t in m.token_ids]
        logprobs = [p for m in messages for p in m.logprobs]
        return text, tokens, logprobs, messages[-1]

    def wait_idle(self, session_id):
        for _ in range(500):
            info = self.stub.GetSession(self.pb.GetSessionRequest(session_id=session_id))
            if not info.busy:
                return info
            time.sleep(0.02)
        self.fail("session %s stayed busy" % session_id)

    def test_health(self):
        for service in ["", "fwserve.v1.Fwserve"]:
            response = self.health.Check(self.health_pb.HealthCheckRequest(service=service),
                                         timeout=10)
            self.assertEqual(response.status, self.health_pb.HealthCheckResponse.SERVING)

    def test_models(self):
        models = self.stub.ListModels(self.pb.ListModelsRequest(), timeout=10).models
        self.assertEqual([m.name for m in models], ["aft-shakespeare"])
        self.assertTrue(models[0].is_default)
        self.assertEqual(models[0].architecture, "aft")
        self.assertEqual(models[0].vocab_size, 256)
        self.assertEqual(len(models[0].fingerprint), 64)
        described = self.stub.DescribeModel(self.pb.DescribeModelRequest(model="aft-shakespeare"))
        self.assertEqual(described, models[0])
        self.assertIn('"architecture"', described.config_json)

    def test_session_generate_stream(self):
        session = self.stub.CreateSession(self.pb.CreateSessionRequest(prefix=b"ROMEO:\n"))
        self.assertRegex(session.session_id, r"^[0-9a-f]{32}$")
        self.assertEqual(session.tokens, 7)
        self.assertEqual(session.model, "aft-shakespeare")

        sampling = self.pb.SamplingParams(temperature=0.8, seed=11)
        text, tokens, logprobs, last = self.generate(
            session_id=session.session_id, prompt="But soft".encode(), max_tokens=30,
            sampling=sampling, logprobs=True)
        self.assertEqual(len(tokens), 30)
        self.assertEqual(len(logprobs), 30)
        self.assertTrue(all(p <= 0 for p in logprobs))
        self.assertEqual(text.encode(), bytes(tokens))  # the bytes tokenizer, ASCII output
        self.assertEqual(last.finish_reason, self.pb.FINISH_REASON_LENGTH)
        self.assertEqual(last.usage.prompt_tokens, 8)
        self.assertEqual(last.usage.generated_tokens, 30)
        self.assertEqual(last.usage.session_tokens, 7 + 8 + 30)
        info = self.stub.GetSession(self.pb.GetSessionRequest(session_id=session.session_id))
        self.assertEqual(info.tokens, 45)
        self.assertFalse(info.busy)

        # The same request on a throwaway session with the same history gives the same text.
        again, _, _, _ = self.generate(prompt=b"ROMEO:\nBut soft", max_tokens=30,
                                       sampling=sampling)
        self.assertEqual(again, text)

        # A stop string ends the stream and is included.
        text, _, _, last = self.generate(prompt=b"ROMEO:\nWhat", max_tokens=2000,
                                         sampling=self.pb.SamplingParams(temperature=0),
                                         stop=["\n"])
        self.assertTrue(text.endswith("\n"))
        self.assertEqual(last.finish_reason, self.pb.FINISH_REASON_STOP)

        listed = self.stub.ListSessions(self.pb.ListSessionsRequest(model="aft-shakespeare"))
        self.assertIn(session.session_id, [s.session_id for s in listed.sessions])
        self.stub.DeleteSession(self.pb.DeleteSessionRequest(session_id=session.session_id))
        with self.assertRaises(self.grpc.RpcError) as raised:
            self.stub.GetSession(self.pb.GetSessionRequest(session_id=session.session_id))
        self.assertEqual(raised.exception.code(), self.grpc.StatusCode.NOT_FOUND)

    def test_score(self):
        text = "To be, or not to be: that is the question"
        scored = self.stub.Score(self.pb.ScoreRequest(text=text.encode()), timeout=30)
        self.assertEqual(list(scored.token_ids), list(text.encode()))
        self.assertEqual(len(scored.logprobs), len(text) - 1)
        self.assertAlmostEqual(scored.total_logprob, sum(scored.logprobs), places=6)
        self.assertAlmostEqual(scored.perplexity,
                               math.exp(-sum(scored.logprobs) / len(scored.logprobs)), places=6)
        # The shipped model knows its Shakespeare: well under 256 (uniform bytes).
        self.assertLess(scored.perplexity, 20)

    def test_export_import_round_trip(self):
        session = self.stub.CreateSession(self.pb.CreateSessionRequest(prefix=b"JULIET:\nO "))
        exported = self.stub.ExportSession(
            self.pb.ExportSessionRequest(session_id=session.session_id))
        self.assertEqual(exported.tokens, 10)
        self.assertEqual(exported.model, "aft-shakespeare")
        imported = self.stub.ImportSession(self.pb.ImportSessionRequest(blob=exported.blob))
        self.assertNotEqual(imported.session_id, session.session_id)
        self.assertEqual(imported.tokens, 10)
        forked = self.stub.ForkSession(self.pb.ForkSessionRequest(session_id=session.session_id))
        self.assertEqual(forked.tokens, 10)
        sampling = self.pb.SamplingParams(seed=5)
        texts = {self.generate(session_id=s, max_tokens=25, sampling=sampling)[0]
                 for s in (session.session_id, imported.session_id, forked.session_id)}
        self.assertEqual(len(texts), 1, texts)
        # A damaged blob is refused.
        with self.assertRaises(self.grpc.RpcError) as raised:
            self.stub.ImportSession(self.pb.ImportSessionRequest(blob=exported.blob[:-10]))
        self.assertEqual(raised.exception.code(), self.grpc.StatusCode.INVALID_ARGUMENT)

    def test_invalid_input_codes(self):
        # bytes fields let invalid UTF-8 reach the server, which refuses it.
        with self.assertRaises(self.grpc.RpcError) as raised:
            self.generate(prompt=b"\xff\xfe", max_tokens=3)
        self.assertEqual(raised.exception.code(), self.grpc.StatusCode.INVALID_ARGUMENT)
        with self.assertRaises(self.grpc.RpcError) as raised:
            self.generate(prompt=b"x", max_tokens=3, model="no-such-model")
        self.assertEqual(raised.exception.code(), self.grpc.StatusCode.NOT_FOUND)

    def test_cancel_mid_stream(self):
        session = self.stub.CreateSession(self.pb.CreateSessionRequest(prefix=b"Go"))
        call = self.stub.Generate(self.pb.GenerateRequest(
            session_id=session.session_id, max_tokens=100000))
        received = 0
        for message in call:
            received += len(message.token_ids)
            if received >= 50:
                call.cancel()
                break
        self.assertEqual(call.code(), self.grpc.StatusCode.CANCELLED)
        info = self.wait_idle(session.session_id)
        self.assertGreaterEqual(info.tokens, 2 + received)
        self.assertLess(info.tokens, 2 + 100000)
        _, tokens, _, last = self.generate(session_id=session.session_id, max_tokens=3)
        self.assertEqual(last.usage.session_tokens, info.tokens + 3)

    def test_deadline(self):
        with self.assertRaises(self.grpc.RpcError) as raised:
            list(self.stub.Generate(self.pb.GenerateRequest(prompt=b"x", max_tokens=100000),
                                    timeout=0.2))
        self.assertEqual(raised.exception.code(), self.grpc.StatusCode.DEADLINE_EXCEEDED)


def main():
    global TARGET
    ensure_grpc()
    parser = argparse.ArgumentParser()
    parser.add_argument("--fwserve", required=True)
    parser.add_argument("--proto-dir", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--protoc", default=None)
    args, rest = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        generate_stubs(args.proto_dir, os.path.join(tmp, "stubs"), args.protoc,
                       with_health=True)
        log_path = os.path.join(tmp, "fwserve.log")
        process, TARGET = start_server(args.fwserve, args.model, log_path)
        try:
            program = unittest.main(argv=[sys.argv[0]] + rest, exit=False, verbosity=2)
        finally:
            stop_server(process)
        result = program.result
        failed = len(result.failures) + len(result.errors)
        print("%d passed, %d failed" % (result.testsRun - failed - len(result.skipped), failed))
        if not result.wasSuccessful():
            with open(log_path, "rb") as f:
                sys.stderr.write("--- fwserve log (tail)\n" +
                                 f.read().decode(errors="replace")[-4000:])
        sys.exit(0 if result.wasSuccessful() else 1)


if __name__ == "__main__":
    main()
