#!/usr/bin/env python3
"""Writes the seed corpus of the http_request fuzz target (tests/fuzz/fuzz_targets.cc):
raw HTTP/1.1 requests as a client sends them to fwserve's HTTP front door. The files are
committed; rerun this after editing a seed (it rewrites only the files it names, so
crash reproducers added by hand stay).

Usage: make_http_request_corpus.py [OUT_DIR]   (default: corpus/http_request beside it)
"""
import json
import os
import sys

KEY = "sk-fuzz"  # the API key of the target's tenant table


def request(method, target, body=None, headers=(), chunked=False, length=None):
    """A request with Host, the given headers and, for a body, Content-Type and
    Content-Length (or chunked transfer-encoding); bytes."""
    if isinstance(body, (dict, list)):
        body = json.dumps(body)
    body_bytes = body.encode() if isinstance(body, str) else (body or b"")
    lines = [f"{method} {target} HTTP/1.1", "Host: localhost:8000"]
    lines += list(headers)
    if body is not None:
        lines.append("Content-Type: application/json")
        if chunked:
            lines.append("Transfer-Encoding: chunked")
        else:
            lines.append(f"Content-Length: {len(body_bytes) if length is None else length}")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode()
    if chunked:
        chunks = [body_bytes[i:i + 7] for i in range(0, len(body_bytes), 7)]
        body_bytes = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"
    return head + body_bytes


AUTH = (f"Authorization: Bearer {KEY}",)
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello, who are you?"}]

