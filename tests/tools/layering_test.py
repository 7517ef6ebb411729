#!/usr/bin/env python3
"""The layering of server/ and models/ (docs/architecture.md): each folder is one CMake
library (or a torch-free one beside a LibTorch one) and includes nothing above it; the
torch-free folders and files never reach a LibTorch header, neither directly nor through
a project header (the include graph is followed); <torch/torch.h> is training's alone;
Boost.Beast stays in the HTTP transport's socket side. Fails listing every include that
points the wrong way, with the chain of includes that reaches LibTorch.

Usage: layering_test.py SOURCE_DIR
"""
import os
import re
import sys

# What each folder may include of server/ and models/ (itself always). Order: low to
# high. models/ is below every server/ folder that uses it.
MODELS_ALLOWED = {
    "models/base": set(),
    "models/constraints": {"models/base"},
    "models/gpu": {"models/base"},
    "models/tokenizers": {"models/base"},
    "models/sampling": {"models/base", "models/constraints", "models/gpu"},
    "models/architectures": {"models/base", "models/gpu"},
    "models/checkpoints": {"models/base", "models/architectures"},
    "models/kernels": {"models/base", "models/sampling", "models/architectures", "models/gpu"},
    "models/training": {"models/base", "models/tokenizers", "models/sampling",
                        "models/architectures", "models/checkpoints", "models/kernels"},
}
MODELS = set(MODELS_ALLOWED)
# What of models/ the server's torch-free layers may include: the torch-free libraries.
MODELS_TORCH_FREE_USE = {"models/base", "models/constraints", "models/gpu", "models/tokenizers",
                         "models/sampling", "models/checkpoints"}
SERVER_ALLOWED = {
    "server/base": set(),
    "server/api": {"server/base", "models/sampling", "models/constraints"},
    "server/metrics": {"server/base"},
    "server/sessions/store": {"server/base"},
    "server/sessions": {"server/sessions/store", "server/base", "server/api", "server/metrics"},
    "server/tenancy": {"server/base", "server/api", "server/metrics"},
    "server/engine": {"server/sessions", "server/sessions/store", "server/base", "server/api",
                      "server/metrics"} | MODELS,
    "server/core": {"server/engine", "server/sessions", "server/sessions/store",
                    "server/tenancy", "server/base", "server/api", "server/metrics"}
                   | MODELS_TORCH_FREE_USE,
    "server/transport/grpc": {"server/core", "server/tenancy", "server/base", "server/api",
                              "server/metrics", "models/sampling", "models/constraints"},
    "server/transport/http": {"server/core", "server/tenancy", "server/base", "server/api",
                              "server/metrics", "models/sampling", "models/constraints"},
    # main: wiring only, may include any library.
    "server": {"server/transport/grpc", "server/transport/http", "server/core", "server/engine",
               "server/sessions", "server/sessions/store", "server/tenancy", "server/base",
               "server/api", "server/metrics", "common"} | MODELS_TORCH_FREE_USE,
}
ALLOWED = {**MODELS_ALLOWED, **SERVER_ALLOWED}
# Folders whose every file must build without LibTorch: no LibTorch header reached,
# directly or through any project header.
TORCH_FREE = {"server/base", "server/api", "server/metrics", "server/sessions/store",
              "server/sessions", "server/tenancy", "server/core", "server/transport/grpc",
              "server/transport/http", "server", "models/base", "models/constraints",
              "models/gpu", "models/tokenizers", "client", "client/fwctl"}
# Torch-free files inside a LibTorch folder: the engine's scheduler library
# (fwserve_scheduler) and the interface the core sees the engine through; models'
# torch-free libraries (fwserve_sampling, fwserve_safetensors, fwserve_gemm) and the
# native math the kernels share.
TORCH_FREE_FILES = {
    "server/engine/scheduler.h", "server/engine/scheduler.cc",
    "server/engine/scheduler_options.h", "server/engine/engine_options.h",
    "server/engine/stream_task.h", "server/engine/stream_task.cc",
    "server/engine/admission_queue.h", "server/engine/model_engine.h",
    "server/engine/work_item.h", "server/engine/state_memory_budget.h",
    "server/engine/state_memory_budget.cc",
    "models/sampling/sampler.h", "models/sampling/sampler.cc",
    "models/checkpoints/safetensors.h", "models/checkpoints/safetensors.cc",
    "models/checkpoints/state_format.h", "models/checkpoints/state_format.cc",
    "models/kernels/packed_linear.h", "models/kernels/packed_linear.cc",
    "models/kernels/native_parallel.h", "models/kernels/native_rows.h",
    "models/architectures/native_math.h",
}
# The only folder that may include <torch/torch.h> (nn, optim, data, JIT, pybind11): the
# rest include the narrowest header that has what they use (<torch/types.h>, ATen).
TORCH_ALL_FOLDERS = {"models/training"}
# The files that may include Boost.Beast/Asio under server/: the HTTP socket side.
BEAST_FILES = {"server/transport/http/http_internal.h", "server/transport/http/http_server.cc"}

