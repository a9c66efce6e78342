"""The Open Inference Protocol over REST through NVIDIA's tritonclient.http (sync and aio, JSON
and binary data): health, metadata, readiness, config, statistics, the repository index, and
inference checked against eager PyTorch; errors as {"error": ...} with the right status; the
same metrics as gRPC."""

from __future__ import annotations

import asyncio
import http.client
import json
import re

import numpy as np
import pytest
import torch
import tritonclient.http as httpclient
import tritonclient.http.aio as aiohttpclient
from tritonclient.utils import InferenceServerException

from tests.cuvil_sidecar.conftest import Sidecar, eager
from tests.cuvil_sidecar.test_server import metric, scrape


def raw_request(
    sidecar: Sidecar, method: str, path: str, body: bytes = b"", headers: dict | None = None
) -> tuple[int, dict[str, str], bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", sidecar.http_port, timeout=30)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def expected(mlp_spec, x: np.ndarray) -> np.ndarray:
    return eager(mlp_spec.model, {"x": torch.from_numpy(x)}).numpy()


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_sync_client_infers(mlp_sidecar: Sidecar, mlp_spec, binary: bool) -> None:
    client = httpclient.InferenceServerClient(mlp_sidecar.http_url)
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("mlp") and client.is_model_ready("mlp", "1")
    assert client.get_server_metadata()["name"] == "cuvil"
    metadata = client.get_model_metadata("mlp")
    assert metadata["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 784]}]
    x = np.random.default_rng(10).standard_normal((3, 784), dtype=np.float32)
    item = httpclient.InferInput("x", list(x.shape), "FP32")
    item.set_data_from_numpy(x, binary_data=binary)
    output = httpclient.InferRequestedOutput("output", binary_data=binary)
    result = client.infer("mlp", [item], outputs=[output], request_id="abc")
    assert result.get_response()["id"] == "abc"
    np.testing.assert_allclose(result.as_numpy("output"), expected(mlp_spec, x), 1e-4, 1e-5)
    client.close()


def test_binary_outputs_by_default(mlp_sidecar: Sidecar, mlp_spec) -> None:
    """No outputs named: tritonclient asks for every output as binary (binary_data_output)."""
    x = np.random.default_rng(11).standard_normal((2, 784), dtype=np.float32)
    item = httpclient.InferInput("x", list(x.shape), "FP32")
    item.set_data_from_numpy(x)
    client = httpclient.InferenceServerClient(mlp_sidecar.http_url)
    result = client.infer("mlp", [item])
    parameters = result.get_output("output")["parameters"]
    assert parameters == {"binary_data_size": 2 * 10 * 4}
    np.testing.assert_allclose(result.as_numpy("output"), expected(mlp_spec, x), 1e-4, 1e-5)
    client.close()


def test_aio_client_concurrent(mlp_sidecar: Sidecar, mlp_spec) -> None:
    rng = np.random.default_rng(12)
    inputs = [rng.standard_normal((1 + i % 4, 784), dtype=np.float32) for i in range(16)]

    async def main() -> list[np.ndarray]:
        client = aiohttpclient.InferenceServerClient(mlp_sidecar.http_url)
        try:
            assert await client.is_server_ready()
            assert (await client.get_model_config("mlp"))["max_batch_size"] == 64

            async def one(x: np.ndarray, binary: bool) -> np.ndarray:
                item = aiohttpclient.InferInput("x", list(x.shape), "FP32")
                item.set_data_from_numpy(x, binary_data=binary)
                out = aiohttpclient.InferRequestedOutput("output", binary_data=binary)
                return (await client.infer("mlp", [item], outputs=[out])).as_numpy("output")

            return await asyncio.gather(*(one(x, i % 2 == 0) for i, x in enumerate(inputs)))
        finally:
            await client.close()

    for x, got in zip(inputs, asyncio.run(main()), strict=True):
        np.testing.assert_allclose(got, expected(mlp_spec, x), rtol=1e-4, atol=1e-5)


def test_config_statistics_and_index(mlp_sidecar: Sidecar) -> None:
    client = httpclient.InferenceServerClient(mlp_sidecar.http_url)
    config = client.get_model_config("mlp")
    assert config["input"] == [{"name": "x", "data_type": "TYPE_FP32", "dims": [784]}]
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 2000
    assert client.get_model_repository_index() == [
        {"name": "mlp", "version": "1", "state": "READY"}
    ]
    before = client.get_inference_statistics("mlp")["model_stats"][0]
    x = np.ones((2, 784), dtype=np.float32)
    item = httpclient.InferInput("x", [2, 784], "FP32")
    item.set_data_from_numpy(x)
    client.infer("mlp", [item])
    after = client.get_inference_statistics()["model_stats"][0]
    assert after["inference_count"] - before["inference_count"] == 2
    assert after["inference_stats"]["success"]["count"] == (
        before["inference_stats"]["success"]["count"] + 1
    )
    client.close()


def test_errors_are_json_with_status(mlp_sidecar: Sidecar) -> None:
    client = httpclient.InferenceServerClient(mlp_sidecar.http_url)
    item = httpclient.InferInput("x", [2, 783], "FP32")
    item.set_data_from_numpy(np.zeros((2, 783), dtype=np.float32))
    with pytest.raises(InferenceServerException, match="784") as caught:
        client.infer("mlp", [item])
    assert caught.value.status() == "400"
    with pytest.raises(InferenceServerException, match="no model named 'resnet'") as caught:
        client.get_model_metadata("resnet")
    assert caught.value.status() == "404"
    client.close()
    cases = [
        ("GET", "/v2/nothing", b"", 404),
        ("DELETE", "/v2/models/mlp", b"", 405),
        ("POST", "/v2/models/mlp/infer", b"{not json", 400),
        ("POST", "/v2/models/mlp/infer", b'{"inputs": []}', 400),
        ("POST", "/v2/repository/models/mlp/load", b"", 501),
        ("GET", "/v2/models/mlp/versions/7", b"", 404),
    ]
    for method, path, body, status in cases:
        code, headers, answer = raw_request(mlp_sidecar, method, path, body)
        assert code == status, (method, path, answer)
        assert headers["Content-Type"] == "application/json"
        assert json.loads(answer)["error"], (method, path)


def test_http_requests_count_in_metrics(mlp_sidecar: Sidecar) -> None:
    before = scrape(mlp_sidecar)
    client = httpclient.InferenceServerClient(mlp_sidecar.http_url)
    item = httpclient.InferInput("x", [1, 784], "FP32")
    item.set_data_from_numpy(np.ones((1, 784), dtype=np.float32))
    for _ in range(3):
        client.infer("mlp", [item])
    bad = httpclient.InferInput("x", [1, 5], "FP32")
    bad.set_data_from_numpy(np.ones((1, 5), dtype=np.float32))
    with pytest.raises(InferenceServerException):
        client.infer("mlp", [bad])
    client.close()
    after = scrape(mlp_sidecar)
    for name, moved in (("nv_inference_request_success", 3), ("nv_inference_request_failure", 1)):
        assert metric(after, name) - metric(before, name) == moved, name
    count = 'cuvil_request_duration_seconds_count{model="mlp",version="1"}'
    assert count in after


def test_latency_histograms_and_pending_gauge(mlp_sidecar: Sidecar) -> None:
    """Request, queue and compute histograms with Triton's model/version labels: cumulative
    buckets, a +Inf bucket equal to the count, and the count moving with each success."""
    client = httpclient.InferenceServerClient(mlp_sidecar.http_url)
    item = httpclient.InferInput("x", [1, 784], "FP32")
    item.set_data_from_numpy(np.ones((1, 784), dtype=np.float32))
    before = scrape(mlp_sidecar)
    for _ in range(5):
        client.infer("mlp", [item])
    client.close()
    text = scrape(mlp_sidecar)
    labels = 'model="mlp",version="1"'
    for stage in ("request", "queue", "compute"):
        name = f"cuvil_{stage}_duration_seconds"
        assert f"# TYPE {name} histogram" in text
        buckets = [
            float(value)
            for value in re.findall(rf'^{name}_bucket{{{labels},le="[^"]+"}} (\S+)$', text, re.M)
        ]
        assert len(buckets) == 15 and buckets == sorted(buckets)
        count = metric(text, f"{name}_count")
        assert buckets[-1] == count
        assert count - metric(before, f"{name}_count") == 5
        assert metric(text, f"{name}_sum") > 0
    assert metric(text, "nv_inference_pending_request_count") == 0
    assert 0 <= metric(text, "nv_cpu_utilization") <= 1
    assert metric(text, "nv_cpu_memory_used_bytes") > 50 * 2**20  # torch and the model, resident
    assert f"nv_cpu_memory_used_bytes{{{labels}}}" in text


def test_kserve_v2_wire_format_with_requests(mlp_sidecar: Sidecar, mlp_spec) -> None:
    """KServe's v2 REST protocol as its documentation writes it (JSON tensors, nested data,
    outputs named), posted with `requests` as KServe's own REST client posts it."""
    import requests

    x = np.random.default_rng(13).standard_normal((2, 784), dtype=np.float32)
    body = {
        "id": "kserve-1",
        "inputs": [{"name": "x", "shape": [2, 784], "datatype": "FP32", "data": x.tolist()}],
        "outputs": [{"name": "output"}],
    }
    base = f"http://{mlp_sidecar.http_url}"
    for path, health in (
        ("/v2/health/live", {"live": True}),
        ("/v2/health/ready", {"ready": True}),
        ("/v2/models/mlp/ready", {"name": "mlp", "ready": True}),
    ):
        answer = requests.get(f"{base}{path}", timeout=10)
        assert answer.status_code == 200 and answer.json() == health, path
    answer = requests.post(f"{base}/v2/models/mlp/infer", json=body, timeout=30)
    assert answer.status_code == 200 and answer.headers["Content-Type"] == "application/json"
    document = answer.json()
    assert document["id"] == "kserve-1" and document["model_name"] == "mlp"
    (output,) = document["outputs"]
    assert output["name"] == "output" and output["shape"] == [2, 10]
    got = np.asarray(output["data"], dtype=np.float32).reshape(2, 10)
    np.testing.assert_allclose(got, expected(mlp_spec, x), rtol=1e-4, atol=1e-5)
    wrong = requests.post(f"{base}/v2/models/mlp/infer", json={"inputs": "x"}, timeout=30)
    assert wrong.status_code == 400 and "inputs" in wrong.json()["error"]


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_requests_and_answers(mlp_sidecar: Sidecar, mlp_spec, algorithm: str) -> None:
    x = np.random.default_rng(14).standard_normal((2, 784), dtype=np.float32)
    item = httpclient.InferInput("x", list(x.shape), "FP32")
    item.set_data_from_numpy(x)
    client = httpclient.InferenceServerClient(mlp_sidecar.http_url)
    result = client.infer(
        "mlp",
        [item],
        request_compression_algorithm=algorithm,
        response_compression_algorithm=algorithm,
    )
    np.testing.assert_allclose(result.as_numpy("output"), expected(mlp_spec, x), 1e-4, 1e-5)
    client.close()


def test_compressed_bodies_are_checked(mlp_sidecar: Sidecar) -> None:
    import gzip

    bomb = gzip.compress(b"\0" * (64 * 2**20))  # 64 MiB of zeros in ~64 KB: past the 4 MiB limit
    status, _, answer = raw_request(
        mlp_sidecar, "POST", "/v2/models/mlp/infer", bomb, {"Content-Encoding": "gzip"}
    )
    assert status == 413 and b"inflates to more than" in answer
    cut = gzip.compress(b'{"inputs": []}')[:-6]
    status, _, answer = raw_request(
        mlp_sidecar, "POST", "/v2/models/mlp/infer", cut, {"Content-Encoding": "gzip"}
    )
    assert status == 400, answer
    status, _, answer = raw_request(
        mlp_sidecar, "POST", "/v2/models/mlp/infer", b"{}", {"Content-Encoding": "br"}
    )
    assert status == 415 and json.loads(answer)["error"]
