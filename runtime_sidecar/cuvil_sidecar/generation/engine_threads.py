"""How many intra-op threads a compiled generation engine runs with.

The engine thread shares the process with the event loop that streams its tokens: one
server-sent event or gRPC response per token per stream, about ``FRONTEND_TOKEN_S`` of CPU
each (formatting, the socket write, the loop's wake-ups). When the engine's parallel regions
take every core, that work preempts one of their threads and the whole step waits for it; with
one thread fewer, the loop runs on the core left free while the step runs. Which is faster
depends on the model. A small model's step barely gains from its last thread, so the core is
worth more to the loop. A large model's step nearly halves with a second thread, and the loop's
share is small beside it.

So at load, unless ``CUVIL_GENERATION_THREADS`` fixes the count, the decode step at the engine's
full row count is timed at ``available`` threads and at one fewer, in ``TIMING_ROUNDS``
alternating rounds, each count's fastest round kept: a host whose other work comes and goes
(a shared VM's neighbours) would otherwise decide by whichever count it happened to slow. The
engine takes one fewer when that step costs no more than the full one plus the frontend's work
for the step's tokens. The choice is made once, on the serving host, from measured steps, not
from the model's size.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

log = logging.getLogger("cuvil_sidecar.generation")

# CPU the sidecar's frontend spends per streamed token, outside the engine, rounded up: on a 2-core
# AVX2 EPYC serving 16 streams (its threads' CPU time over the tokens sent) 33 to 36 µs of the
# event loop for REST server-sent events, and 40 µs of the loop plus about 20 µs of gRPC's own
# threads for a native gRPC stream; the rule below needs it only roughly, and a figure on the
# high side leaves the core to the frontend when the two counts are close
FRONTEND_TOKEN_S = 100e-6
TIMING_ROUNDS = 3  # alternating rounds of timing at each thread count


class TimedEngine(Protocol):
    @property
    def max_batch(self) -> int: ...

    def step_seconds(self, rows: int) -> float: ...


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    available: int  # the process's intra-op threads
    reason: str
    step_ms: dict[int, float]  # threads -> the timed decode step (ms); empty when not timed

    @property
    def room_for_two(self) -> bool:
        """Whether two engine threads of this count fit the process's: prompts can then be
        written on a thread of their own beside the decode steps (scheduler.py)."""
        return 2 * self.threads <= self.available


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """The calling thread's intra-op thread count for a scope, restored however it ends."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def choose_engine_threads(engine: TimedEngine, available: int, fixed: int = 0) -> ThreadChoice:
    """``fixed`` (``CUVIL_GENERATION_THREADS``) when set; else ``available`` or one fewer, by
    timing the engine's full decode step at both (the module docstring says why)."""
    if fixed:
        return ThreadChoice(fixed, available, "CUVIL_GENERATION_THREADS", {})
    if available < 2:
        return ThreadChoice(max(1, available), available, "one core", {})
    rows = engine.max_batch
    rounds: dict[int, list[float]] = {available: [], available - 1: []}
    for _ in range(TIMING_ROUNDS):
        for threads in rounds:
            with torch_threads(threads):
                rounds[threads].append(engine.step_seconds(rows))
    timed = {threads: min(seconds) for threads, seconds in rounds.items()}
    step_ms = {threads: round(seconds * 1e3, 3) for threads, seconds in timed.items()}
    frontend = rows * FRONTEND_TOKEN_S
    if timed[available - 1] <= timed[available] + frontend:
        reason = (
            f"a {rows}-row step at {available - 1} threads ({step_ms[available - 1]} ms) is "
            f"within the frontend's {frontend * 1e3:.2f} ms of its {rows} tokens of one at "
            f"{available} ({step_ms[available]} ms): a core left to the frontend"
        )
        return ThreadChoice(available - 1, available, reason, step_ms)
    reason = (
        f"a {rows}-row step at {available} threads ({step_ms[available]} ms) beats one at "
        f"{available - 1} ({step_ms[available - 1]} ms) by more than the frontend's "
        f"{frontend * 1e3:.2f} ms of its {rows} tokens"
    )
    return ThreadChoice(available, available, reason, step_ms)
