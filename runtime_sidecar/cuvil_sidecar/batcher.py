"""Dynamic batching: requests wait in one queue; each model instance takes the oldest, joins
compatible requests behind it (same dtypes and same non-batch dims) until the batch holds
``max_rows`` rows or the oldest has waited ``max_delay_s``, runs the batch once on a worker
thread and splits every output back along the batch dim, row for row.

A batch waits for company only while there can be some: given ``in_flight`` (the requests the
server holds for the model in any phase: decoding, queued, running, encoding), a batch that
already holds every one of them runs at once, and a request that is the only one skips the
queue and runs as it would without batching (handed to the worker, and answered from there).
A lone client (concurrency 1, or a trickle of requests) then gets the unbatched latency instead
of paying the whole delay for nothing (a wait that can exceed a small model's whole run).
Under load there are always other requests in flight, and batches fill as usual.

Requests that could not join stay at the head of the line for the next batch. With
``max_rows <= 1`` (batching off, or a model without a shared batch dim) every request runs alone:
straight on the worker threads, whose queue is then the request queue, or, when nothing else is
executing and the model's recent runs took under ``INLINE_RUN_S``, on the event loop itself.

Bounds (Triton's ``default_queue_policy``): with ``max_queue`` a request that finds that many
waiting already (``pending``: queued, held back, or handed to a worker without batching) is
refused at once (``QueueFull``); a request carries an
expiry, the sooner of ``queue_timeout_s`` after it arrived and its client's deadline, and one
whose expiry passed before its run starts is dropped unrun (``QueueTimeout`` or
``DeadlinePassed``): a client that gave up costs no model run, nor does a request whose call
was cancelled while it waited (its task cancelled, or its ``client_gone`` true when its turn
comes: ``CallCancelled``). ``on_reject`` counts each, by reason.
Handing a run to a worker thread and waking the loop when it is done costs a thread wake-up each
way, more than a tiny model's whole run; a long run stays on the worker so that the loop keeps
answering health checks and decoding the next request meanwhile.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Callable, Hashable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from cuvil_sidecar.errors import (
    CallCancelled,
    DeadlinePassed,
    QueueFull,
    QueueTimeout,
    ShuttingDown,
    SidecarError,
)
from cuvil_sidecar.handoff import Handoff

# Runs shorter than this (recent average) skip the worker thread when batching is off and the
# model is idle: several times the hand-off it saves (a thread wake-up each way), well below a
# run worth overlapping with the loop's own work.
INLINE_RUN_S = 0.001
RECENT_WEIGHT = 0.2  # weight of the newest run in the recent average

RunFn = Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class BatchResult:
    outputs: dict[str, torch.Tensor]
    enqueued_ns: int
    started_ns: int  # execution start (queue wait ends here)
    finished_ns: int
    batch_requests: int
    batch_rows: int
    inline: bool = False  # ran on the event loop rather than a worker thread


@dataclass
class _Job:
    inputs: Mapping[str, torch.Tensor]
    rows: int
    key: Hashable
    future: asyncio.Future[BatchResult]
    enqueued_ns: int = field(default_factory=time.time_ns)
    timeout_ns: int | None = None  # queue timeout: when it stops waiting (epoch ns)
    deadline_ns: int | None = None  # the client's deadline (epoch ns)
    abandoned: bool = False  # its call was cancelled while it waited for a worker
    started: bool = False  # a worker began to run it (batching off)
    client_gone: Callable[[], bool] | None = None  # whether its client is gone (any thread)

    def expired(self) -> SidecarError | None:
        """Why this job must not run now, if its queue timeout or its client's deadline passed,
        or its client is gone."""
        now = time.time_ns()
        if self.deadline_ns is not None and now >= self.deadline_ns:
            waited = (now - self.enqueued_ns) / 1e6
            return DeadlinePassed(f"the client's deadline passed after {waited:.1f} ms in queue")
        if self.timeout_ns is not None and now >= self.timeout_ns:
            waited = (now - self.enqueued_ns) / 1e6
            return QueueTimeout(
                f"the request waited {waited:.1f} ms in queue, past the queue timeout"
            )
        if self.client_gone is not None and self.client_gone():
            return CallCancelled("the call was cancelled before it ran")
        return None


REJECT_REASONS: dict[type[SidecarError], str] = {
    CallCancelled: "cancelled",
    QueueFull: "queue_full",
    QueueTimeout: "queue_timeout",
    DeadlinePassed: "deadline",
}


class Batcher:
    def __init__(
        self,
        run: RunFn,
        *,
        max_rows: int,
        max_delay_s: float,
        instances: int = 1,
        on_execute: Callable[[int, int], None] | None = None,
        name: str = "model",
        in_flight: Callable[[], int] | None = None,
        max_queue: int = 0,
        queue_timeout_s: float = 0.0,
        on_reject: Callable[[str], None] | None = None,
    ) -> None:
        self._run = run
        self.max_queue = max_queue  # 0: unbounded
        self._queue_timeout_ns = int(queue_timeout_s * 1e9) or None
        self._on_reject = on_reject  # the reason (REJECT_REASONS), on the loop or a worker
        self._in_flight = in_flight  # None: unknown, so a batch always waits its delay
        self.max_rows = max(1, max_rows)
        self.max_delay_s = max_delay_s
        self._on_execute = on_execute  # (requests, rows) per execution, on the worker thread
        self._queue: asyncio.Queue[_Job] = asyncio.Queue()
        self._held: collections.deque[_Job] = collections.deque()
        self._executor = ThreadPoolExecutor(instances, thread_name_prefix=f"cuvil-{name}")
        # Without batching the executor's own queue is the request queue: one hop fewer.
        self._tasks = (
            [asyncio.get_running_loop().create_task(self._serve()) for _ in range(instances)]
            if self.max_rows > 1
            else []
        )
        self._closed = False
        self._direct = 0  # requests running alone, inline or on the executor (batching off)
        self._direct_lock = threading.Lock()
        self.recent_run_s = float("inf")  # average of recent runs; unknown until the first

    @property
    def mode(self) -> str:
        if self.max_rows > 1:
            return f"dynamic batching up to {self.max_rows} rows, {self.max_delay_s * 1e6:.0f} us"
        return "no batching"

    @property
    def runs_inline(self) -> bool:
        """Whether the next request, arriving at an idle model, runs on the event loop."""
        return not self._tasks and self.recent_run_s < INLINE_RUN_S

    @property
    def pending(self) -> int:
        return self._queue.qsize() + len(self._held) + self._direct

    async def submit(
        self,
        inputs: Mapping[str, torch.Tensor],
        *,
        rows: int = 1,
        key: Hashable = None,
        deadline_ns: int | None = None,
        client_gone: Callable[[], bool] | None = None,
    ) -> BatchResult:
        """Queue one request; ``rows`` is its batch-dim size, ``key`` what must match to join,
        ``deadline_ns`` when its client stops waiting (epoch ns), ``client_gone`` whether it has
        stopped already (asked, from any thread, when the request's turn comes)."""
        if self._closed:
            raise ShuttingDown("the model is being unloaded")
        if self.max_queue and self.pending >= self.max_queue:
            self._reject(QueueFull(f"the model holds {self.max_queue} requests already"))
        loop = asyncio.get_running_loop()
        job = _Job(
            inputs,
            rows,
            key,
            loop.create_future(),
            deadline_ns=deadline_ns,
            client_gone=client_gone,
        )
        if self._queue_timeout_ns is not None:
            job.timeout_ns = job.enqueued_ns + self._queue_timeout_ns
        if not self._tasks:
            with self._direct_lock:  # (a call resumed on a worker lowers it there)
                alone = self._direct == 0
                self._direct += 1
            inline = alone and self.runs_inline
            return await self._run_unqueued(job, inline=inline, resume_on_worker=alone)
        if self._queue.empty() and not self._held and not self._company_possible([job]):
            # the only request in flight: its batch could hold nobody else, so it runs as
            # without batching, though never inline (batches run on the worker, and one thread
            # keeps one OpenMP pool): no queue, and no turn of the event loop after the run
            with self._direct_lock:
                self._direct += 1
            return await self._run_unqueued(job, inline=False, resume_on_worker=True)
        self._queue.put_nowait(job)
        return await job.future

    async def _run_unqueued(
        self, job: _Job, *, inline: bool, resume_on_worker: bool
    ) -> BatchResult:
        """Runs ``job`` by itself: on the event loop (``inline``) or handed to the worker, after
        which the call goes on from the worker when ``resume_on_worker`` (handoff.py); otherwise
        the worker turns to the next run and the loop answers."""
        try:
            if inline:
                started, results, finished = self._execute([job])
            else:
                started, results, finished = await Handoff(
                    self._executor, self._execute, [job], resume_on_worker=resume_on_worker
                )
        except asyncio.CancelledError:
            with self._direct_lock:  # the worker skips it unless it has started it already
                job.abandoned = True
                unrun = not job.started
            if unrun and self._on_reject is not None:
                self._on_reject(REJECT_REASONS[CallCancelled])
            raise
        finally:
            with self._direct_lock:
                self._direct -= 1
        return BatchResult(results[0], job.enqueued_ns, started, finished, 1, job.rows, inline)

    def _reject(self, error: SidecarError) -> None:
        if self._on_reject is not None:
            self._on_reject(REJECT_REASONS[type(error)])
        raise error

    def _drop_if_expired(self, job: _Job) -> bool:
        """On the loop: answer a job whose expiry passed (True), or leave it (False)."""
        if job.future.done():  # the caller gave up (its call was cancelled) while queued
            if self._on_reject is not None:
                self._on_reject("cancelled")
            return True
        error = job.expired()
        if error is None:
            return False
        try:
            self._reject(error)
        except SidecarError as raised:
            job.future.set_exception(raised)
        return True

    async def close(self) -> None:
        """Stop the instances; anything still queued is answered ShuttingDown."""
        self._closed = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        leftovers = list(self._held)
        while not self._queue.empty():
            leftovers.append(self._queue.get_nowait())
        for job in leftovers:
            if not job.future.done():
                job.future.set_exception(ShuttingDown("the model was unloaded"))
        self._executor.shutdown(wait=True)

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            first = self._held.popleft() if self._held else await self._queue.get()
            if self._drop_if_expired(first):
                continue
            batch = [first]
            if self.max_rows > 1 and first.rows < self.max_rows:
                await self._gather(batch)
            try:
                started, results, finished = await loop.run_in_executor(
                    self._executor, self._execute, batch
                )
            except Exception as error:
                if len(batch) > 1:  # one request must not fail the others: run each alone
                    await self._run_alone(batch)
                    continue
                if not first.future.done():
                    first.future.set_exception(error)
                continue
            rows = sum(job.rows for job in batch)
            for job, outputs in zip(batch, results, strict=True):
                if not job.future.done():
                    job.future.set_result(
                        BatchResult(outputs, job.enqueued_ns, started, finished, len(batch), rows)
                    )

    async def _run_alone(self, batch: list[_Job]) -> None:
        loop = asyncio.get_running_loop()
        for job in batch:
            try:
                started, results, finished = await loop.run_in_executor(
                    self._executor, self._execute, [job]
                )
            except Exception as error:
                if not job.future.done():
                    job.future.set_exception(error)
                continue
            if not job.future.done():
                job.future.set_result(
                    BatchResult(results[0], job.enqueued_ns, started, finished, 1, job.rows)
                )

    async def _gather(self, batch: list[_Job]) -> None:
        """Add compatible jobs to ``batch`` until it is full or the oldest's delay has passed."""
        first = batch[0]
        rows = first.rows
        deadline = time.monotonic() + max(
            0.0, self.max_delay_s - (time.time_ns() - first.enqueued_ns) / 1e9
        )
        for job in list(self._held):
            if self._drop_if_expired(job):
                self._held.remove(job)
            elif job.key == first.key and rows + job.rows <= self.max_rows:
                self._held.remove(job)
                batch.append(job)
                rows += job.rows
        while rows < self.max_rows:
            if self._queue.empty():
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._company_possible(batch):
                    break
                try:
                    job = await asyncio.wait_for(self._queue.get(), remaining)
                except TimeoutError:
                    break
            else:
                job = self._queue.get_nowait()
            if self._drop_if_expired(job):
                continue
            if job.key == first.key and rows + job.rows <= self.max_rows:
                batch.append(job)
                rows += job.rows
            else:
                self._held.append(job)

    def _company_possible(self, batch: list[_Job]) -> bool:
        """Whether a request not yet here could still join: one the server holds elsewhere."""
        if self._in_flight is None:
            return True
        return self._in_flight() > len(batch) + len(self._held)

    def _execute(self, batch: list[_Job]) -> tuple[int, list[dict[str, torch.Tensor]], int]:
        """Runs ``batch`` (on a worker, or inline). A lone job whose expiry passed while it
        waited for the worker is refused instead (jobs joined on the loop were checked there)."""
        if len(batch) == 1:
            with self._direct_lock:
                if batch[0].abandoned:  # counted where its call was cancelled
                    raise CallCancelled("the call was cancelled before it ran")
                batch[0].started = True
            expired = batch[0].expired()
            if expired is not None:
                self._reject(expired)
            inputs = batch[0].inputs
        else:
            inputs = {
                name: torch.cat([job.inputs[name] for job in batch]) for name in batch[0].inputs
            }
        started = time.time_ns()
        outputs = self._run(inputs)
        finished = time.time_ns()
        took = (finished - started) / 1e9
        recent = self.recent_run_s
        self.recent_run_s = (
            took if recent == float("inf") else recent + RECENT_WEIGHT * (took - recent)
        )
        if self._on_execute is not None:
            self._on_execute(len(batch), sum(job.rows for job in batch))
        if len(batch) == 1:
            return started, [outputs], finished
        sizes = [job.rows for job in batch]
        pieces = {name: torch.split(tensor, sizes) for name, tensor in outputs.items()}
        return (
            started,
            [{name: pieces[name][i] for name in outputs} for i in range(len(batch))],
            finished,
        )
