"""The proto and its generated code: reproducible by scripts/gen-proto, and wire-compatible with
the stubs NVIDIA's tritonclient ships (same package, service, methods, messages, field numbers
and types). Our generated module is loaded only in a subprocess (both register inference.*)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from google.protobuf import descriptor_pb2
from tritonclient.grpc import model_config_pb2, service_pb2

REPO = Path(__file__).resolve().parents[2]
# Messages ours declares with fewer fields than Triton's (the fields the sidecar fills, under
# Triton's numbers): each of our fields must be Triton's, and every other message must match.
PARTIAL = {
    "InferStatistics",
    "ModelStatistics",
    "RepositoryModelLoadRequest",
    "RepositoryModelUnloadRequest",
    "ModelConfig",
    "ModelInput",
    "ModelOutput",
    "ModelDynamicBatching",
    "ModelInstanceGroup",
}
GENERATED = REPO / "runtime_sidecar" / "cuvil_sidecar" / "_generated"

DUMP = """
import json, sys
from google.protobuf import descriptor_pb2
sys.path.insert(0, sys.argv[1])
from cuvil_sidecar._generated import grpc_service_pb2 as pb
proto = descriptor_pb2.FileDescriptorProto()
pb.DESCRIPTOR.CopyToProto(proto)
print(proto.SerializeToString().hex())
"""


def shape(proto: descriptor_pb2.FileDescriptorProto) -> dict:
    """Everything the wire depends on: methods, and per message its fields' numbers and types."""

    def message(m: descriptor_pb2.DescriptorProto, prefix: str, out: dict) -> None:
        name = prefix + m.name
        out[name] = sorted(
            (f.number, f.name, f.type, f.label, f.type_name.rsplit(".", 1)[-1]) for f in m.field
        )
        for nested in m.nested_type:
            message(nested, name + ".", out)

    messages: dict = {}
    for m in proto.message_type:
        message(m, "", messages)
    enums = {
        prefix + e.name: sorted((v.number, v.name) for v in e.value)
        for prefix, e in [("", e) for e in proto.enum_type]
        + [(m.name + ".", e) for m in proto.message_type for e in m.enum_type]
    }
    methods = {
        method.name: (method.input_type, method.output_type) for method in proto.service[0].method
    }
    return {
        "package": proto.package,
        "service": proto.service[0].name,
        "methods": methods,
        "messages": messages,
        "enums": enums,
    }


def test_generated_code_is_reproducible(tmp_path: Path) -> None:
    subprocess.run(
        [str(REPO / "scripts" / "gen-proto"), str(tmp_path)],
        check=True,
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
    )
    fresh = tmp_path / "cuvil_sidecar" / "_generated"
    names = sorted(p.name for p in fresh.iterdir() if p.is_file())
    assert names == sorted(
        p.name for p in GENERATED.iterdir() if p.is_file() and p.suffix in {".py", ".pyi"}
    )
    for name in names:
        assert (fresh / name).read_text() == (GENERATED / name).read_text(), (
            f"{name} is stale: run scripts/gen-proto"
        )


def test_wire_compatible_with_tritonclient() -> None:
    dumped = subprocess.run(
        [sys.executable, "-c", DUMP, str(REPO / "runtime_sidecar")],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    ours = descriptor_pb2.FileDescriptorProto.FromString(bytes.fromhex(dumped))
    theirs = descriptor_pb2.FileDescriptorProto()
    service_pb2.DESCRIPTOR.CopyToProto(theirs)
    config = descriptor_pb2.FileDescriptorProto()
    model_config_pb2.DESCRIPTOR.CopyToProto(config)
    theirs.message_type.extend(config.message_type)  # Triton keeps these in model_config.proto
    theirs.enum_type.extend(config.enum_type)
    mine, nvidia = shape(ours), shape(theirs)
    assert mine["package"] == nvidia["package"] == "inference"
    assert mine["service"] == nvidia["service"] == "GRPCInferenceService"
    assert set(mine["methods"]) == {
        "ServerLive",
        "ServerReady",
        "ModelReady",
        "ServerMetadata",
        "ModelMetadata",
        "ModelInfer",
        "SystemSharedMemoryStatus",
        "SystemSharedMemoryRegister",
        "SystemSharedMemoryUnregister",
        "ModelStreamInfer",
        "ModelConfig",
        "ModelStatistics",
        "RepositoryIndex",
        "RepositoryModelLoad",
        "RepositoryModelUnload",
    }
    for method, types in mine["methods"].items():
        assert nvidia["methods"][method] == types, method
    for name, fields in mine["messages"].items():
        assert name in nvidia["messages"], name
        if name in PARTIAL:
            assert set(fields) <= set(nvidia["messages"][name]), json.dumps([name, fields])
        else:
            assert fields == nvidia["messages"][name], json.dumps([name, fields])
    for name, values in mine["enums"].items():
        assert values == nvidia["enums"][name], name
