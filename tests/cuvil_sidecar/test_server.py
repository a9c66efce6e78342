"""The MLP sidecar through NVIDIA's tritonclient: health, metadata, raw and typed contents,
batching that joins concurrent requests and splits them exactly, and /metrics moving."""

from __future__ import annotations

import asyncio
import os
import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from cuvil_sidecar.main import OMP_SPIN
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests.cuvil_sidecar.conftest import Sidecar, eager


def infer_mlp(client: grpcclient.InferenceServerClient, x: np.ndarray) -> np.ndarray:
    item = grpcclient.InferInput("x", list(x.shape), "FP32")
    item.set_data_from_numpy(x)
    return client.infer("mlp", [item]).as_numpy("output")


def metric(text: str, name: str) -> float:
    match = re.search(rf'^{name}{{model="mlp",version="1"}} (\S+)$', text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def scrape(sidecar: Sidecar) -> str:
    with urllib.request.urlopen(sidecar.metrics_url + "/metrics", timeout=10) as response:
        return response.read().decode()


def test_health_metadata_and_inference(mlp_sidecar: Sidecar, mlp_spec) -> None:
    client = grpcclient.InferenceServerClient(mlp_sidecar.url)
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("mlp") and client.is_model_ready("mlp", "1")
    server = client.get_server_metadata()
    assert server.name == "cuvil"
    metadata = client.get_model_metadata("mlp")
    with urllib.request.urlopen(mlp_sidecar.metrics_url + "/v2/health/ready", timeout=10) as r:
        served = r.read().decode().split()[2]  # "ready: mlp sha256:…": the digest it serves
    assert metadata.name == "mlp" and list(metadata.versions) == ["1", served]
    assert served.startswith("sha256:") and client.is_model_ready("mlp", served)
    assert client.get_model_metadata("mlp", served).versions == metadata.versions
    with pytest.raises(InferenceServerException, match=f"has no version 'sha256:0+'.*{served}"):
        client.get_model_metadata("mlp", "sha256:" + "0" * 64)
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.inputs] == [
        ("x", "FP32", [-1, 784])
    ]
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.outputs] == [
        ("output", "FP32", [-1, 10])
    ]
    x = np.random.default_rng(0).standard_normal((3, 784), dtype=np.float32)
    expected = eager(mlp_spec.model, {"x": torch.from_numpy(x)}).numpy()
    np.testing.assert_allclose(infer_mlp(client, x), expected, rtol=1e-4, atol=1e-5)
    with pytest.raises(InferenceServerException, match="no model named 'resnet'"):
        client.is_model_ready("resnet")
    client.close()


def test_typed_contents_equal_raw(mlp_sidecar: Sidecar) -> None:
    """The same tensor as fp32_contents and as raw bytes gives the same answer (NVIDIA's own
    generated stubs build the typed request: its high-level client always sends raw)."""
    x = np.random.default_rng(1).standard_normal((2, 784), dtype=np.float32)
    with grpc.insecure_channel(mlp_sidecar.url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        typed = service_pb2.ModelInferRequest(model_name="mlp", id="typed")
        tensor = typed.inputs.add(name="x", datatype="FP32", shape=[2, 784])
        tensor.contents.fp32_contents.extend(x.ravel().tolist())
        raw = service_pb2.ModelInferRequest(model_name="mlp", raw_input_contents=[x.tobytes()])
        raw.inputs.add(name="x", datatype="FP32", shape=[2, 784])
        a, b = stub.ModelInfer(typed), stub.ModelInfer(raw)
        assert a.id == "typed" and a.outputs[0].datatype == "FP32"
        assert list(a.outputs[0].shape) == [2, 10]
        assert a.raw_output_contents[0] == b.raw_output_contents[0]
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="inference.GRPCInferenceService")
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_aio_client_concurrent_requests_are_joined_and_split(
    joining_sidecar: Sidecar, mlp_spec
) -> None:
    """32 concurrent requests of 1-3 rows each: every response equals eager on its own rows, and
    /metrics shows fewer executions than requests (batches were joined)."""
    before = scrape(joining_sidecar)
    rng = np.random.default_rng(2)
    batches = [rng.standard_normal((1 + i % 3, 784), dtype=np.float32) for i in range(32)]

    async def run() -> list[np.ndarray]:
        client = aioclient.InferenceServerClient(joining_sidecar.url)
        assert await client.is_server_ready()

        async def one(x: np.ndarray) -> np.ndarray:
            item = aioclient.InferInput("x", list(x.shape), "FP32")
            item.set_data_from_numpy(x)
            return (await client.infer("mlp", [item])).as_numpy("output")

        try:
            return list(await asyncio.gather(*(one(x) for x in batches)))
        finally:
            await client.close()

    results = asyncio.run(run())
    for x, y in zip(batches, results, strict=True):
        expected = eager(mlp_spec.model, {"x": torch.from_numpy(x)}).numpy()
        assert y.shape == expected.shape
        np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-5)
    after = scrape(joining_sidecar)
    requests = metric(after, "nv_inference_request_success") - metric(
        before, "nv_inference_request_success"
    )
    rows = metric(after, "nv_inference_count") - metric(before, "nv_inference_count")
    executions = metric(after, "nv_inference_exec_count") - metric(
        before, "nv_inference_exec_count"
    )
    assert requests == 32 and rows == sum(len(x) for x in batches)
    assert executions < 32, after


