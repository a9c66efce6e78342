"""The rest of Triton's gRPC service through NVIDIA's tritonclient, on both gRPC front ends:
the repository index, the model configuration in Triton's shape, statistics that move as
requests are served, bidirectional streaming with errors in the stream, and repository
load/unload refused with a clear status."""

from __future__ import annotations

import queue

import grpc
import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests.cuvil_sidecar.conftest import Sidecar, eager
from tests.cuvil_sidecar.test_server import infer_mlp


def test_repository_index(mlp_sidecar: Sidecar) -> None:
    client = grpcclient.InferenceServerClient(mlp_sidecar.url)
    index = client.get_model_repository_index(as_json=True)
    assert index["models"] == [{"name": "mlp", "version": "1", "state": "READY"}]
    client.close()


def test_model_config_in_tritons_shape(mlp_sidecar: Sidecar) -> None:
    client = grpcclient.InferenceServerClient(mlp_sidecar.url)
    config = client.get_model_config("mlp", as_json=True)["config"]
    assert config["name"] == "mlp"
    assert config["platform"].startswith("cuvil_") and config["backend"] == "cuvil"
    assert config["max_batch_size"] == 64  # the artifact's batch Dim runs 1..64
    # dims without the batch dim, as Triton's are when max_batch_size > 0
    assert config["input"] == [{"name": "x", "data_type": "TYPE_FP32", "dims": ["784"]}]
    assert config["output"] == [{"name": "output", "data_type": "TYPE_FP32", "dims": ["10"]}]
    batching = config["dynamic_batching"]
    assert batching["max_queue_delay_microseconds"] == "2000"  # the fixture's setting
    assert config["instance_group"] == [{"name": "mlp", "kind": "KIND_CPU", "count": 1}]
    with pytest.raises(InferenceServerException, match="no model named 'resnet'"):
        client.get_model_config("resnet")
    client.close()


def test_statistics_move_as_requests_are_served(mlp_sidecar: Sidecar) -> None:
    client = grpcclient.InferenceServerClient(mlp_sidecar.url)

    def stats() -> dict:
        (entry,) = client.get_inference_statistics("mlp", as_json=True)["model_stats"]
        return entry

    before = stats()
    x = np.random.default_rng(3).standard_normal((3, 784), dtype=np.float32)
    for _ in range(4):
        infer_mlp(client, x)
    after = stats()
    assert after["name"] == "mlp" and after["version"] == "1"

    def count(entry: dict, key: str) -> int:
        return int(entry.get(key, 0))

    def duration(entry: dict, key: str, field: str) -> int:
        return int(entry["inference_stats"].get(key, {}).get(field, 0))

    assert count(after, "inference_count") - count(before, "inference_count") == 12  # rows
    executions = count(after, "execution_count") - count(before, "execution_count")
    assert 1 <= executions <= 4
    assert duration(after, "success", "count") - duration(before, "success", "count") == 4
    assert duration(after, "success", "ns") > duration(before, "success", "ns")
    assert duration(after, "compute_infer", "ns") > duration(before, "compute_infer", "ns")
    assert duration(after, "queue", "count") - duration(before, "queue", "count") == 4
    assert duration(after, "fail", "count") == duration(before, "fail", "count")
    wrong = grpcclient.InferInput("x", [1, 783], "FP32")  # the model takes 784 columns
    wrong.set_data_from_numpy(np.zeros((1, 783), dtype=np.float32))
    for _ in range(2):
        with pytest.raises(InferenceServerException, match="784"):
            client.infer("mlp", [wrong])
    failed = stats()
    assert duration(failed, "fail", "count") - duration(after, "fail", "count") == 2
    assert duration(failed, "fail", "ns") > duration(after, "fail", "ns")  # each took its time
    assert duration(failed, "success", "count") == duration(after, "success", "count")
    assert int(after["last_inference"]) >= int(before.get("last_inference", 0))
    assert int(after["last_inference"]) > 1.7e12  # milliseconds since the epoch
    (every,) = client.get_inference_statistics(as_json=True)["model_stats"]  # no name: all
    assert every["name"] == "mlp"
    client.close()


def test_stream_one_response_per_request_errors_in_stream(mlp_sidecar: Sidecar, mlp_spec) -> None:
    client = grpcclient.InferenceServerClient(mlp_sidecar.url)
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    rng = np.random.default_rng(4)
    sent = {}
    for i in range(6):
        x = rng.standard_normal((1 + i % 3, 784), dtype=np.float32)
        item = grpcclient.InferInput("x", list(x.shape), "FP32")
        item.set_data_from_numpy(x)
        client.async_stream_infer("mlp", [item], request_id=f"r{i}")
        sent[f"r{i}"] = x
    wrong = grpcclient.InferInput("x", [2, 783], "FP32")  # the model takes 784 columns
    wrong.set_data_from_numpy(np.zeros((2, 783), dtype=np.float32))
    client.async_stream_infer("mlp", [wrong], request_id="bad")
    missing = grpcclient.InferInput("x", [1, 784], "FP32")
    missing.set_data_from_numpy(np.zeros((1, 784), dtype=np.float32))
    client.async_stream_infer("resnet", [missing], request_id="nomodel")
    got, errors = {}, []
    for _ in range(8):
        result, error = answers.get(timeout=30)
        if error is not None:
            errors.append(str(error))
        else:
            got[result.get_response().id] = result.as_numpy("output")
    client.stop_stream()
    assert sorted(got) == sorted(sent)  # one answer per request, each with its own id
    for request_id, x in sent.items():
        expected = eager(mlp_spec.model, {"x": torch.from_numpy(x)}).numpy()
        np.testing.assert_allclose(got[request_id], expected, rtol=1e-4, atol=1e-5)
    assert len(errors) == 2
    assert any("784" in message for message in errors), errors
    assert any("no model named 'resnet'" in message for message in errors), errors
    # the stream went on after its errors, and the server serves as before
    assert client.is_server_ready()
    client.close()


def test_repository_load_and_unload_refused(mlp_sidecar: Sidecar) -> None:
    with grpc.insecure_channel(mlp_sidecar.url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for call, request in (
            (stub.RepositoryModelLoad, service_pb2.RepositoryModelLoadRequest(model_name="mlp")),
            (
                stub.RepositoryModelUnload,
                service_pb2.RepositoryModelUnloadRequest(model_name="mlp"),
            ),
        ):
            with pytest.raises(grpc.RpcError) as caught:
                call(request)
            assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
            assert "not supported" in caught.value.details()
        ready = stub.ModelReady(service_pb2.ModelReadyRequest(name="mlp"))
        assert ready.ready
