"""Compiled MiniLM and ResNet-50 served to NVIDIA's client, sync and aio: not ready until warm-up
and the golden check finish, then liveness, readiness, metadata, and outputs equal to eager."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from tritonclient.utils import InferenceServerException

from tests.cuvil_sidecar.conftest import Sidecar, eager

pytestmark = pytest.mark.slow


def assert_close(actual: np.ndarray, expected: torch.Tensor, name: str) -> None:
    reference = expected.detach().numpy()
    assert actual.shape == reference.shape, name
    scale = float(np.abs(reference).max())
    assert float(np.abs(actual - reference).max()) <= 1e-4 * scale + 1e-5, name


def watch_start_up(sidecar: Sidecar, model: str) -> None:
    """From the first moment the port answers: live but not ready, and inference refused with
    UNAVAILABLE; then ready only after the log shows warm-up and the golden check."""

    # A fresh channel per attempt: a channel that failed to connect waits out gRPC's reconnect
    # backoff (a second or more) and would first answer long after the port opened.
    def first_answer() -> grpcclient.InferenceServerClient:
        probe = grpcclient.InferenceServerClient(sidecar.url)
        try:
            if probe.is_server_live():
                return probe
        except InferenceServerException:
            pass
        probe.close()
        raise ConnectionError("not yet")

    clients: list[grpcclient.InferenceServerClient] = []
    sidecar.wait_until(lambda: bool(clients.append(first_answer()) or True))
    client = clients[-1]
    assert client.is_server_ready() is False
    assert client.is_model_ready(model) is False
    with pytest.raises(InferenceServerException) as refused:
        client.get_model_metadata(model)
    assert refused.value.status() == "StatusCode.UNAVAILABLE"
    assert "not ready" in refused.value.message()
    sidecar.wait_ready(client)
    log = sidecar.log()
    warmed, golden, serving = (
        log.rindex("warming up bucket"),
        log.index("checking golden outputs"),
        log.index("serving"),
    )
    assert warmed < golden < serving
    assert client.is_model_ready(model)
    client.close()


def infer_both_ways(
    url: str, model: str, inputs: dict[str, np.ndarray], outputs: list[str]
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    def items(module):  # both client flavours share the InferInput API
        built = []
        for name, array in inputs.items():
            datatype = "INT64" if array.dtype == np.int64 else "FP32"
            item = module.InferInput(name, list(array.shape), datatype)
            item.set_data_from_numpy(array)
            built.append(item)
        return built

    client = grpcclient.InferenceServerClient(url)
    result = client.infer(model, items(grpcclient))
    sync = {name: result.as_numpy(name) for name in outputs}
    client.close()

    async def run() -> dict[str, np.ndarray]:
        aio = aioclient.InferenceServerClient(url)
        try:
            answer = await aio.infer(model, items(aioclient))
            return {name: answer.as_numpy(name) for name in outputs}
        finally:
            await aio.close()

    return sync, asyncio.run(run())


# Both gRPC servers: MiniLM's answer (2 x 24 x 384 floats) is large enough to be written by
# wire.EncodedInferResponse, ResNet-50's 600 KB request to have its image cut out (native).
FRONTENDS = pytest.mark.parametrize("frontend", ["native", "grpcio"])


@FRONTENDS
def test_minilm(minilm_artifact: Path, minilm_spec, tmp_path: Path, frontend: str) -> None:
    sidecar = Sidecar(
        minilm_artifact,
        tmp_path / "minilm.log",
        CUVIL_MAX_BATCH_SIZE="4",
        CUVIL_WARMUP_RUNS="3",
        CUVIL_GRPC_FRONTEND=frontend,
    )
    try:
        watch_start_up(sidecar, "minilm")
        client = grpcclient.InferenceServerClient(sidecar.url)
        metadata = client.get_model_metadata("minilm")
        assert [(t.name, t.datatype, list(t.shape)) for t in metadata.inputs] == [
            ("input_ids", "INT64", [-1, -1]),
            ("attention_mask", "INT64", [-1, -1]),
        ]
        client.close()
        generator = torch.Generator().manual_seed(3)
        ids = torch.randint(1000, 30000, (2, 24), generator=generator)
        mask = torch.ones(2, 24, dtype=torch.int64)
        mask[1, 20:] = 0
        expected = eager(minilm_spec.model, {"input_ids": ids, "attention_mask": mask})
        names = ["last_hidden_state", "pooler_output"]
        arrays = {"input_ids": ids.numpy(), "attention_mask": mask.numpy()}
        for answer in infer_both_ways(sidecar.url, "minilm", arrays, names):
            assert_close(answer["last_hidden_state"], expected.last_hidden_state, "hidden")
            assert_close(answer["pooler_output"], expected.pooler_output, "pooler")
    finally:
        assert sidecar.stop() == 0, sidecar.log()


@FRONTENDS
def test_resnet50(resnet_artifact: Path, resnet_spec, tmp_path: Path, frontend: str) -> None:
    sidecar = Sidecar(
        resnet_artifact,
        tmp_path / "resnet.log",
        CUVIL_MAX_BATCH_SIZE="4",
        CUVIL_WARMUP_RUNS="3",
        CUVIL_GRPC_FRONTEND=frontend,
    )
    try:
        watch_start_up(sidecar, "resnet50")
        pixels = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(4))
        expected = eager(resnet_spec.model, {"pixel_values": pixels}).logits
        arrays = {"pixel_values": pixels.numpy()}
        for answer in infer_both_ways(sidecar.url, "resnet50", arrays, ["logits"]):
            assert_close(answer["logits"], expected, "logits")
            assert int(answer["logits"].argmax()) == int(expected.argmax())
    finally:
        assert sidecar.stop() == 0, sidecar.log()
