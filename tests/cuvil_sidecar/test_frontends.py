"""The two gRPC front ends (``CUVIL_GRPC_FRONTEND``): which one serves, the protocol edges the
native one handles itself (unparseable bytes, unknown methods, health Watch), choosing and
refusing without a toolchain, and draining in-flight calls on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from cuvil_sidecar.native_frontend import parse_metadata
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests.cuvil_sidecar.conftest import REPO, Sidecar, ready_sidecar

MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"


def infer_mlp(client: grpcclient.InferenceServerClient, rows: int = 1) -> np.ndarray:
    x = np.random.default_rng(rows).standard_normal((rows, 784), dtype=np.float32)
    item = grpcclient.InferInput("x", list(x.shape), "FP32")
    item.set_data_from_numpy(x)
    return client.infer("mlp", [item]).as_numpy("output")


def sized(*fields: bytes) -> bytes:
    return b"".join(struct.pack("=I", len(field)) + field for field in fields)


def test_metadata_pairs_from_the_native_encoding() -> None:
    blob = sized(b"traceparent", b"00-ab-cd-01", b"trace-bin", b"\x00\x01\x00", b"empty", b"")
    assert parse_metadata(blob) == (
        ("traceparent", "00-ab-cd-01"),
        ("trace-bin", b"\x00\x01\x00"),
        ("empty", ""),
    )
    assert parse_metadata(b"") == ()


def test_the_log_names_the_front_end(mlp_sidecar: Sidecar) -> None:
    assert f"({mlp_sidecar.frontend}), metrics" in mlp_sidecar.log()


def test_unparseable_request_bytes_get_a_status(mlp_sidecar: Sidecar) -> None:
    """Bytes that are no ModelInferRequest: INVALID_ARGUMENT on the native front end (grpcio
    answers UNKNOWN); the next request is served."""
    expected = {"native": grpc.StatusCode.INVALID_ARGUMENT, "grpcio": grpc.StatusCode.UNKNOWN}
    with grpc.insecure_channel(mlp_sidecar.url) as channel:
        call = channel.unary_unary(MODEL_INFER)
        with pytest.raises(grpc.RpcError) as raised:
            call(b"\xff\xff\xff\xff", timeout=10)
        assert raised.value.code() == expected[mlp_sidecar.frontend]
        unknown = channel.unary_unary("/inference.GRPCInferenceService/NoSuchMethod")
        with pytest.raises(grpc.RpcError) as raised:
            unknown(b"", timeout=10)
        assert raised.value.code() == grpc.StatusCode.UNIMPLEMENTED
    client = grpcclient.InferenceServerClient(mlp_sidecar.url)
    assert infer_mlp(client).shape == (1, 10)
    client.close()


def test_health_watch_streams_the_status(mlp_sidecar: Sidecar) -> None:
    with grpc.insecure_channel(mlp_sidecar.url) as channel:
        stream = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service="inference.GRPCInferenceService"), timeout=10
        )
        assert next(stream).status == health_pb2.HealthCheckResponse.SERVING
        stream.cancel()


def without_toolchain(tmp_path: Path) -> dict[str, str]:
    """No compiler or pkg-config on PATH and an empty native cache: nothing can be built."""
    return {"PATH": str(tmp_path / "bin-none"), "CUVIL_NATIVE_CACHE": str(tmp_path / "cache")}


def test_auto_falls_back_to_grpcio_and_says_why(mlp_artifact: Path, tmp_path: Path) -> None:
    sidecar = Sidecar(
        mlp_artifact,
        tmp_path / "sidecar.log",
        CUVIL_GRPC_FRONTEND="auto",
        **without_toolchain(tmp_path),
    )
    with ready_sidecar(sidecar):
        client = grpcclient.InferenceServerClient(sidecar.url)
        assert infer_mlp(client).shape == (1, 10)
        client.close()
        log = sidecar.log()
    assert "native gRPC front end is not available (pkg-config is not installed" in log
    assert "(grpcio), metrics" in log


def test_a_prebuilt_front_end_needs_no_toolchain(mlp_artifact: Path, tmp_path: Path) -> None:
    """What the image does: ``python -m cuvil_sidecar.native`` fills the cache at build time,
    and the sidecar then loads the library with no compiler or pkg-config on PATH."""
    environ = dict(os.environ, CUVIL_NATIVE_CACHE=str(tmp_path / "cache"))
    environ["PYTHONPATH"] = os.pathsep.join([str(REPO / "runtime_sidecar"), str(REPO)])
    built = subprocess.run(
        [sys.executable, "-m", "cuvil_sidecar.native"],
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert built.returncode == 0, built.stderr
    assert Path(built.stdout.strip()).parent == tmp_path / "cache"
    sidecar = Sidecar(
        mlp_artifact,
        tmp_path / "sidecar.log",
        CUVIL_GRPC_FRONTEND="native",
        PATH=str(tmp_path / "bin-none"),
        CUVIL_NATIVE_CACHE=str(tmp_path / "cache"),
    )
    with ready_sidecar(sidecar):
        client = grpcclient.InferenceServerClient(sidecar.url)
        assert infer_mlp(client).shape == (1, 10)
        client.close()
        assert "(native), metrics" in sidecar.log()


def test_native_without_toolchain_refuses_to_start(mlp_artifact: Path, tmp_path: Path) -> None:
    sidecar = Sidecar(
        mlp_artifact,
        tmp_path / "sidecar.log",
        CUVIL_GRPC_FRONTEND="native",
        **without_toolchain(tmp_path),
    )
    assert sidecar.process.wait(120) == 2
    sidecar.stop()
    assert "cuvil-sidecar: CUVIL_GRPC_FRONTEND=native: pkg-config is not installed" in sidecar.log()


def test_unknown_front_end_is_a_config_error(mlp_artifact: Path, tmp_path: Path) -> None:
    sidecar = Sidecar(mlp_artifact, tmp_path / "sidecar.log", CUVIL_GRPC_FRONTEND="h2o")
    assert sidecar.process.wait(60) == 2
    sidecar.stop()
    assert "CUVIL_GRPC_FRONTEND='h2o' is not one of" in sidecar.log()


def slow_batching_sidecar(artifact: Path, tmp_path: Path, frontend: str) -> Sidecar:
    """Batching with a 300 ms window that even a lone request waits out, in flight."""
    return Sidecar(
        artifact,
        tmp_path / "sidecar.log",
        CUVIL_GRPC_FRONTEND=frontend,
        CUVIL_MAX_BATCH_SIZE="8",
        CUVIL_MAX_QUEUE_DELAY_US="300000",
        CUVIL_LONE_REQUESTS="wait",
    )


@pytest.mark.parametrize("frontend", ["native", "grpcio"])
def test_sigterm_drains_in_flight_calls(mlp_artifact: Path, tmp_path: Path, frontend: str) -> None:
    """Requests held in a 300 ms batching window when SIGTERM comes are still answered; the
    process then exits 0 and the port is closed."""
    sidecar = slow_batching_sidecar(mlp_artifact, tmp_path, frontend)
    probe = grpcclient.InferenceServerClient(sidecar.url)
    sidecar.wait_ready(probe)
    probe.close()

    async def requests_across_sigterm() -> list[np.ndarray]:
        client = aioclient.InferenceServerClient(sidecar.url)
        x = np.ones((1, 784), np.float32)
        item = aioclient.InferInput("x", [1, 784], "FP32")
        item.set_data_from_numpy(x)
        calls = [asyncio.ensure_future(client.infer("mlp", [item])) for _ in range(3)]
        await asyncio.sleep(0.1)  # all three are waiting in the batcher now
        os.kill(sidecar.process.pid, signal.SIGTERM)
        try:
            return [result.as_numpy("output") for result in await asyncio.gather(*calls)]
        finally:
            await client.close()

    outputs = asyncio.run(requests_across_sigterm())
    assert len(outputs) == 3 and all(output.shape == (1, 10) for output in outputs)
    assert sidecar.process.wait(30) == 0
    sidecar.stop()
    client = grpcclient.InferenceServerClient(sidecar.url)
    with pytest.raises(InferenceServerException, match=r"(?i)unavailable|failed to connect"):
        client.is_server_live(client_timeout=2)
    client.close()


@pytest.mark.parametrize("frontend", ["native", "grpcio"])
def test_a_call_the_client_gave_up_on_does_not_stall_the_server(
    mlp_artifact: Path, tmp_path: Path, frontend: str
) -> None:
    """A client deadline that passes while the request waits in a 300 ms batching window: the
    client gets DEADLINE_EXCEEDED, the server answers the abandoned call into the void, and the
    next requests are served."""
    with ready_sidecar(slow_batching_sidecar(mlp_artifact, tmp_path, frontend)) as sidecar:
        client = grpcclient.InferenceServerClient(sidecar.url)
        x = np.ones((1, 784), np.float32)
        item = grpcclient.InferInput("x", [1, 784], "FP32")
        item.set_data_from_numpy(x)
        with pytest.raises(InferenceServerException, match="Deadline"):
            client.infer("mlp", [item], client_timeout=0.05)
        for _ in range(3):
            answer = client.infer("mlp", [item], client_timeout=10)
            assert answer.as_numpy("output").shape == (1, 10)
        assert client.is_server_live()
        client.close()