def test_metrics_move(mlp_sidecar: Sidecar) -> None:
    before = scrape(mlp_sidecar)
    client = grpcclient.InferenceServerClient(mlp_sidecar.url)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda _: infer_mlp(client, np.ones((2, 784), np.float32)), range(8)))
    bad = grpcclient.InferInput("x", [2, 783], "FP32")
    bad.set_data_from_numpy(np.ones((2, 783), np.float32))
    with pytest.raises(InferenceServerException, match="dim 1 is 783, expected 784"):
        client.infer("mlp", [bad])
    client.close()
    after = scrape(mlp_sidecar)
    for name, delta in (
        ("nv_inference_request_success", 8),
        ("nv_inference_request_failure", 1),
        ("nv_inference_count", 16),
    ):
        assert metric(after, name) - metric(before, name) == delta, (name, after)
    for name in (
        "nv_inference_exec_count",
        "nv_inference_request_duration_us",
        "nv_inference_queue_duration_us",
        "nv_inference_compute_infer_duration_us",
    ):
        assert metric(after, name) > metric(before, name), (name, after)
    assert "# TYPE nv_inference_count counter" in after
    assert 'cuvil_model_ready{model="mlp",version="1"} 1' in after
    with urllib.request.urlopen(mlp_sidecar.metrics_url + "/v2/health/ready") as response:
        assert response.status == 200


def test_reflection_lists_the_services(mlp_sidecar: Sidecar) -> None:
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    with grpc.insecure_channel(mlp_sidecar.url) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = set(database.get_services())
        assert {"inference.GRPCInferenceService", "grpc.health.v1.Health"} <= services
        described = database.FindFileContainingSymbol("inference.GRPCInferenceService")
        assert "ModelInfer" in [method.name for method in described.service[0].method]


def test_openmp_threads_spin_briefly(mlp_sidecar: Sidecar) -> None:
    """Set before torch loads libgomp (cuvil_sidecar/main.py); the log says what holds."""
    assert f"OpenMP spin: GOMP_SPINCOUNT={OMP_SPIN}" in mlp_sidecar.log()


def test_an_operators_spin_count_wins_and_a_late_one_is_told(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    from cuvil_sidecar.main import set_omp_spin

    log = logging.getLogger("test-spin")
    monkeypatch.setenv("GOMP_SPINCOUNT", "50")
    with caplog.at_level(logging.INFO, "test-spin"):
        set_omp_spin(log)
        assert "GOMP_SPINCOUNT=50, as set" in caplog.text
        monkeypatch.delenv("GOMP_SPINCOUNT")
        set_omp_spin(log)  # torch is loaded in this process: too late to set
    assert "libgomp's default (torch was loaded first" in caplog.text
    assert "GOMP_SPINCOUNT" not in os.environ
