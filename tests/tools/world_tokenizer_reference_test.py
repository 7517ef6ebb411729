#!/usr/bin/env python3
"""fwserve's world tokenizer (models/tokenizers/world_tokenizer.cc) against an independent
reference in Python, through `fwmodel tokenize`:

- the vocabulary: every line of rwkv_vocab_v20230424.txt parsed as ChatRWKV's
  TRIE_TOKENIZER parses it (BlinkDL/ChatRWKV, rwkv_pip_package/src/rwkv/
  rwkv_tokenizer.py: the id, a Python str or bytes literal, its byte length), here with
  Python's own literal parser (ast.literal_eval) instead of eval; all 65,529 ids must
  stand for the same bytes;
- encodings: greedy longest match over the bytes (what TRIE_TOKENIZER.encodeBytes does),
  on multilingual text with emoji, ZWJ sequences, flags, control bytes, split UTF-8
  characters and stray bytes, and on 50 KB of vocabulary pieces glued together.

ChatRWKV's own file may not be copied into this repository, so it does not run here.
This reference was checked against it once, by hand, on 2026-11-27: TRIE_TOKENIZER from
ChatRWKV commit 965e40b (whose vocabulary file is byte-identical to tests/data/rwkv's)
gave exactly fwmodel's ids on all ten texts below, 9,309 tokens for the glued 50 KB.

Usage: world_tokenizer_reference_test.py FWMODEL REPO_ROOT"""
import ast
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile

fwmodel, root = sys.argv[1], sys.argv[2]
vocab_path = os.path.join(root, "tests", "data", "rwkv", "rwkv_vocab_v20230424.txt")


def parse_vocabulary(path):
    id_to_bytes = {}
    with open(path, "r", encoding="utf-8") as f:
        for line in f:
            first, last = line.index(" "), line.rindex(" ")
            token = ast.literal_eval(line[first:last].strip())
            token = token.encode("utf-8") if isinstance(token, str) else token
            assert isinstance(token, bytes), line
            assert len(token) == int(line[last:]), line
            id_to_bytes[int(line[:first])] = token
    return id_to_bytes


def greedy_longest_match(data, bytes_to_id, lengths):
    ids, i = [], 0
    while i < len(data):
        for n in lengths:  # longest first
            token = bytes_to_id.get(data[i:i + n])
            if token is not None:
                ids.append(token)
                i += n
                break
        else:
            raise AssertionError("byte %d has no token" % data[i])
    return ids


failures = []


def check(condition, message):
    if not condition:
        failures.append(message)
        print("FAIL:", message)


id_to_bytes = parse_vocabulary(vocab_path)
bytes_to_id = {b: i for i, b in id_to_bytes.items()}
lengths = sorted({len(b) for b in id_to_bytes.values()}, reverse=True)
check(len(id_to_bytes) == 65529, "65,529 entries, got %d" % len(id_to_bytes))

work = tempfile.mkdtemp(prefix="fwserve-world-tokenizer-")
try:
    # A tiny RWKV-7 with the world vocabulary: the tokenizer comes from the directory.
    config = {"format_version": 1, "architecture": "rwkv7", "d_model": 64, "n_layers": 1,
              "n_heads": 1, "d_ff": 64, "vocab_size": 65536, "tokenizer": "rwkv_world",
              "bos_token_id": 0, "decay_low_rank_dim": 4, "a_low_rank_dim": 4,
              "v_low_rank_dim": 4, "gate_low_rank_dim": 4, "tie_embeddings": True}
    with open(os.path.join(work, "config.json"), "w") as f:
        json.dump(config, f)
    model = os.path.join(work, "model")
    subprocess.run([fwmodel, "init", model, "--config", os.path.join(work, "config.json"),
                    "--seed", "1", "--storage-dtype", "BF16"], check=True,
                   stdout=subprocess.DEVNULL)
    shutil.copy(vocab_path, model)

    listed = subprocess.run([fwmodel, "tokenize", model, "--vocabulary"], check=True,
                            capture_output=True, text=True).stdout.splitlines()
    served = {}
    for line in listed:
        token_id, hex_bytes = line.split("\t")
        served[int(token_id)] = bytes.fromhex(hex_bytes)
    check(served == id_to_bytes,
          "vocabulary differs at ids %s" % sorted(
              i for i in set(served) | set(id_to_bytes)
              if served.get(i) != id_to_bytes.get(i))[:10])

    texts = [
        "User: hi\n\nHello".encode(),
        "The quick brown fox jumps over the lazy dog.\n\n".encode(),
        "User: Bonjour, ça va ? Très bien, merci !\n\nAssistant:".encode(),
        "你好，世界！今日は良い天気ですね。안녕하세요.".encode(),
        "Здравствуй, мир! Γειά σου Κόσμε! مرحبا بالعالم שלום עולם नमस्ते दुनिया".encode(),
        "emoji 😀👍🏽👨‍👩‍👧‍👦 🇫🇷🇯🇵 and a flag, ﷽ and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢".encode(),
        "code:\n\tfor (int i = 0; i < n; ++i) {\r\n  x += \"\\\\\";\n}".encode(),
        "split ".encode() + "你".encode()[:2] + b" bytes " + "😀".encode()[:3] +
        b" and \xff\xfe stray \xc0\x80 overlong",
        b"\x00\x01 nul" + b" " * 300 + b"-" * 77 + b"\n" * 9,
    ]
    # Vocabulary pieces glued together: long matches that overlap the next piece.
    rng = random.Random(38)
    pieces = list(id_to_bytes.values())
    glued = bytearray()
    while len(glued) < 50000:
        glued += rng.choice(pieces)
        if rng.random() < 0.05:
            glued += bytes([rng.randrange(256)])
    texts.append(bytes(glued))

    for n, text in enumerate(texts):
        path = os.path.join(work, "text%d" % n)
        with open(path, "wb") as f:
            f.write(text)
        out = subprocess.run([fwmodel, "tokenize", model, "--text-file", path, "--json"],
                             check=True, capture_output=True, text=True).stdout
        got = json.loads(out)
        expected = greedy_longest_match(text, bytes_to_id, lengths)
        check(got["tokenizer"] == "rwkv_world", "text %d: tokenizer %s" % (n, got["tokenizer"]))
        if got["ids"] != expected:
            first = next((i for i, (a, b) in enumerate(zip(got["ids"], expected)) if a != b),
                         min(len(got["ids"]), len(expected)))
            check(False, "text %d: ids differ from position %d: %s vs %s" % (
                n, first, got["ids"][first:first + 5], expected[first:first + 5]))
        check(b"".join(id_to_bytes[i] for i in got["ids"]) == text,
              "text %d: ids do not decode to the text" % n)
    check(greedy_longest_match(texts[0], bytes_to_id, lengths) == [24281, 59, 4571, 261, 33155],
          "the reference's own encoding of 'User: hi\\n\\nHello'")
finally:
    shutil.rmtree(work, ignore_errors=True)

if failures:
    print("%d failure(s)" % len(failures))
    sys.exit(1)
print("vocabulary (%d ids) and %d texts equal the reference" % (len(id_to_bytes), len(texts)))
