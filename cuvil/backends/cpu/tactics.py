"""Tactic selection: when kernels compute the same thing, time each on this CPU, inside the
running model, and keep the fastest, per shape bucket.

Which GEMM path wins depends on the CPU, the shape and what the caches hold. A path that wins on
a shape timed alone in a loop, its weight hot in L2, can lose inside a model, where each weight
arrives from L3 or memory after the layers before it evicted it; and a fused post-op is not
always faster than a separate in-place activation (oneDNN's erf-GELU, for one). Timing
candidates back to back on a hot weight can pick the wrong path, so the timing is done in place:
while a bucket (row counts rounded up to a power of two) is undecided, its calls take the
candidates in runs of ``ROUNDS + 1`` consecutive calls, timed where the model really runs them;
the first call of each run is untimed (oneDNN builds its primitive there, and the caches still
hold the previous candidate's copy of the weight). Runs rather than alternation (A B A B),
because each path keeps its own copy of the weight: alternating, every call would find its
weight evicted by the other path's copy, a state that never occurs once one is chosen. A one-row
GEMM split across cores (backends/cpu/split_gemm.py) only wins with its weight slices still in
each core's L2, which alternation never shows.

The runs go round the candidates ``BLOCKS`` times (A A A A A B B B B B, three times over), and a
candidate's time is the median over its runs of each run's fastest call. One run each is not
enough on a shared host: every op of a model times its candidates in the same model runs, so one
slow stretch of the host can decide all of them at once, and one load of a model can run the
slower kernel in every layer where another load of it does not. For the same reason each
``Tactics`` starts its round at a different candidate (by the order they were made), so that a
slow stretch falls on different candidates of different ops. After the trial the fastest serves
the bucket. Every call returns the candidate's result, so nothing runs twice. Candidates must be
pure: same inputs, same result (to rounding).

Outputs of one candidate and another differ in rounding, so a bucket's results are only
bit-stable once it is decided: the CPU backend runs a shape until every choice it
meets is made (``CompiledModel.prepare``; the sidecar prepares each bucket before it reports
ready).

``CUVIL_TACTICS=first`` turns timing off and always runs the first candidate (reproducible
kernel choice, e.g. for bisecting a numerical difference).
"""

from __future__ import annotations

import itertools
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from cuvil.runtime.kernels import PreparedKernel

ROUNDS = 4  # timed calls per run of a candidate, after one untimed warm-up call
BLOCKS = 3  # runs per candidate

_made = itertools.count()  # staggers where each Tactics starts its round


def trial_length(candidates: int) -> int:
    """Calls a bucket with this many candidates takes to decide."""
    return candidates * BLOCKS * (ROUNDS + 1)


def timing_enabled() -> bool:
    return os.environ.get("CUVIL_TACTICS", "time") != "first"


def bucket(rows: int) -> int:
    """Row counts rounded up to a power of two: 100 and 128 share a choice, 129 does not."""
    return 1 << max(0, rows - 1).bit_length()


