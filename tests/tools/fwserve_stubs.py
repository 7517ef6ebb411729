"""Python gRPC stubs for proto/fwserve/v1/fwserve.proto, generated at test time.

    from fwserve_stubs import ensure_grpc, load_stubs
    ensure_grpc()                                  # first thing in main()
    grpc, pb, pb_grpc = load_stubs(proto_dir, tmp)  # fwserve_pb2, fwserve_pb2_grpc

ensure_grpc re-runs the calling script under Debian's /usr/bin/python3 when this
interpreter (say, a pyenv one) does not see python3-grpcio / python3-protobuf.
Stubs come from `python3 -m grpc_tools.protoc` when grpcio-tools is installed, else
from protoc with grpc_python_plugin (Debian's protobuf-compiler-grpc). The same
approach as tests/client/python_client_test.py.
"""
import importlib
import os
import shutil
import subprocess
import sys

SYSTEM_PYTHON = "/usr/bin/python3"


def ensure_grpc():
    """Imports grpc, re-executing the script under the system Python if needed; prints
    "0 passed, 1 failed" and exits 1 when grpc for Python is not installed at all."""
    try:
        import grpc  # noqa: F401
        import google.protobuf  # noqa: F401
        return
    except ImportError as error:
        missing = error
    if (os.path.realpath(sys.executable) != os.path.realpath(SYSTEM_PYTHON)
            and os.path.exists(SYSTEM_PYTHON)
            and not os.environ.get("FWSERVE_PYTHON_REEXEC")):
        check = subprocess.run([SYSTEM_PYTHON, "-c", "import grpc, google.protobuf"],
                               capture_output=True)
        if check.returncode == 0:
            os.environ["FWSERVE_PYTHON_REEXEC"] = "1"
            os.execv(SYSTEM_PYTHON, [SYSTEM_PYTHON] + sys.argv)
    sys.stderr.write("%s: grpc for Python is missing (%s); install python3-grpcio and "
                     "python3-protobuf (scripts/install-deps.sh)\n"
                     % (os.path.basename(sys.argv[0]), missing))
    print("0 passed, 1 failed")
    sys.exit(1)


def generate_stubs(proto_dir, out_dir, protoc=None, with_health=False):
    """Writes out_dir/fwserve/v1/fwserve_pb2{,_grpc}.py and puts out_dir on sys.path.

    with_health: also fwtest_health/health_pb2{,_grpc}.py. health.proto is copied under
    another directory: a generated grpc/health/v1 package would be shadowed by the
    installed `grpc` package. Its proto package (and so the service name on the wire)
    is still grpc.health.v1."""
    source = os.path.join(out_dir, "src")
    os.makedirs(os.path.join(source, "fwserve", "v1"), exist_ok=True)
    shutil.copy(os.path.join(proto_dir, "fwserve", "v1", "fwserve.proto"),
                os.path.join(source, "fwserve", "v1"))
    protos = ["fwserve/v1/fwserve.proto"]
    if with_health:
        os.makedirs(os.path.join(source, "fwtest_health"), exist_ok=True)
        shutil.copy(os.path.join(proto_dir, "grpc", "health", "v1", "health.proto"),
                    os.path.join(source, "fwtest_health"))
        protos.append("fwtest_health/health.proto")
    try:
        importlib.import_module("grpc_tools")
        command = [sys.executable, "-m", "grpc_tools.protoc"]
        plugin = []
    except ImportError:
        plugin_path = shutil.which("grpc_python_plugin")
        protoc = protoc or shutil.which("protoc")
        if plugin_path is None or protoc is None:
            raise RuntimeError("neither grpc_tools nor protoc + grpc_python_plugin is "
                               "available (install protobuf-compiler-grpc)")
        command = [protoc]
        plugin = ["--plugin=protoc-gen-grpc=" + plugin_path]
    subprocess.run(command + plugin + ["--proto_path=" + source, "--python_out=" + out_dir,
                                       "--grpc_out=" + out_dir] + protos, check=True)
    if out_dir not in sys.path:
        sys.path.insert(0, out_dir)


def load_stubs(proto_dir, out_dir, protoc=None):
    """Generates the stubs under out_dir and returns (grpc, fwserve_pb2, fwserve_pb2_grpc)."""
    generate_stubs(proto_dir, out_dir, protoc)
    import grpc
    from fwserve.v1 import fwserve_pb2, fwserve_pb2_grpc
    return grpc, fwserve_pb2, fwserve_pb2_grpc


def stream_generate(stub, pb, timeout, **fields):
    """One Generate call read to its end: (token ids, the last message, which carries
    usage). On failure the grpc.RpcError is raised with `.streamed` set to the token ids
    that arrived before it."""
    import grpc  # after ensure_grpc()
    tokens = []
    last = None
    try:
        for message in stub.Generate(pb.GenerateRequest(**fields), timeout=timeout):
            tokens.extend(message.token_ids)
            if message.HasField("usage"):
                last = message
    except grpc.RpcError as error:
        error.streamed = tokens
        raise
    return tokens, last
