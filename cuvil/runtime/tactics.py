"""Tactic selection: when two kernels compute the same thing, time both on this CPU, inside the
running model, and keep the faster, per shape bucket.

Which GEMM path wins depends on the CPU, the shape and what the caches hold. On a 2-core AVX2
EPYC, MKL's sgemm (``addmm``) beats oneDNN's prepacked linear by 5-15 % on MiniLM shapes timed
in a loop, and oneDNN's erf-GELU post-op is 45 % slower than a separate in-place GELU; but inside
the tiny Llama, where each weight arrives from L3 rather than L2, oneDNN is 8 % faster overall.
Timing candidates back to back on a hot weight picked the wrong path there, so the timing is
done in place: while a bucket (row counts rounded up to a power of two) is undecided, its calls
take the candidates in turn (A B A B ...), each call is timed where the model really runs it,
and after ``ROUNDS`` timed calls per candidate (one untimed warm-up call each first: oneDNN
builds its primitive there) the fastest serves that bucket from then on. Every call returns the
candidate's result, so nothing runs twice. Candidates must be pure: same inputs, same result
(to rounding).

Outputs of one candidate and another differ in rounding, so a bucket's results are only
bit-stable once it is decided: ``CompiledModel.settle(inputs)`` runs a shape until every choice it
meets is made (the sidecar does so for each bucket before it reports ready).

``CUVIL_TACTICS=first`` turns timing off and always runs the first candidate (reproducible
kernel choice, e.g. for bisecting a numerical difference).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

ROUNDS = 4  # timed calls per candidate, after one untimed warm-up call each


def timing_enabled() -> bool:
    return os.environ.get("CUVIL_TACTICS", "time") != "first"


def bucket(rows: int) -> int:
    """Row counts rounded up to a power of two: 100 and 128 share a choice, 129 does not."""
    return 1 << max(0, rows - 1).bit_length()


class _Trial:
    """The calls of one undecided bucket: whose turn it is, and each candidate's best time."""

    def __init__(self, count: int) -> None:
        self.calls = 0
        self.count = count
        self.best = [float("inf")] * count

    def next_index(self) -> int:
        return self.calls % self.count

    def record(self, index: int, seconds: float) -> None:
        if self.calls >= self.count:  # the first turn of each candidate is its warm-up
            self.best[index] = min(self.best[index], seconds)
        self.calls += 1

    def winner(self) -> int | None:
        """The fastest candidate (fastest call: the one no neighbour slowed), once all ran."""
        if self.calls < self.count * (ROUNDS + 1):
            return None
        return self.best.index(min(self.best))


class Tactics:
    """Named candidates for one op; ``run(key, *args)`` runs the one chosen for ``key``."""

    def __init__(self, candidates: Sequence[tuple[str, Callable[..., Any]]]) -> None:
        if not candidates:
            raise ValueError("a tactic choice needs at least one candidate")
        self.candidates = tuple(candidates)
        self.chosen: dict[int, tuple[str, Callable[..., Any]]] = {}
        self._trials: dict[int, _Trial] = {}

    def run(self, key: int, *args: Any) -> Any:
        picked = self.chosen.get(key)
        if picked is not None:
            return picked[1](*args)
        if len(self.candidates) == 1 or not timing_enabled():
            self.chosen[key] = self.candidates[0]
            return self.candidates[0][1](*args)
        trial = self._trials.setdefault(key, _Trial(len(self.candidates)))
        index = trial.next_index()
        start = time.perf_counter()
        result = self.candidates[index][1](*args)
        trial.record(index, time.perf_counter() - start)
        winner = trial.winner()
        if winner is not None:
            self.chosen[key] = self.candidates[winner]
            self._trials.pop(key, None)
        return result

    def describe(self) -> dict[int, str]:
        """bucket -> name of the chosen candidate, or ``timing`` while its calls still take the
        candidates in turn (what runs, for reports and tests)."""
        described = {key: name for key, (name, _) in self.chosen.items()}
        described.update((key, "timing") for key in self._trials)
        return dict(sorted(described.items()))

    def trial_calls(self) -> dict[int, int]:
        """bucket -> calls so far, for the buckets still timing their candidates."""
        return {key: trial.calls for key, trial in self._trials.items()}