class _Trial:
    """The calls of one undecided bucket: whose turn it is, and each candidate's runs' bests."""

    def __init__(self, count: int, offset: int = 0) -> None:
        self.calls = 0
        self.count = count
        self.offset = offset
        self.runs: list[list[float]] = [[] for _ in range(count)]

    def next_index(self) -> int:
        return (self.calls // (ROUNDS + 1) + self.offset) % self.count

    def record(self, index: int, seconds: float) -> None:
        position = self.calls % (ROUNDS + 1)
        if position == 1:  # position 0, the run's first call, is its warm-up
            self.runs[index].append(seconds)
        elif position:
            self.runs[index][-1] = min(self.runs[index][-1], seconds)
        self.calls += 1

    def winner(self) -> int | None:
        """The candidate whose runs were fastest (median over its runs of each run's fastest
        call: the call no neighbour slowed, in the run no slow stretch of the host hit)."""
        if self.calls < trial_length(self.count):
            return None
        times = [statistics.median(runs) for runs in self.runs]
        return times.index(min(times))


class Tactics:
    """Named candidates for one op; ``run(key, *args)`` runs the one chosen for ``key``."""

    def __init__(
        self,
        candidates: Sequence[tuple[str, Callable[..., Any]]],
        small_only: Sequence[tuple[str, Callable[..., Any]]] = (),
        small_keys: int = 0,
        on_decided: Callable[[dict[int, str]], None] | None = None,
    ) -> None:
        """``small_only`` candidates join the others for keys up to ``small_keys`` (a path that
        only pays off for a few rows need not be timed, or kept, anywhere else). ``on_decided``
        hears ``describe()`` after each bucket's choice (e.g. to free what a loser holds)."""
        if not candidates:
            raise ValueError("a tactic choice needs at least one candidate")
        self.candidates = tuple(candidates)
        self.small = self.candidates + tuple(small_only)
        self.small_keys = small_keys
        self.chosen: dict[int, tuple[str, Callable[..., Any]]] = {}
        self.on_decided = on_decided
        self._trials: dict[int, _Trial] = {}
        self._serial = next(_made)

    def candidates_for(self, key: int) -> tuple[tuple[str, Callable[..., Any]], ...]:
        return self.small if key <= self.small_keys else self.candidates

    def run(self, key: int, *args: Any) -> Any:
        picked = self.chosen.get(key)
        if picked is not None:
            return picked[1](*args)
        candidates = self.candidates_for(key)
        if len(candidates) == 1 or not timing_enabled():
            self.chosen[key] = candidates[0]
            return candidates[0][1](*args)
        trial = self._trials.get(key)
        if trial is None:
            trial = self._trials[key] = _Trial(len(candidates), self._serial % len(candidates))
        index = trial.next_index()
        start = time.perf_counter()
        result = candidates[index][1](*args)
        trial.record(index, time.perf_counter() - start)
        winner = trial.winner()
        if winner is not None:
            self.chosen[key] = candidates[winner]
            self._trials.pop(key, None)
            if self.on_decided is not None:
                self.on_decided(self.describe())
        return result

    def preset(self, choices: Mapping[int, str]) -> int:
        """Take choices made before (bucket -> candidate name; ``backends/cpu/tactics_cache.py``)
        instead of timing those buckets again. A name this op does not offer for that bucket is
        skipped, and the bucket is timed as usual. Returns how many choices were taken."""
        taken = 0
        for key, name in choices.items():
            offered = dict(self.candidates_for(key))
            if key in self.chosen or name not in offered:
                continue
            self.chosen[key] = (name, offered[name])
            self._trials.pop(key, None)
            taken += 1
        if taken and self.on_decided is not None:
            self.on_decided(self.describe())
        return taken

    def describe(self) -> dict[int, str]:
        """bucket -> name of the chosen candidate, or ``timing`` while its calls still take the
        candidates in turn (what runs, for reports and tests)."""
        described = {key: name for key, (name, _) in self.chosen.items()}
        described.update((key, "timing") for key in self._trials)
        return dict(sorted(described.items()))

    def trial_calls(self) -> dict[int, int]:
        """bucket -> calls so far, for the buckets still timing their candidates."""
        return {key: trial.calls for key, trial in self._trials.items()}


def batch_tactics(
    candidates: Sequence[tuple[str, Callable[..., Any]]],
    on_decided: Callable[[dict[int, str]], None] | None = None,
) -> PreparedKernel:
    """One kernel over ``candidates`` that take ``(x, *rest)``, chosen per bucket of x's batch
    size; its ``Tactics`` are the kernel's choices (for reports and ``prepare``)."""
    tactics = Tactics(candidates, on_decided=on_decided)

    def run(x: Any, *rest: Any) -> Any:
        return tactics.run(bucket(x.shape[0]), x, *rest)

    return PreparedKernel(run, tactics)
