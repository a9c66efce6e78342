"""Open-loop overload: requests sent at a fixed rate above what the model can run, each with a
1 s client deadline, as a load tool sends them. The sidecar drops every request whose deadline
passed before its turn, so none reaches the model after its client gave up: no request the
model ran had waited past its deadline in the queue (the queue histogram in /metrics), each
request either ran or was dropped, counted (``nv_inference_count``,
``cuvil_inference_rejected``), and the runs are fewer than the requests. The model is heavy on
purpose (48 chained 512x512 matmuls on a 512x512 activation, about 50 ms a run on two AVX-512
cores, seconds on a busy host), so the rate is above its capacity whatever the host's speed,
and nothing here depends on how long a run takes."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc.aio as aioclient
from tritonclient.utils import InferenceServerException

import cuvil
from tests.cuvil_sidecar.conftest import Sidecar, ready_sidecar
from tests.cuvil_sidecar.test_overload import labelled
from tests.cuvil_sidecar.test_server import scrape

RATE_PER_S = 100
SENT = 300  # 3 s of sending
DEADLINE_S = 1.0
WIDTH = 512


class Heavy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.unsqueeze(2) * x.unsqueeze(1)  # (1, WIDTH) -> (1, WIDTH, WIDTH)
        for _ in range(48):
            h = torch.tanh(self.layer(h))
        return h.mean(dim=1)


@pytest.fixture(scope="module")
def heavy_artifact(artifact_dir: Path) -> Path:
    torch.manual_seed(0)
    compiled = cuvil.jit(Heavy().eval(), (torch.randn(1, WIDTH),), name="heavy")
    return compiled.save(artifact_dir / "heavy.cuvil")


async def send_open_loop(url: str) -> list[str]:
    """``SENT`` requests at ``RATE_PER_S``, each sent on time whether or not the earlier ones
    were answered; the status of each."""
    client = aioclient.InferenceServerClient(url)
    item = aioclient.InferInput("x", [1, WIDTH], "FP32")
    item.set_data_from_numpy(np.full((1, WIDTH), 0.1, dtype=np.float32))

    async def one() -> str:
        try:
            await client.infer("heavy", [item], client_timeout=DEADLINE_S)
        except InferenceServerException as error:
            return str(error.status())
        return "OK"

    try:
        started = time.perf_counter()
        calls = []
        for index in range(SENT):
            await asyncio.sleep(max(0.0, started + index / RATE_PER_S - time.perf_counter()))
            calls.append(asyncio.ensure_future(one()))
        return list(await asyncio.gather(*calls))
    finally:
        await client.close()


def queue_buckets(text: str) -> dict[str, float]:
    """The heavy model's queue histogram: cumulative count per bound (``le``)."""
    pattern = (
        r'^cuvil_queue_duration_seconds_bucket\{model="heavy",version="1",le="([^"]+)"\} (\S+)$'
    )
    return {le: float(count) for le, count in re.findall(pattern, text, re.MULTILINE)}


@pytest.mark.parametrize("frontend", ["native", "grpcio"])
def test_open_loop_past_deadline_never_reaches_the_model(
    heavy_artifact: Path, tmp_path: Path, frontend: str
) -> None:
    sidecar = Sidecar(
        heavy_artifact,
        tmp_path / "sidecar.log",
        CUVIL_MAX_BATCH_SIZE="1",
        CUVIL_GRPC_FRONTEND=frontend,
    )
    with ready_sidecar(sidecar):
        before = scrape(sidecar)
        statuses = asyncio.run(send_open_loop(sidecar.url))
        sidecar.wait_until(
            lambda: (
                labelled(scrape(sidecar), "nv_inference_pending_request_count", model="heavy") == 0
            )
        )
        time.sleep(0.5)  # the last dropped requests are counted once their turn comes
        after = scrape(sidecar)

    def moved(name: str, **labels: str) -> float:
        return labelled(after, name, model="heavy", **labels) - labelled(
            before, name, model="heavy", **labels
        )

    answered = statuses.count("OK")
    gave_up = statuses.count("StatusCode.DEADLINE_EXCEEDED")
    assert answered + gave_up == SENT, set(statuses)
    executed = moved("nv_inference_count")  # one row a request
    dropped = moved("cuvil_inference_rejected", reason="deadline") + moved(
        "cuvil_inference_rejected", reason="cancelled"
    )
    # every request ran or was dropped unrun (one whose deadline passed before it was even
    # dispatched is refused by gRPC itself); the rate is above what the model can run
    assert executed + dropped <= SENT
    assert dropped > 0 and executed < SENT, (executed, dropped)
    # none that ran had waited out its deadline. The histogram holds the runs answered by the
    # sidecar (on grpcio, a call whose deadline comes while it runs is cancelled and answers
    # nothing). The server's deadline is the call's arrival plus the timeout the client sends,
    # which gRPC rounds up (here by up to ~10 ms), so every wait is within 1 s and that
    # rounding: under the histogram's next bound, 2.5 s, and on average within the deadline
    waits_before, waits_after = queue_buckets(before), queue_buckets(after)
    ran = waits_after["+Inf"] - waits_before.get("+Inf", 0.0)
    assert answered <= ran <= executed
    assert waits_after["2.5"] - waits_before.get("2.5", 0.0) == ran
    waited_s = labelled(after, "cuvil_queue_duration_seconds_sum", model="heavy") - labelled(
        before, "cuvil_queue_duration_seconds_sum", model="heavy"
    )
    assert waited_s / ran <= DEADLINE_S
