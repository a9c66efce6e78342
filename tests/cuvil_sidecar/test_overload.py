"""Overload: a bounded queue refuses the excess at once with UNAVAILABLE (counted in /metrics)
and loses no accepted request; requests whose client's deadline passed while they waited never
reach the model, nor do those of calls and streams their clients cancelled (on both gRPC front
ends); idle and half-sent HTTP connections take no threads, are closed after the header
timeout, and past the connection limit are answered 503. The model is made slow on
purpose (48 chained 256x256 linears, a few milliseconds a run) so that a queue forms."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc.aio as aioclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

import cuvil
from tests.cuvil_sidecar.conftest import Sidecar, ready_sidecar
from tests.cuvil_sidecar.test_server import scrape

CLIENTS = 128


class Slow(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(256, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(48):
            x = torch.tanh(self.layer(x))
        return x


@pytest.fixture(scope="module")
def slow_model() -> Slow:
    torch.manual_seed(0)
    return Slow().eval()


@pytest.fixture(scope="module")
def slow_artifact(slow_model: Slow, artifact_dir: Path) -> Path:
    batch = cuvil.Dim("batch", min=1, max=64)
    compiled = cuvil.jit(
        slow_model, (torch.randn(2, 256),), dynamic_shapes={"x": {0: batch}}, name="slow"
    )
    return compiled.save(artifact_dir / "slow.cuvil")


def labelled(text: str, name: str, **labels: str) -> float:
    wanted = {"model": "slow", "version": "1", **labels}
    total = 0.0
    for match in re.finditer(rf"^{name}{{([^}}]*)}} (\S+)$", text, re.MULTILINE):
        pairs = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
        if all(pairs.get(key) == value for key, value in wanted.items()):
            total += float(match.group(2))
    return total


def resident_kib(sidecar: Sidecar) -> int:
    status = Path(f"/proc/{sidecar.process.pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+)", status, re.MULTILINE).group(1))


def threads(sidecar: Sidecar) -> int:
    status = Path(f"/proc/{sidecar.process.pid}/status").read_text()
    return int(re.search(r"^Threads:\s+(\d+)", status, re.MULTILINE).group(1))


async def call(client, x: np.ndarray, timeout: float | None = None) -> tuple[str, object, float]:
    item = aioclient.InferInput("x", list(x.shape), "FP32")
    item.set_data_from_numpy(x)
    started = time.perf_counter()
    try:
        result = await client.infer("slow", [item], client_timeout=timeout)
    except InferenceServerException as error:
        return str(error.status()), error, time.perf_counter() - started
    return "OK", result.as_numpy("output"), time.perf_counter() - started


def test_small_queue_rejects_the_excess_at_once(
    slow_artifact: Path, slow_model: Slow, tmp_path: Path
) -> None:
    sidecar = Sidecar(
        slow_artifact,
        tmp_path / "sidecar.log",
        CUVIL_MAX_QUEUE_SIZE="4",
        CUVIL_MAX_BATCH_SIZE="8",
        CUVIL_MAX_QUEUE_DELAY_US="1000",
    )
    with ready_sidecar(sidecar):
        before, rss_before = scrape(sidecar), resident_kib(sidecar)
        rng = np.random.default_rng(0)
        inputs = [rng.standard_normal((1, 256), dtype=np.float32) for _ in range(CLIENTS * 4)]

        async def main() -> list[tuple[str, object, float]]:
            client = aioclient.InferenceServerClient(sidecar.url)
            try:

                async def one_client(index: int) -> list[tuple[str, object, float]]:
                    return [await call(client, inputs[index * 4 + i]) for i in range(4)]

                per_client = await asyncio.gather(*(one_client(i) for i in range(CLIENTS)))
            finally:
                await client.close()
            return [outcome for outcomes in per_client for outcome in outcomes]

        outcomes = asyncio.run(main())
        after, rss_after = scrape(sidecar), resident_kib(sidecar)
    statuses = [status for status, _, _ in outcomes]
    rejected = [seconds for status, _, seconds in outcomes if status == "StatusCode.UNAVAILABLE"]
    accepted = [seconds for status, _, seconds in outcomes if status == "OK"]
    assert len(rejected) + len(accepted) == len(outcomes), set(statuses)
    assert rejected and accepted
    for (status, output, _), x in zip(outcomes, inputs, strict=True):
        if status == "OK":  # no accepted request lost or answered wrong
            with torch.no_grad():
                expected = slow_model(torch.from_numpy(x)).numpy()
            np.testing.assert_allclose(output, expected, rtol=1e-4, atol=1e-5)
    # Refused at once: none of them reached the model (the rows it inferred are the accepted
    # requests'), and their answers did not wait out a queue (bound loose for a busy 2-core host;
    # speed itself is benchmarks/sidecar_load.py's to measure).
    inferred = labelled(after, "nv_inference_count") - labelled(before, "nv_inference_count")
    assert inferred == len(accepted)
    assert float(np.median(rejected)) < 0.5
    counted = labelled(after, "cuvil_inference_rejected", reason="queue_full") - labelled(
        before, "cuvil_inference_rejected", reason="queue_full"
    )
    assert counted == len(rejected)
    assert (rss_after - rss_before) < 100 * 1024  # KiB: the refused requests hold nothing
    assert labelled(after, "nv_inference_pending_request_count") == 0
    message = next(str(error) for status, error, _ in outcomes if status != "OK")
    assert "holds 4 requests" in message


@pytest.mark.parametrize("batch", ["1", "8"], ids=["unbatched", "batched"])
def test_requests_past_their_deadline_never_run(
    slow_artifact: Path, tmp_path: Path, batch: str
) -> None:
    """300 calls with an 80 ms deadline, each a full batch of rows (64 unbatched, 8 batched), so
    that the model runs them slower than they arrive on a loaded host too: those whose deadline
    passes while they wait are dropped unrun."""
    sidecar = Sidecar(slow_artifact, tmp_path / "sidecar.log", CUVIL_MAX_BATCH_SIZE=batch)
    sent = 300  # more than the deadline's worth of model runs
    rows = 64 if batch == "1" else 8
    with ready_sidecar(sidecar):
        before = scrape(sidecar)
        x = np.ones((rows, 256), dtype=np.float32)

        async def main() -> list[tuple[str, object, float]]:
            client = aioclient.InferenceServerClient(sidecar.url)
            try:
                return await asyncio.gather(*(call(client, x, timeout=0.08) for _ in range(sent)))
            finally:
                await client.close()

        outcomes = asyncio.run(main())
        sidecar.wait_until(
            lambda: labelled(scrape(sidecar), "nv_inference_pending_request_count") == 0
        )
        time.sleep(0.5)  # the last dropped requests are counted once their turn comes
        after = scrape(sidecar)

    def moved(name: str, **labels: str) -> float:
        return labelled(after, name, **labels) - labelled(before, name, **labels)

    gave_up = sum(status == "StatusCode.DEADLINE_EXCEEDED" for status, _, _ in outcomes)
    assert gave_up > 0, {status for status, _, _ in outcomes}
    executed = moved("nv_inference_count") / rows  # requests run (the count is of rows)
    dropped = moved("cuvil_inference_rejected", reason="deadline") + moved(
        "cuvil_inference_rejected", reason="cancelled"
    )
    # a request either ran, was dropped unrun by the sidecar, or (its deadline gone before it
    # was dispatched) never reached the sidecar at all: gRPC itself refuses it then
    assert executed + dropped <= sent
    assert executed < sent
    answered = sum(status == "OK" for status, _, _ in outcomes)
    assert answered <= executed


def test_idle_connections_take_no_threads(mlp_sidecar: Sidecar) -> None:
    before = threads(mlp_sidecar)
    sockets = []
    try:
        for port in (mlp_sidecar.http_port, mlp_sidecar.metrics_port):
            for index in range(300):
                sock = socket.create_connection(("127.0.0.1", port), timeout=10)
                if index % 2:
                    sock.sendall(b"GET /v2 HTTP/1.1\r\nHost: x")  # headers never finished
                sockets.append(sock)
        time.sleep(0.5)
        assert threads(mlp_sidecar) - before <= 2
        client = httpclient.InferenceServerClient(mlp_sidecar.http_url)
        item = httpclient.InferInput("x", [1, 784], "FP32")
        item.set_data_from_numpy(np.ones((1, 784), dtype=np.float32))
        started = time.perf_counter()
        client.infer("mlp", [item])
        assert time.perf_counter() - started < 1.0
        client.close()
        assert "nv_inference_count" in scrape(mlp_sidecar)
    finally:
        for sock in sockets:
            sock.close()


def test_connection_limit_and_header_timeout(slow_artifact: Path, tmp_path: Path) -> None:
    sidecar = Sidecar(
        slow_artifact,
        tmp_path / "sidecar.log",
        CUVIL_HTTP_MAX_CONNECTIONS="20",
        CUVIL_HTTP_TIMEOUT_S="1",
    )
    with ready_sidecar(sidecar):
        held = [socket.create_connection(("127.0.0.1", sidecar.http_port)) for _ in range(20)]
        held[0].sendall(b"GET /v2 HTTP/1.1\r\n")  # a slow client: half its headers
        time.sleep(0.2)
        with socket.create_connection(("127.0.0.1", sidecar.http_port), timeout=5) as extra:
            answer = b""
            while chunk := extra.recv(4096):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 503") and b"too many connections" in answer
        started = time.perf_counter()
        for sock in held:
            sock.settimeout(5)
            assert sock.recv(4096) == b""  # closed by the server after its header timeout
        assert time.perf_counter() - started < 3
        for sock in held:
            sock.close()
        client = httpclient.InferenceServerClient(sidecar.http_url)
        assert client.is_server_ready()  # room again once they are gone
        client.close()


@pytest.mark.parametrize("batch", ["1", "8"], ids=["unbatched", "batched"])
def test_requests_of_clients_that_hung_up_never_run(
    slow_artifact: Path, tmp_path: Path, batch: str
) -> None:
    """Sixty REST clients send an infer request and hang up at once: those not yet run when
    their connection goes are dropped (counted as cancelled), and the server serves on. Each
    request carries as many rows as a batch may hold (64 unbatched), so that the server runs
    them slower than they arrive on any host (one row's ran before a loaded host saw the
    hang-ups)."""
    sidecar = Sidecar(slow_artifact, tmp_path / "sidecar.log", CUVIL_MAX_BATCH_SIZE=batch)
    sent = 60
    rows = 64 if batch == "1" else int(batch)
    body = json.dumps(
        {"inputs": [{"name": "x", "shape": [rows, 256], "datatype": "FP32",
                     "data": [0.5] * (rows * 256)}]}
    ).encode()  # fmt: skip
    request = (
        f"POST /v2/models/slow/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    with ready_sidecar(sidecar):
        before = scrape(sidecar)
        sockets = [socket.create_connection(("127.0.0.1", sidecar.http_port)) for _ in range(sent)]
        for sock in sockets:
            sock.sendall(request)
        time.sleep(0.02)
        for sock in sockets:
            sock.close()
        sidecar.wait_until(
            lambda: labelled(scrape(sidecar), "nv_inference_pending_request_count") == 0
        )
        time.sleep(0.5)
        after = scrape(sidecar)
        run = "nv_inference_request_success"  # requests answered (nv_inference_count: rows)
        executed = labelled(after, run) - labelled(before, run)
        cancelled = labelled(after, "cuvil_inference_rejected", reason="cancelled") - labelled(
            before, "cuvil_inference_rejected", reason="cancelled"
        )
        assert cancelled > 0 and executed < sent, (executed, cancelled)
        assert executed + cancelled <= sent  # a dropped request never ran
        client = httpclient.InferenceServerClient(sidecar.http_url)
        item = httpclient.InferInput("x", [1, 256], "FP32")
        item.set_data_from_numpy(np.ones((1, 256), dtype=np.float32))
        assert client.infer("slow", [item]).as_numpy("output").shape == (1, 256)
        client.close()


@pytest.mark.parametrize("frontend", ["native", "grpcio"])
def test_a_cancelled_stream_stops(slow_artifact: Path, tmp_path: Path, frontend: str) -> None:
    """A ModelStreamInfer stream of 300 messages, cancelled by its client once the first answer
    has come and the server holds messages it has not run: those are dropped unrun (counted as
    cancelled), and those that ran are all that reached the model. Each message carries 64 rows,
    so that the server runs them slower than it reads them on a loaded host too (one row's
    message ran faster than the grpcio front end read the next, and nothing was ever held)."""
    import queue

    import tritonclient.grpc as grpcclient

    sidecar = Sidecar(
        slow_artifact,
        tmp_path / "sidecar.log",
        CUVIL_MAX_BATCH_SIZE="1",
        CUVIL_GRPC_FRONTEND=frontend,
    )
    sent = 300
    with ready_sidecar(sidecar):
        before = scrape(sidecar)
        client = grpcclient.InferenceServerClient(sidecar.url)
        answers: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        item = grpcclient.InferInput("x", [64, 256], "FP32")
        item.set_data_from_numpy(np.ones((64, 256), dtype=np.float32))
        for index in range(sent):
            client.async_stream_infer("slow", [item], request_id=str(index))
        _, error = answers.get(timeout=60)
        assert error is None, error
        deadline = time.monotonic() + 30
        while (
            time.monotonic() < deadline
            and labelled(scrape(sidecar), "nv_inference_pending_request_count") < 2
        ):
            time.sleep(0.01)
        client.stop_stream(cancel_requests=True)
        sidecar.wait_until(
            lambda: labelled(scrape(sidecar), "nv_inference_pending_request_count") == 0
        )
        time.sleep(0.5)
        after = scrape(sidecar)
        ready = client.is_server_ready()  # the server serves on
        client.close()

    def moved(name: str, **labels: str) -> float:
        return labelled(after, name, **labels) - labelled(before, name, **labels)

    executed, cancelled = (
        moved("nv_inference_request_success"),  # messages answered (nv_inference_count: rows)
        moved("cuvil_inference_rejected", reason="cancelled"),
    )
    assert ready
    assert cancelled > 0 and executed < sent, (executed, cancelled)
    assert executed + cancelled <= sent  # a dropped message never ran
    assert executed >= 1  # the first answer's


@pytest.mark.parametrize("frontend", ["native", "grpcio"])
def test_cancelled_unary_calls_never_run(
    slow_artifact: Path, tmp_path: Path, frontend: str
) -> None:
    """Sixty ModelInfer calls, cancelled by their client once the first is answered and the
    server holds others it has not run (a loaded host may hand them over late): those are
    dropped unrun (counted as cancelled). Each call carries 64 rows, so that the server runs
    them slower than they arrive on any host (one row's call ran faster than the grpcio front
    end hands calls over, and a backlog of two was never seen)."""
    sidecar = Sidecar(
        slow_artifact,
        tmp_path / "sidecar.log",
        CUVIL_MAX_BATCH_SIZE="1",
        CUVIL_GRPC_FRONTEND=frontend,
    )
    sent = 60
    x = np.ones((64, 256), dtype=np.float32)
    with ready_sidecar(sidecar):
        before = scrape(sidecar)

        def held() -> float:
            return labelled(scrape(sidecar), "nv_inference_pending_request_count")

        async def main() -> None:
            client = aioclient.InferenceServerClient(sidecar.url)
            try:
                calls = [asyncio.ensure_future(call(client, x)) for _ in range(sent)]
                await asyncio.wait(calls, return_when=asyncio.FIRST_COMPLETED)
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline and await asyncio.to_thread(held) < 2:
                    await asyncio.sleep(0.01)
                for pending in calls:
                    pending.cancel()
                await asyncio.gather(*calls, return_exceptions=True)
            finally:
                await client.close()

        asyncio.run(main())
        sidecar.wait_until(
            lambda: labelled(scrape(sidecar), "nv_inference_pending_request_count") == 0
        )
        time.sleep(0.5)
        after = scrape(sidecar)
    run = "nv_inference_request_success"  # calls answered (nv_inference_count counts rows)
    executed = labelled(after, run) - labelled(before, run)
    cancelled = labelled(after, "cuvil_inference_rejected", reason="cancelled") - labelled(
        before, "cuvil_inference_rejected", reason="cancelled"
    )
    assert cancelled > 0 and executed < sent, (executed, cancelled)
    assert executed + cancelled <= sent