TORCH_INCLUDE = re.compile(r'#include\s*[<"](torch/|ATen/|c10/)')
TORCH_ALL_INCLUDE = re.compile(r'#include\s*[<"]torch/(torch|all)\.h[>"]')
BEAST_INCLUDE = re.compile(r'#include\s*<boost/(beast|asio)')
PROJECT_INCLUDE = re.compile(r'#include\s*"((?:server|models|client|common)/[^"]+)"')
SOURCES = (".h", ".cc")


def folder_of(path):
    """The library folder a file belongs to (its directory)."""
    return os.path.dirname(path)


class IncludeGraph:
    """Project includes of every file, read once; which files reach LibTorch."""

    def __init__(self, root):
        self.root = root
        self.text = {}
        self.torch_chain = {}

    def read(self, path):
        if path not in self.text:
            full = os.path.join(self.root, path)
            self.text[path] = open(full, encoding="utf-8").read() if os.path.exists(full) else ""
        return self.text[path]

    def includes(self, path):
        return PROJECT_INCLUDE.findall(self.read(path))

    def reaches_torch(self, path, visiting=None):
        """The chain of includes from `path` to a file that includes LibTorch, or None."""
        if path in self.torch_chain:
            return self.torch_chain[path]
        visiting = visiting or set()
        if path in visiting:
            return None
        visiting.add(path)
        chain = None
        if TORCH_INCLUDE.search(self.read(path)):
            chain = [path]
        else:
            for included in self.includes(path):
                sub = self.reaches_torch(included, visiting)
                if sub is not None:
                    chain = [path] + sub
                    break
        self.torch_chain[path] = chain
        return chain


def source_files(root, top):
    for directory, _, names in os.walk(os.path.join(root, top)):
        for name in sorted(names):
            if name.endswith(SOURCES):
                yield os.path.relpath(os.path.join(directory, name), root)


def main():
    root = sys.argv[1]
    graph = IncludeGraph(root)
    problems = []
    counts = {"server": 0, "models": 0}
    for top in ("server", "models"):
        for path in source_files(root, top):
            folder = folder_of(path)
            if folder not in ALLOWED:
                problems.append(f"{path}: folder {folder} is not in the layering table")
                continue
            counts[top] += 1
            text = graph.read(path)
            for included in PROJECT_INCLUDE.findall(text):
                target = folder_of(included)
                if target != folder and target not in ALLOWED[folder]:
                    problems.append(f"{path}: includes {included} ({folder} may not include "
                                    f"{target})")
            if TORCH_ALL_INCLUDE.search(text) and folder not in TORCH_ALL_FOLDERS:
                problems.append(f"{path}: includes <torch/torch.h>; only "
                                f"{', '.join(sorted(TORCH_ALL_FOLDERS))} may (use "
                                f"<torch/types.h> or an ATen header)")
            if BEAST_INCLUDE.search(text) and path not in BEAST_FILES:
                problems.append(f"{path}: includes Boost.Beast/Asio; only the HTTP socket side "
                                f"({', '.join(sorted(BEAST_FILES))}) may")
    for top in ("client", "common", "tools", "bench"):
        for path in source_files(root, top):
            text = graph.read(path)
            if TORCH_ALL_INCLUDE.search(text):
                problems.append(f"{path}: includes <torch/torch.h>; only models/training may")
    # Torch-free folders and files: no LibTorch reached, directly or transitively.
    checked_torch_free = 0
    for top in ("server", "models", "client"):
        for path in source_files(root, top):
            if folder_of(path) in TORCH_FREE or path in TORCH_FREE_FILES:
                checked_torch_free += 1
                chain = graph.reaches_torch(path)
                if chain is not None:
                    problems.append(f"{path}: must stay torch-free, but reaches LibTorch: "
                                    f"{' -> '.join(chain)}")
    for path in sorted(TORCH_FREE_FILES):
        if not os.path.exists(os.path.join(root, path)):
            problems.append(f"{path}: listed as torch-free but missing")
    for folder in ALLOWED:
        cmake = os.path.join(root, folder, "CMakeLists.txt")
        if folder != "server" and (not os.path.exists(cmake) or
                                   "add_library" not in open(cmake).read()):
            problems.append(f"{folder}: has no CMake library of its own")
    # The model library and the client never include the server; the client never the
    # model library.
    for top in ("models", "client"):
        for path in source_files(root, top):
            for included in PROJECT_INCLUDE.findall(graph.read(path)):
                if included.startswith("server/") or (top == "client" and
                                                      included.startswith("models/")):
                    problems.append(f"{path}: includes {included}")
    for problem in problems:
        print(problem)
    if counts["server"] < 20 or counts["models"] < 20:
        problems.append(f"only {counts} files found: wrong SOURCE_DIR?")
        print(problems[-1])
    print(f"layering: {counts['server']} server and {counts['models']} models files checked, "
          f"{checked_torch_free} of them torch-free (include graph followed), "
          f"{len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
