#!/usr/bin/env python3
"""Generic gRPC tooling works against a real fwserve: server reflection lists the
services and serves the API's descriptors (what grpcurl uses), and the standard health
service answers. Stubs are generated here from vendored protos with protoc and
grpc_python_plugin.

Usage: reflection_health_test.py FWSERVE_BINARY MODEL_DIR SOURCE_DIR
"""
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
from fwserve_process import start_server, stop_server  # noqa: E402
from unittest_run import check  # noqa: E402


def main():
    fwserve, model_dir, source = sys.argv[1:4]
    work = tempfile.mkdtemp(prefix="fwserve-reflection-")
    plugin = shutil.which("grpc_python_plugin")
    if plugin is None or shutil.which("protoc") is None:
        raise SystemExit("FAIL: protoc / grpc_python_plugin missing (protobuf-compiler-grpc)")
    here = os.path.dirname(os.path.abspath(__file__))
    # Python modules follow the .proto file's path; "grpc/..." would shadow the grpc
    # package itself, so the files are copied under fwtest_protos/ first.
    protos = os.path.join(work, "fwtest_protos")
    os.makedirs(protos)
    shutil.copy(f"{here}/protos/grpc/reflection/v1alpha/reflection.proto", protos)
    shutil.copy(f"{source}/proto/grpc/health/v1/health.proto", protos)
    subprocess.check_call([
        "protoc", f"--proto_path={work}", f"--python_out={work}", f"--grpc_out={work}",
        f"--plugin=protoc-gen-grpc={plugin}",
        "fwtest_protos/reflection.proto", "fwtest_protos/health.proto"])
    sys.path.insert(0, work)
    import grpc
    from google.protobuf import descriptor_pb2
    from fwtest_protos import reflection_pb2, reflection_pb2_grpc
    from fwtest_protos import health_pb2, health_pb2_grpc

    process, target = start_server(fwserve, model_dir, os.path.join(work, "fwserve.log"))
    try:
        channel = grpc.insecure_channel(target)
        grpc.channel_ready_future(channel).result(timeout=30)

        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        requests = [reflection_pb2.ServerReflectionRequest(list_services=""),
                    reflection_pb2.ServerReflectionRequest(
                        file_containing_symbol="fwserve.v1.Fwserve")]
        responses = list(stub.ServerReflectionInfo(iter(requests), timeout=10))
        services = {s.name for s in responses[0].list_services_response.service}
        for expected in ("fwserve.v1.Fwserve", "grpc.health.v1.Health"):
            check(expected in services, f"{expected} not in {services}")
        files = [descriptor_pb2.FileDescriptorProto.FromString(b)
                 for b in responses[1].file_descriptor_response.file_descriptor_proto]
        methods = {m.name for f in files for s in f.service if s.name == "Fwserve"
                   for m in s.method}
        for expected in ("Generate", "Score", "CreateSession", "ExportSession", "ListModels"):
            check(expected in methods, f"{expected} not in {methods}")

        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "fwserve.v1.Fwserve"):
            status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            check(status.status == health_pb2.HealthCheckResponse.SERVING, status)
        print(f"PASS: reflection lists {sorted(services)}; Fwserve has {len(methods)} methods; "
              "health SERVING")
    finally:
        stop_server(process)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
