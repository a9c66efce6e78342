"""Tactic selection: when two kernels compute the same thing, time both on this CPU and keep the
faster, per shape bucket.

Which GEMM path wins depends on the CPU and the shape: on a 2-core AVX2 EPYC, MKL's sgemm
(``addmm``) beats oneDNN's prepacked linear by 5-15 % on most MiniLM and Llama shapes, oneDNN
wins on wide outputs (384 -> 1536) below ~256 rows, and oneDNN's erf-GELU post-op is 45 % slower
than a separate in-place GELU. No fixed rule holds on every machine, so, like TensorRT's tactic
selection but lazily and at run time (the row count is a dynamic dim), the first call in a new
bucket (row counts rounded up to a power of two) times every candidate a few times and the winner
serves that bucket from then on. Candidates must be pure: same inputs, same result (to rounding).

``CUVIL_TACTICS=first`` turns timing off and always runs the first candidate (reproducible
kernel choice, e.g. for bisecting a numerical difference).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

ROUNDS = 5  # timed calls per candidate, interleaved (A B A B ...) after one untimed call each


def timing_enabled() -> bool:
    return os.environ.get("CUVIL_TACTICS", "time") != "first"


def bucket(rows: int) -> int:
    """Row counts rounded up to a power of two: 100 and 128 share a choice, 129 does not."""
    return 1 << max(0, rows - 1).bit_length()


class Tactics:
    """Named candidates for one op; ``choose(key, *args)`` returns the one to run for ``key``."""

    def __init__(self, candidates: Sequence[tuple[str, Callable[..., Any]]]) -> None:
        if not candidates:
            raise ValueError("a tactic choice needs at least one candidate")
        self.candidates = tuple(candidates)
        self.chosen: dict[int, tuple[str, Callable[..., Any]]] = {}

    def choose(self, key: int, *args: Any) -> Callable[..., Any]:
        picked = self.chosen.get(key)
        if picked is None:
            picked = self._time(args) if timing_enabled() else self.candidates[0]
            self.chosen[key] = picked
        return picked[1]

    def _time(self, args: tuple[Any, ...]) -> tuple[str, Callable[..., Any]]:
        """Each candidate's fastest of ROUNDS calls, taken in alternation: a neighbour that
        steals the CPU for a while slows every candidate alike, and the minimum is the call it
        did not touch (a median picked oneDNN's slow GELU epilogue under load)."""
        if len(self.candidates) == 1:
            return self.candidates[0]
        for _, run in self.candidates:
            run(*args)
        best = [float("inf")] * len(self.candidates)
        for _ in range(ROUNDS):
            for index, (_, run) in enumerate(self.candidates):
                start = time.perf_counter()
                run(*args)
                best[index] = min(best[index], time.perf_counter() - start)
        return self.candidates[best.index(min(best))]

    def describe(self) -> dict[int, str]:
        """bucket -> name of the chosen candidate (what ran, for reports and tests)."""
        return {key: name for key, (name, _) in sorted(self.chosen.items())}
