"""Triton's system shared-memory extension through NVIDIA's tritonclient: inputs read from and
outputs written to POSIX shared memory (Python's ``multiprocessing.shared_memory``), alone, mixed
with raw tensors and batched; registration errors and bad references answered with a status
naming the problem; and the registry's own checks without a server."""

from __future__ import annotations

import asyncio
import os
import re
import urllib.request
from collections.abc import Iterator
from multiprocessing import shared_memory
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from cuvil_sidecar.config import SidecarConfig
from cuvil_sidecar.errors import (
    AlreadyExists,
    InvalidInput,
    NotSupported,
    PermissionDenied,
    RegionNotFound,
    TooManyRegions,
)
from cuvil_sidecar.shared_memory import (
    MAX_REGIONS,
    SharedMemoryRef,
    SharedMemoryRegistry,
    reference,
)
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests.cuvil_sidecar.conftest import Sidecar, eager

ROW_BYTES = 784 * 4  # one MLP input row, FP32
OUT_BYTES = 10 * 4  # one MLP output row


@pytest.fixture
def segment() -> Iterator[shared_memory.SharedMemory]:
    """A 64 KiB POSIX shared memory segment, /dev/shm/<name>, gone after the test."""
    created = shared_memory.SharedMemory(create=True, size=64 * 1024)
    yield created
    created.close()
    created.unlink()


@pytest.fixture
def client(mlp_sidecar: Sidecar) -> Iterator[grpcclient.InferenceServerClient]:
    connected = grpcclient.InferenceServerClient(mlp_sidecar.url)
    yield connected
    connected.unregister_system_shared_memory()  # the sidecar is shared by the session's tests
    connected.close()


def array_at(segment: shared_memory.SharedMemory, offset: int, shape: tuple[int, ...]):
    return np.ndarray(shape, np.float32, buffer=segment.buf, offset=offset)


def expected(mlp_spec, x: np.ndarray) -> np.ndarray:
    return eager(mlp_spec.model, {"x": torch.from_numpy(x.copy())}).numpy()


def test_inputs_and_outputs_in_shared_memory(client, segment, mlp_spec) -> None:
    key = "/" + segment.name
    client.register_system_shared_memory("inputs", key, 3 * ROW_BYTES)
    client.register_system_shared_memory("outputs", key, 1024, offset=32 * 1024)
    status = client.get_system_shared_memory_status(as_json=True)["regions"]
    assert status["inputs"]["key"] == key and int(status["inputs"]["byte_size"]) == 3 * ROW_BYTES
    assert int(status["outputs"]["offset"]) == 32 * 1024
    assert "system_shared_memory" in client.get_server_metadata().extensions

    x = array_at(segment, 0, (3, 784))
    x[:] = np.random.default_rng(1).standard_normal((3, 784), dtype=np.float32)
    item = grpcclient.InferInput("x", [3, 784], "FP32")
    item.set_shared_memory("inputs", 3 * ROW_BYTES)
    wanted = grpcclient.InferRequestedOutput("output")
    wanted.set_shared_memory("outputs", 512, offset=64)
    result = client.infer("mlp", [item], outputs=[wanted])

    output = result.get_output("output")
    assert list(output.shape) == [3, 10]
    assert output.parameters["shared_memory_region"].string_param == "outputs"
    assert output.parameters["shared_memory_byte_size"].int64_param == 3 * OUT_BYTES
    assert output.parameters["shared_memory_offset"].int64_param == 64
    # the bytes are in shared memory, not in the reply (whose raw entry stays as a placeholder)
    assert list(result.get_response().raw_output_contents) == [b""]
    written = array_at(segment, 32 * 1024 + 64, (3, 10))
    np.testing.assert_allclose(written, expected(mlp_spec, x), rtol=1e-4, atol=1e-5)

    client.unregister_system_shared_memory("inputs")
    assert set(client.get_system_shared_memory_status(as_json=True)["regions"]) == {"outputs"}