SEEDS = {
    "completions": request("POST", "/v1/completions",
                           {"model": "aft-shakespeare", "prompt": "ROMEO:", "max_tokens": 8,
                            "temperature": 0.7, "top_p": 0.9, "seed": 7, "stop": ["\n\n", "END"]},
                           AUTH),
    "completions_prompt_array": request("POST", "/v1/completions",
                                        {"prompt": ["one prompt"], "logprobs": 0, "echo": False,
                                         "n": 1, "best_of": 1, "user": "u1", "top_k": 40,
                                         "min_p": 0.05, "repetition_penalty": 1.1}),
    "completions_stream_usage": request("POST", "/v1/completions",
                                        {"prompt": "x", "stream": True,
                                         "stream_options": {"include_usage": True},
                                         "session_id": "0123456789abcdef0123456789abcdef"},
                                        AUTH),
    "usage_without_stream": request("POST", "/v1/chat/completions",
                                    {"messages": MESSAGES,
                                     "stream_options": {"include_usage": True}}),
    "chat": request("POST", "/v1/chat/completions",
                    {"model": "aft-shakespeare", "messages": MESSAGES, "max_tokens": 16,
                     "logprobs": True, "top_logprobs": 0, "stop": "\n"}, AUTH),
    "chat_stream": request("POST", "/v1/chat/completions",
                           {"messages": [{"role": "user", "content": [
                               {"type": "text", "text": "part one, "},
                               {"type": "input_text", "text": "part two"}]}],
                            "stream": True, "stream_options": {"include_usage": True},
                            "max_completion_tokens": 4, "store": False,
                            "response_format": {"type": "text"}, "tools": [],
                            "tool_choice": "none", "parallel_tool_calls": False,
                            "metadata": {"k": "v"}, "presence_penalty": 0,
                            "frequency_penalty": 0.0, "logit_bias": {}}, AUTH),
    "chat_chunked": request("POST", "/v1/chat/completions", {"messages": MESSAGES},
                            AUTH, chunked=True),
    "chat_keepalive_pipelined": request("POST", "/v1/chat/completions",
                                        {"messages": MESSAGES, "max_tokens": 2},
                                        ("Connection: keep-alive",) + AUTH)
    + request("GET", "/v1/models", None, AUTH)
    + request("POST", "/v1/completions", {"prompt": "again"}, AUTH),
    "chat_wrong_types": request("POST", "/v1/chat/completions",
                                {"messages": "Hi", "temperature": "hot", "max_tokens": -1,
                                 "stream": "yes"}, AUTH),
    "chat_unsupported": request("POST", "/v1/chat/completions",
                                {"messages": [{"role": "user", "content": [
                                    {"type": "image_url", "image_url": {"url": "x"}}]}],
                                 "n": 2, "tools": [{"type": "function"}]}, AUTH),
    "chat_message_fields": request("POST", "/v1/chat/completions",
                                   {"messages": [{"role": "", "content": None},
                                                 {"role": "tool", "tool_call_id": "c1"}]}),
    "chat_store_true": request("POST", "/v1/chat/completions",
                               {"messages": MESSAGES, "store": True, "seed": 1.0}),
    "responses": request("POST", "/v1/responses",
                         {"model": "aft-shakespeare", "input": "Tell me a story.",
                          "instructions": "Speak in verse.", "max_output_tokens": 32,
                          "store": True, "text": {"format": {"type": "text"}},
                          "truncation": "disabled", "background": False, "include": [],
                          "reasoning": {}}, AUTH),
    "responses_previous": request("POST", "/v1/responses",
                                  {"input": [{"role": "user", "content": "And then?"}],
                                   "previous_response_id": "resp_0123456789abcdef",
                                   "stream": True}, AUTH),
    "responses_conversation": request("POST", "/v1/responses",
                                      {"input": [{"type": "message", "role": "user",
                                                  "content": [{"type": "input_text",
                                                               "text": "hi"}]}],
                                       "conversation": {"id": "conv_abc"}, "store": False},
                                      AUTH),
    "responses_both_ids": request("POST", "/v1/responses",
                                  {"input": "x", "previous_response_id": "resp_a",
                                   "conversation": "conv_b", "stop": "no"}),
    "responses_no_input": request("POST", "/v1/responses", {"instructions": "only this"}),
    "conversations_create": request("POST", "/v1/conversations",
                                    {"items": [{"role": "user", "content": "remember 42"}],
                                     "metadata": {}}, AUTH),
    "conversation_get": request("GET", "/v1/conversations/conv_abc/", None, AUTH),
    "response_delete": request("DELETE", "/v1/responses/resp_abc?x=1", None, AUTH),
    "model_get": request("GET", "/v1/models/aft-shakespeare", None, ("authorization: bearer  sk-fuzz  ",)),
    "sessions_create": request("POST", "/fwserve/v1/sessions",
                               {"model": "aft-shakespeare", "prefix": "Once upon a time"}, AUTH),
    "sessions_list_query": request("GET",
                                   "/fwserve/v1/sessions?model=aft%2Dshakespeare&page_size=10"
                                   "&page_token=a+b%zz&&flag&=v",
                                   None, AUTH),
    "sessions_import": request("POST", "/fwserve/v1/sessions/import?model=aft-shakespeare",
                               "FWSS\x00\x01binary", AUTH),
    "sessions_fork_export": request("POST", "/fwserve/v1/sessions/abc/fork", "", AUTH)
    + request("GET", "/fwserve/v1/sessions/abc/export", None, AUTH),
    "probes": request("GET", "/health") + request("GET", "/ready")
    + request("OPTIONS", "/v1/chat/completions", None, ("Origin: http://example.com",)),
    "other_paths": request("GET", "/fwserve/anything/at/all") + request("PATCH", "/v1//x/y/z/")
    + request("GET", "//"),
    "auth_wrong_scheme": request("GET", "/v1/models", None, ("Authorization: Basic dXNlcjpw",)),
    "auth_wrong_key": request("GET", "/v1/models", None, ("Authorization: Bearer sk-other",)),
    "auth_bearer_only": request("GET", "/v1/models", None, ("Authorization: Bearer ",)),
    "bad_json": request("POST", "/v1/chat/completions", "{not json", AUTH),
    "not_object": request("POST", "/v1/completions", "[1, 2, 3]", AUTH),
    "invalid_utf8_body": request("POST", "/v1/completions", b'{"prompt": "caf\xc3"}', AUTH),
    "unicode_escapes": request("POST", "/v1/completions",
                               '{"prompt": "\\u00e9\\ud83d\\ude00\\u0000", "stop": ["\\u00e9"],'
                               ' "unknown_field": 1e400}', AUTH),
    # Deep enough to overflow the stack of a recursive Dump in an error message.
    "deep_nesting": request("POST", "/v1/completions",
                            '{"prompt": ' + "[" * 100000 + "]" * 100000 + "}", AUTH),
    "deep_nesting_items": request("POST", "/v1/conversations",
                                  '{"items": ' + '{"a":' * 1000 + "1" + "}" * 1000 + "}", AUTH),
    "big_numbers": request("POST", "/v1/completions",
                           {"prompt": "x", "max_tokens": 2 ** 40, "seed": -(2 ** 63),
                            "top_k": 1.5, "temperature": 1e300}),
    "oversize_content_length": request("POST", "/v1/completions", '{"prompt": "x"}',
                                       length=1 << 30),
    "short_body": request("POST", "/v1/completions", '{"prompt": "xyz"}', length=5),
    "huge_header": request("GET", "/health", None, ("X-Pad: " + "a" * (17 << 10),)),
    "header_only": b"GET /v1/models HTTP/1.1\r\nHost: x\r\n",
    "http10_no_host": b"GET /health HTTP/1.0\r\n\r\n",
    "bad_chunk": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"zz\r\n{}\r\n0\r\n\r\n",
    "garbage": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 not http at all\r\n\r\n",
    # Issue 40: what the SDKs send.
    "chat_pushed_back": request("POST", "/v1/chat/completions",
                                {"messages": MESSAGES + [
                                    {"role": "assistant", "content": None, "refusal": "No.",
                                     "annotations": [], "audio": None, "tool_calls": [],
                                     "function_call": None},
                                    {"role": "user", "name": "Romeo", "content": "Why?"},
                                    {"role": "robot", "content": "x"}],
                                 "max_completion_tokens": 4, "max_tokens": 9}, AUTH),
    "responses_items": request("POST", "/v1/responses",
                               {"input": [{"role": "user", "content": "Hi"},
                                          {"type": "message", "id": "msg_abc",
                                           "status": "completed", "role": "assistant",
                                           "content": [{"type": "output_text", "text": "Yo",
                                                        "annotations": [], "logprobs": []}]},
                                          {"type": "item_reference", "id": "msg_abc"},
                                          {"id": "msg_def"},
                                          {"role": "developer", "content": [
                                              {"type": "input_text", "text": "more"}]}]},
                               AUTH),
    "field_policy": request("POST", "/v1/chat/completions",
                            {"messages": MESSAGES, "service_tier": "auto",
                             "modalities": ["text"], "store": True, "stream": True,
                             "stream_options": {"include_obfuscation": False},
                             "user": "u", "metadata": {"k": "v"}, "prompt_cache_key": "p",
                             "safety_identifier": "s", "parallel_tool_calls": False}, AUTH),
    "expect_continue_head_405": request("POST", "/v1/completions", '{"prompt": "x"}',
                                        ("Expect: 100-continue",) + AUTH)
                                + request("HEAD", "/v1/models", None, AUTH)
                                + request("PUT", "/v1/chat/completions", "{}", AUTH),
    "cors_preflight": request("OPTIONS", "/v1/responses", None,
                              ("Origin: http://app.example",
                               "Access-Control-Request-Method: POST",
                               "Access-Control-Request-Headers: authorization,x-stainless-os")),
}


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "corpus", "http_request")
    os.makedirs(out, exist_ok=True)
    for name, data in SEEDS.items():
        with open(os.path.join(out, name), "wb") as f:
            f.write(data)
    print(f"wrote {len(SEEDS)} seeds to {out}")


if __name__ == "__main__":
    main()
