#!/usr/bin/env python3
"""The layering of server/ (docs/architecture.md): each folder is one CMake library and
includes nothing above it; the folders below the core and the transports never include
LibTorch. Fails listing every include that points the wrong way.

Usage: layering_test.py SOURCE_DIR
"""
import os
import re
import sys

# What each folder may include of server/ (itself always). Order: low to high.
ALLOWED = {
    "server/base": set(),
    "server/api": {"server/base"},
    "server/metrics": {"server/base"},
    "server/sessions/store": {"server/base"},
    "server/sessions": {"server/sessions/store", "server/base", "server/api", "server/metrics"},
    "server/tenancy": {"server/base", "server/api", "server/metrics"},
    "server/engine": {"server/sessions", "server/sessions/store", "server/base", "server/api",
                      "server/metrics"},
    "server/core": {"server/engine", "server/sessions", "server/sessions/store",
                    "server/tenancy", "server/base", "server/api", "server/metrics"},
    "server/transport/grpc": {"server/core", "server/tenancy", "server/base", "server/api",
                              "server/metrics"},
    "server/transport/http": {"server/core", "server/tenancy", "server/base", "server/api",
                              "server/metrics"},
    # main: wiring only, may include any library.
    "server": {"server/transport/grpc", "server/transport/http", "server/core", "server/engine",
               "server/sessions", "server/sessions/store", "server/tenancy", "server/base",
               "server/api", "server/metrics"},
}
# Folders that must build without LibTorch (their CMake targets do not link it).
TORCH_FREE = {"server/base", "server/api", "server/metrics", "server/sessions/store",
              "server/sessions", "server/tenancy", "server/transport/grpc",
              "server/transport/http", "server"}
# Files inside a LibTorch folder that stay torch-free (the scheduler's library,
# fwserve_scheduler, and what it is unit-tested with; the options headers that the
# torch-free core.h includes): no LibTorch, and of server/engine only one another.
TORCH_FREE_FILES = {"server/engine/scheduler.h", "server/engine/scheduler.cc",
                    "server/engine/scheduler_options.h", "server/engine/engine_options.h",
                    "server/engine/stream_task.h", "server/engine/stream_task.cc",
                    "server/engine/admission_queue.h"}
TORCH_INCLUDE = re.compile(r'#include\s*[<"](torch/|ATen/|c10/)')
SERVER_INCLUDE = re.compile(r'#include\s*"(server/[^"]+)"')


def folder_of(path):
    """The library folder a server/ file belongs to (its directory)."""
    return os.path.dirname(path)


def main():
    root = sys.argv[1]
    problems = []
    files = 0
    for directory, _, names in os.walk(os.path.join(root, "server")):
        for name in sorted(names):
            if not name.endswith((".h", ".cc")):
                continue
            path = os.path.relpath(os.path.join(directory, name), root)
            folder = folder_of(path)
            if folder not in ALLOWED:
                problems.append(f"{path}: folder {folder} is not in the layering table")
                continue
            files += 1
            text = open(os.path.join(root, path), encoding="utf-8").read()
            for included in SERVER_INCLUDE.findall(text):
                target = folder_of(included)
                if target != folder and target not in ALLOWED[folder]:
                    problems.append(f"{path}: includes {included} ({folder} may not include "
                                    f"{target})")
            if folder in TORCH_FREE and TORCH_INCLUDE.search(text):
                problems.append(f"{path}: includes LibTorch, but {folder} must stay torch-free")
            if path in TORCH_FREE_FILES:
                if TORCH_INCLUDE.search(text):
                    problems.append(f"{path}: includes LibTorch, but it must stay torch-free")
                for included in SERVER_INCLUDE.findall(text):
                    if folder_of(included) == folder and included not in TORCH_FREE_FILES:
                        problems.append(f"{path}: includes {included}, which is not torch-free")
    for path in sorted(TORCH_FREE_FILES):
        if not os.path.exists(os.path.join(root, path)):
            problems.append(f"{path}: listed as torch-free but missing")
    for folder in ALLOWED:
        cmake = os.path.join(root, folder, "CMakeLists.txt")
        if folder != "server" and (not os.path.exists(cmake) or
                                   "add_library" not in open(cmake).read()):
            problems.append(f"{folder}: has no CMake library of its own")
    # The model library and the client never include the server.
    for top in ("models", "client"):
        for directory, _, names in os.walk(os.path.join(root, top)):
            for name in names:
                if name.endswith((".h", ".cc")):
                    path = os.path.join(directory, name)
                    if SERVER_INCLUDE.search(open(path, encoding="utf-8").read()):
                        problems.append(f"{os.path.relpath(path, root)}: includes server/")
    for problem in problems:
        print(problem)
    if files < 20:
        problems.append(f"only {files} server files found: wrong SOURCE_DIR?")
        print(problems[-1])
    print(f"layering: {files} server files checked, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