def test_shared_memory_mixes_with_raw_tensors(client, segment, mlp_spec) -> None:
    client.register_system_shared_memory("mixed", "/" + segment.name, 8192)
    x = array_at(segment, 0, (2, 784))
    x[:] = np.random.default_rng(2).standard_normal((2, 784), dtype=np.float32)
    item = grpcclient.InferInput("x", [2, 784], "FP32")
    item.set_shared_memory("mixed", 2 * ROW_BYTES)
    from_shared = client.infer("mlp", [item]).as_numpy("output")  # output raw
    np.testing.assert_allclose(from_shared, expected(mlp_spec, x), rtol=1e-4, atol=1e-5)

    raw = grpcclient.InferInput("x", [2, 784], "FP32")
    raw.set_data_from_numpy(-np.asarray(x))
    wanted = grpcclient.InferRequestedOutput("output")
    wanted.set_shared_memory("mixed", 2 * OUT_BYTES, offset=7000)
    client.infer("mlp", [raw], outputs=[wanted])
    written = array_at(segment, 7000, (2, 10))
    np.testing.assert_allclose(written, expected(mlp_spec, -np.asarray(x)), rtol=1e-4, atol=1e-5)


def scrape_exec_count(sidecar: Sidecar) -> float:
    with urllib.request.urlopen(sidecar.metrics_url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    match = re.search(r'^nv_inference_exec_count{model="mlp",version="1"} (\S+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


def test_batched_requests_each_use_their_own_slice(
    joining_sidecar: Sidecar, segment, mlp_spec
) -> None:
    """Eight concurrent requests, each reading its row at its own offset and writing its output
    at its own offset, are joined into batches and every output lands in its place."""
    count = 8
    client = grpcclient.InferenceServerClient(joining_sidecar.url)
    try:
        client.register_system_shared_memory("rows", "/" + segment.name, 64 * 1024)
        rows = array_at(segment, 0, (count, 784))
        rows[:] = np.random.default_rng(3).standard_normal((count, 784), dtype=np.float32)
        out_base = count * ROW_BYTES

        async def send() -> None:
            aio = aioclient.InferenceServerClient(joining_sidecar.url)

            async def one(index: int) -> None:
                item = aioclient.InferInput("x", [1, 784], "FP32")
                item.set_shared_memory("rows", ROW_BYTES, offset=index * ROW_BYTES)
                wanted = aioclient.InferRequestedOutput("output")
                wanted.set_shared_memory("rows", OUT_BYTES, offset=out_base + index * OUT_BYTES)
                await aio.infer("mlp", [item], outputs=[wanted])

            await asyncio.gather(*(one(index) for index in range(count)))
            await aio.close()

        executions = scrape_exec_count(joining_sidecar)
        asyncio.run(send())
        assert scrape_exec_count(joining_sidecar) - executions < count  # some requests were joined
        outputs = array_at(segment, out_base, (count, 10))
        np.testing.assert_allclose(outputs, expected(mlp_spec, rows), rtol=1e-4, atol=1e-5)
    finally:
        client.unregister_system_shared_memory()
        client.close()


def refused(call, code: str, message: str) -> None:
    with pytest.raises(InferenceServerException) as raised:
        call()
    assert raised.value.status() == f"StatusCode.{code}", raised.value
    assert message in raised.value.message(), raised.value.message()


def test_bad_registrations_and_references_are_refused(client, segment) -> None:
    key = "/" + segment.name
    register = client.register_system_shared_memory
    refused(lambda: register("up", "/../../etc/passwd", 16), "INVALID_ARGUMENT", "not a POSIX")
    refused(lambda: register("up", "/etc/passwd", 16), "INVALID_ARGUMENT", "not a POSIX")
    refused(lambda: register("up", "/cuvil-absent", 16), "INVALID_ARGUMENT", "cannot open")
    refused(lambda: register("up", key, 65 * 1024), "INVALID_ARGUMENT", "runs past the end")
    refused(lambda: register("up", key, 0), "INVALID_ARGUMENT", "must be positive")
    register("small", key, ROW_BYTES + OUT_BYTES - 4)
    refused(lambda: register("small", key, 16), "ALREADY_EXISTS", "already registered")
    refused(lambda: client.get_system_shared_memory_status("absent"), "NOT_FOUND", "'absent'")

    def infer(region: str, size: int, offset: int = 0, output: tuple | None = None) -> None:
        item = grpcclient.InferInput("x", [1, 784], "FP32")
        item.set_shared_memory(region, size, offset=offset)
        wanted = []
        if output is not None:
            wanted = [grpcclient.InferRequestedOutput("output")]
            wanted[0].set_shared_memory(*output)
        client.infer("mlp", [item], outputs=wanted or None)

    refused(lambda: infer("absent", ROW_BYTES), "INVALID_ARGUMENT", "no shared memory region")
    refused(lambda: infer("small", ROW_BYTES - 4), "INVALID_ARGUMENT", "takes 3136 bytes")
    refused(lambda: infer("small", ROW_BYTES, offset=64), "INVALID_ARGUMENT", "runs past the end")
    refused(
        lambda: infer("small", ROW_BYTES, output=("small", OUT_BYTES - 4, ROW_BYTES)),
        "INVALID_ARGUMENT",
        "needs 40 bytes",
    )
    refused(
        lambda: infer("small", ROW_BYTES, output=("small", OUT_BYTES, ROW_BYTES)),
        "INVALID_ARGUMENT",
        "runs past the end",
    )
    infer("small", ROW_BYTES)  # still serving


def test_raw_contents_pair_with_the_inputs_not_in_shared_memory(
    mlp_sidecar: Sidecar, segment
) -> None:
    """raw_input_contents carries one entry per input outside shared memory: an input in shared
    memory plus a raw entry is one entry too many, and typed contents cannot join it either."""
    with grpc.insecure_channel(mlp_sidecar.url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        stub.SystemSharedMemoryRegister(
            service_pb2.SystemSharedMemoryRegisterRequest(
                name="pairing", key="/" + segment.name, byte_size=ROW_BYTES
            )
        )
        request = service_pb2.ModelInferRequest(model_name="mlp")
        tensor = request.inputs.add(name="x", datatype="FP32", shape=[1, 784])
        tensor.parameters["shared_memory_region"].string_param = "pairing"
        tensor.parameters["shared_memory_byte_size"].int64_param = ROW_BYTES
        too_many = service_pb2.ModelInferRequest()
        too_many.CopyFrom(request)
        too_many.raw_input_contents.append(bytes(ROW_BYTES))
        typed = service_pb2.ModelInferRequest()
        typed.CopyFrom(request)
        typed.inputs[0].contents.fp32_contents.extend([0.0] * 784)
        for bad, message in ((too_many, "1 entries for 0 inputs"), (typed, "shared memory")):
            with pytest.raises(grpc.RpcError) as raised:
                stub.ModelInfer(bad, timeout=30)
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert message in raised.value.details()
        assert list(stub.ModelInfer(request, timeout=30).outputs[0].shape) == [1, 10]
        stub.SystemSharedMemoryUnregister(service_pb2.SystemSharedMemoryUnregisterRequest())


# The registry and the parameter parsing alone, no server


def test_registry_maps_checks_and_forgets(tmp_path: Path) -> None:
    (tmp_path / "seg").write_bytes(bytes(range(256)) * 4)
    registry = SharedMemoryRegistry(tmp_path)
    registry.register("a", "/seg", 100, 200)
    assert bytes(registry.view(SharedMemoryRef("a", 4, 10), "t")) == bytes([110, 111, 112, 113])
    with pytest.raises(InvalidInput, match="runs past the end of region 'a'"):
        registry.view(SharedMemoryRef("a", 8, 196), "t")
    with pytest.raises(AlreadyExists):
        registry.register("a", "/seg", 0, 8)
    with pytest.raises(InvalidInput, match="holds 1024 bytes"):
        registry.register("b", "seg", 1000, 25)
    for bad in ("/..", "/a/b", "../seg", "/", "/seg\0"):
        with pytest.raises(InvalidInput, match="not a POSIX shared memory name"):
            registry.register("c", bad, 0, 8)
    assert [region.name for region in registry.status("")] == ["a"]
    registry.unregister("never-registered")  # forgetting an unknown name is not an error
    registry.unregister("")
    with pytest.raises(RegionNotFound):
        registry.status("a")


def test_only_a_segment_of_the_clients_own_user_is_mapped(tmp_path: Path) -> None:
    """A link in the shared-memory folder is never followed (it could point at any file the
    sidecar may write), and a segment of another user is refused: not the client's to lend."""
    (tmp_path / "mine").write_bytes(bytes(64))
    (tmp_path / "link").symlink_to(tmp_path / "mine")
    registry = SharedMemoryRegistry(tmp_path)
    registry.register("mine", "/mine", 0, 64, owner=os.getuid())
    with pytest.raises(InvalidInput, match="cannot open shared memory key '/link'"):
        registry.register("link", "/link", 0, 64)
    other = os.getuid() + 1
    with pytest.raises(PermissionDenied, match=rf"belongs to uid {os.getuid()}, not to the "
                       rf"client's \({other}\)"):  # fmt: skip
        registry.register("theirs", "/mine", 0, 64, owner=other)
    registry.close()


def test_the_kernel_names_a_local_clients_user() -> None:
    import socket

    from cuvil_sidecar.peer_credentials import grpc_peer_uid, peer_uid

    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        host, port = client.getsockname()
        assert peer_uid(host, port) == os.getuid()
        assert grpc_peer_uid(f"ipv4:{host}:{port}") == os.getuid()
        assert grpc_peer_uid("unix:/tmp/socket") is None
        client.close()
    assert peer_uid("127.0.0.1", 1) is None  # no such socket


def test_a_segment_shrunk_after_registration_is_refused_not_read(tmp_path: Path) -> None:
    """Reading a mapping past the end of a truncated file would kill the process (SIGBUS)."""
    segment = tmp_path / "seg"
    segment.write_bytes(bytes(4096))
    registry = SharedMemoryRegistry(tmp_path)
    registry.register("a", "/seg", 0, 4096)
    assert len(registry.view(SharedMemoryRef("a", 4096), "t")) == 4096
    os.truncate(segment, 1024)
    assert len(registry.view(SharedMemoryRef("a", 1024), "t")) == 1024
    with pytest.raises(InvalidInput, match="shrank to 1024 bytes"):
        registry.view(SharedMemoryRef("a", 2048), "t")
    registry.close()


def test_registrations_are_bounded_and_give_back_descriptors(tmp_path: Path) -> None:
    (tmp_path / "seg").write_bytes(bytes(64))
    registry = SharedMemoryRegistry(tmp_path)
    before = len(os.listdir("/proc/self/fd"))
    for index in range(MAX_REGIONS):
        registry.register(f"r{index}", "/seg", 0, 64)
    with pytest.raises(TooManyRegions):
        registry.register("one-more", "/seg", 0, 64)
    registry.unregister("")
    assert len(os.listdir("/proc/self/fd")) == before


@pytest.mark.parametrize(
    ("parameters", "found"),
    [
        ({}, None),
        ({"other": 1}, None),
        (
            {"shared_memory_region": "r", "shared_memory_byte_size": 8},
            SharedMemoryRef("r", 8, 0),
        ),
        (
            {"shared_memory_region": "r", "shared_memory_byte_size": 8, "shared_memory_offset": 4},
            SharedMemoryRef("r", 8, 4),
        ),
    ],
)
def test_reference_from_parameters(parameters: dict, found) -> None:
    assert reference("x", parameters) == found


@pytest.mark.parametrize(
    "parameters",
    [
        {"shared_memory_byte_size": 8},
        {"shared_memory_region": "", "shared_memory_byte_size": 8},
        {"shared_memory_region": 3, "shared_memory_byte_size": 8},
        {"shared_memory_region": "r"},
        {"shared_memory_region": "r", "shared_memory_byte_size": -1},
        {"shared_memory_region": "r", "shared_memory_byte_size": True},
        {"shared_memory_region": "r", "shared_memory_byte_size": 8, "shared_memory_offset": 0.5},
    ],
)
def test_bad_reference_parameters(parameters: dict) -> None:
    with pytest.raises(InvalidInput, match="'x'"):
        reference("x", parameters)


def test_turned_off_answers_unimplemented() -> None:
    from cuvil_sidecar.dataplane import DataPlane

    config = SidecarConfig.from_env({"CUVIL_MODEL": "m", "CUVIL_SHARED_MEMORY": "off"})
    dataplane = DataPlane(None, None, config)  # type: ignore[arg-type]
    assert dataplane.server_metadata().extensions == ()
    with pytest.raises(NotSupported, match="CUVIL_SHARED_MEMORY=off"):
        dataplane.register_shared_memory("a", "/seg", 0, 8)
    assert SidecarConfig.from_env({"CUVIL_MODEL": "m"}).shared_memory
