"""The batcher on its own: requests joined up to max_rows, results split back row for row,
incompatible shapes kept apart, a request that breaks a joined batch fails alone, and, with
batching off, quick runs on the event loop while slow ones stay on the worker thread; a batch
waits for company only while the server holds other requests."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Mapping

import pytest
import torch
from cuvil_sidecar.batcher import INLINE_RUN_S, Batcher
from cuvil_sidecar.errors import DeadlinePassed, QueueFull, QueueTimeout, ShuttingDown


def double(inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    x = inputs["x"]
    if torch.isnan(x).any():
        raise RuntimeError("NaN in the batch")
    return {"y": x * 2, "rows": torch.arange(x.shape[0])}


def test_join_split_and_isolation() -> None:
    async def scenario() -> None:
        executions: list[int] = []
        batcher = Batcher(
            double,
            max_rows=8,
            max_delay_s=0.05,
            on_execute=lambda requests, rows: executions.append(rows),
        )
        xs = [torch.full((1 + i % 3, 4), float(i)) for i in range(6)]
        results = await asyncio.gather(
            *(batcher.submit({"x": x}, rows=len(x), key=(4,)) for x in xs)
        )
        for x, result in zip(xs, results, strict=True):
            assert torch.equal(result.outputs["y"], x * 2)
        assert max(r.batch_requests for r in results) > 1
        assert all(rows <= 8 for rows in executions) and sum(executions) == 12

        odd = torch.ones(2, 5)  # a different non-batch dim: never joined with the others
        mixed = await asyncio.gather(
            batcher.submit({"x": torch.ones(2, 4)}, rows=2, key=(4,)),
            batcher.submit({"x": odd}, rows=2, key=(5,)),
        )
        assert mixed[1].batch_requests == 1 and mixed[1].outputs["y"].shape == (2, 5)

        poisoned = torch.full((1, 4), float("nan"))
        outcomes = await asyncio.gather(
            *(
                batcher.submit({"x": x}, rows=1, key=(4,))
                for x in (torch.ones(1, 4), poisoned, torch.zeros(1, 4))
            ),
            return_exceptions=True,
        )
        assert isinstance(outcomes[1], RuntimeError)
        assert torch.equal(outcomes[0].outputs["y"], torch.full((1, 4), 2.0))
        assert torch.equal(outcomes[2].outputs["y"], torch.zeros(1, 4))
        await batcher.close()
        with pytest.raises(ShuttingDown, match="unloaded"):
            await batcher.submit({"x": torch.ones(1, 4)}, rows=1, key=(4,))

    asyncio.run(scenario())


def test_unbatched_quick_runs_skip_the_worker_thread() -> None:
    """Batching off: once a run is known to be quick, an idle model runs the next request on the
    event loop itself; the result, its timings and the execution count are as on a worker."""

    async def scenario() -> None:
        threads: list[threading.Thread] = []
        executions: list[int] = []

        def quick(inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            threads.append(threading.current_thread())
            return double(inputs)

        batcher = Batcher(
            quick,
            max_rows=1,
            max_delay_s=0.0,
            on_execute=lambda requests, rows: executions.append(rows),
        )
        assert not batcher.runs_inline  # how long a run takes is not known yet
        results = []
        while len(results) < 50 and not any(result.inline for result in results):
            # a stall on a loaded host can make a run slow: then later ones go inline
            x = torch.full((1, 4), float(len(results)))
            results.append(await batcher.submit({"x": x}))
            assert torch.equal(results[-1].outputs["y"], x * 2)
            assert results[-1].enqueued_ns <= results[-1].started_ns <= results[-1].finished_ns
        assert not results[0].inline and threads[0] is not threading.main_thread()
        assert results[-1].inline and threads[-1] is threading.main_thread()
        assert executions == [1] * len(results) and batcher.pending == 0
        with pytest.raises(RuntimeError, match="NaN"):  # errors reach the caller alike
            await batcher.submit({"x": torch.full((1, 4), float("nan"))})
        await batcher.close()

    asyncio.run(scenario())


def test_unbatched_slow_runs_stay_on_the_worker_thread() -> None:
    async def scenario() -> None:
        threads: list[threading.Thread] = []

        def slow(inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            threads.append(threading.current_thread())
            time.sleep(2 * INLINE_RUN_S)
            return double(inputs)

        batcher = Batcher(slow, max_rows=1, max_delay_s=0.0)
        results = [await batcher.submit({"x": torch.ones(1, 4)}) for _ in range(3)]
        assert threading.main_thread() not in threads
        assert not any(result.inline for result in results) and not batcher.runs_inline
        await batcher.close()

    asyncio.run(scenario())


def test_batching_never_runs_inline() -> None:
    async def scenario() -> None:
        threads: list[threading.Thread] = []

        def quick(inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            threads.append(threading.current_thread())
            return double(inputs)

        batcher = Batcher(quick, max_rows=4, max_delay_s=0.0)
        for _ in range(3):
            await batcher.submit({"x": torch.ones(1, 4)}, rows=1, key=(4,))
        assert threading.main_thread() not in threads and not batcher.runs_inline
        await batcher.close()

    asyncio.run(scenario())


def test_a_request_alone_in_the_server_does_not_wait_for_company() -> None:
    async def scenario() -> None:
        held = [1]  # requests the server holds for the model, this one included
        batcher = Batcher(double, max_rows=8, max_delay_s=30.0, in_flight=lambda: held[0])
        started = time.monotonic()
        alone = await batcher.submit({"x": torch.ones(1, 4)}, rows=1, key=(4,))
        assert time.monotonic() - started < 10.0  # not the 30 s delay
        assert alone.batch_requests == 1

        held[0] = 2  # two requests at once, and no other: their batch runs without waiting
        started = time.monotonic()
        pair = await asyncio.gather(
            *(batcher.submit({"x": torch.ones(1, 4)}, rows=1, key=(4,)) for _ in range(2))
        )
        assert time.monotonic() - started < 10.0
        assert [result.batch_requests for result in pair] == [2, 2]

        held[0] = 2  # another request is being decoded: the batch waits for it and takes it
        first = asyncio.ensure_future(batcher.submit({"x": torch.ones(1, 4)}, rows=1, key=(4,)))
        await asyncio.sleep(0.2)
        assert not first.done()
        second = await batcher.submit({"x": torch.zeros(1, 4)}, rows=1, key=(4,))
        assert (await first).batch_requests == second.batch_requests == 2
        assert torch.equal(second.outputs["y"], torch.zeros(1, 4))
        await batcher.close()

    asyncio.run(scenario())


def test_a_lone_request_skips_the_queue_and_is_answered_from_the_worker() -> None:
    """Driven as the native front end drives calls: the only request in flight runs as without
    batching and goes on from the worker thread; with another in flight it is queued, and its
    call waits on the event loop for the batch."""
    import contextvars

    from cuvil_sidecar.handoff import drive

    def slow_double(inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        time.sleep(0.05)  # still running when drive() hands the call over (else it goes on here)
        return double(inputs)

    async def scenario() -> None:
        held = [1]
        batcher = Batcher(slow_double, max_rows=8, max_delay_s=0.05, in_flight=lambda: held[0])
        finished = threading.Event()
        seen: dict[str, object] = {}

        async def call() -> None:
            result = await batcher.submit({"x": torch.ones(1, 4)}, rows=1, key=(4,))
            seen["thread"], seen["requests"] = threading.current_thread(), result.batch_requests
            finished.set()

        parked: list[object] = []
        drive(call(), contextvars.copy_context(), lambda *args: parked.append(args))
        assert await asyncio.to_thread(finished.wait, 5)
        assert parked == [] and seen["requests"] == 1  # nothing went back to the loop
        assert seen["thread"] is not threading.current_thread()  # answered from the worker

        held[0] = 2
        queued = call()
        drive(queued, contextvars.copy_context(), lambda *args: parked.append(args))
        assert len(parked) == 1 and asyncio.isfuture(parked[0][2])  # the batch's future
        await asyncio.wait_for(asyncio.shield(parked[0][2]), 5)
        queued.close()
        await batcher.close()

    asyncio.run(scenario())


def test_without_an_in_flight_count_a_batch_waits_its_delay() -> None:
    async def scenario() -> None:
        batcher = Batcher(double, max_rows=8, max_delay_s=0.3)
        started = time.monotonic()
        await batcher.submit({"x": torch.ones(1, 4)}, rows=1, key=(4,))
        assert time.monotonic() - started >= 0.3
        await batcher.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("max_rows", [1, 8], ids=["unbatched", "batched"])
def test_bounds_refuse_and_drop_before_running(max_rows: int) -> None:
    """A full queue refuses at once; a request whose deadline or queue timeout passes while a
    slow run holds the worker is dropped unrun; each is counted by its reason."""

    def slow(inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        time.sleep(0.05)
        return {"y": inputs["x"] * 2}

    async def scenario() -> None:
        reasons: list[str] = []
        ran: list[int] = []
        batcher = Batcher(
            slow,
            max_rows=max_rows,
            max_delay_s=0.0,
            on_execute=lambda requests, rows: ran.append(requests),
            queue_timeout_s=0.02,
            on_reject=reasons.append,
        )
        x = torch.ones(1, 4)
        first = asyncio.ensure_future(batcher.submit({"x": x}, key=(4,)))
        await asyncio.sleep(0.01)  # the first runs; what comes now waits behind it
        batcher.max_queue = batcher.pending + 2
        soon = time.time_ns() + 5_000_000
        by_deadline = asyncio.ensure_future(batcher.submit({"x": x}, key=(4,), deadline_ns=soon))
        by_timeout = asyncio.ensure_future(batcher.submit({"x": x}, key=(4,)))
        await asyncio.sleep(0)
        with pytest.raises(QueueFull, match="holds"):
            await batcher.submit({"x": x}, key=(4,))
        assert float((await first).outputs["y"].sum()) == 8
        outcomes = await asyncio.gather(by_deadline, by_timeout, return_exceptions=True)
        assert isinstance(outcomes[0], DeadlinePassed), outcomes
        assert isinstance(outcomes[1], QueueTimeout), outcomes
        assert sorted(reasons) == ["deadline", "queue_full", "queue_timeout"]
        assert sum(ran) == 1  # only the first ever ran
        await batcher.close()

    asyncio.run(scenario())
