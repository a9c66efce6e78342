"""The engine's thread count: one fewer than the process's when the full decode step loses less
than the frontend's work for its tokens, the count a setting fixes otherwise, and the scheduler
thread running the engine at the count chosen."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cuvil_sidecar.config import SidecarConfig
from cuvil_sidecar.generation import loader
from cuvil_sidecar.generation.engine_threads import (
    FRONTEND_TOKEN_S,
    choose_engine_threads,
    torch_threads,
)
from cuvil_sidecar.generation.scheduler import Scheduler

import cuvil
from cuvil.generation.sampling import SamplingParams
from cuvil.runtime.signature import InputError
from tests.cuvil.generation.families import VOCAB, build
from tests.cuvil_sidecar.generation.test_scheduler import Collector


class TimedSteps:
    """An engine whose decode step at ``rows`` takes what ``seconds`` says for the calling
    thread's thread count (a list: one time per timing, in turn), recording the counts it was
    timed at."""

    def __init__(self, seconds: dict[int, float | list[float]], max_batch: int = 16) -> None:
        self.seconds = {t: s if isinstance(s, list) else [s] for t, s in seconds.items()}
        self.max_batch = max_batch
        self.timed: list[tuple[int, int]] = []

    def step_seconds(self, rows: int) -> float:
        threads = torch.get_num_threads()
        self.timed.append((rows, threads))
        times = self.seconds[threads]
        count = sum(1 for _, t in self.timed if t == threads)  # this timing's number, from 1
        return times[(count - 1) % len(times)]


def test_a_step_that_barely_gains_from_its_last_thread_leaves_a_core() -> None:
    frontend = 16 * FRONTEND_TOKEN_S
    engine = TimedSteps({4: 1.0e-3, 3: 1.0e-3 + 0.9 * frontend})
    before = torch.get_num_threads()
    choice = choose_engine_threads(engine, 4)
    assert choice.threads == 3
    assert engine.timed == [(16, 4), (16, 3)] * 3  # the full row count, each count in turn
    assert set(choice.step_ms) == {3, 4}
    assert "a core left to the frontend" in choice.reason
    assert torch.get_num_threads() == before


def test_a_step_that_gains_more_than_the_frontend_costs_takes_every_thread() -> None:
    frontend = 16 * FRONTEND_TOKEN_S
    engine = TimedSteps({2: 30e-3, 1: 30e-3 + 1.1 * frontend + 20e-3})
    choice = choose_engine_threads(engine, 2)
    assert choice.threads == 2
    assert "beats" in choice.reason


def test_a_count_slowed_by_the_host_once_is_judged_by_its_fastest_round() -> None:
    """The second core busy while the two-thread step was first timed (a neighbour's burst):
    its other rounds show the step it really takes."""
    engine = TimedSteps({2: [68e-3, 27e-3, 28e-3], 1: [55e-3, 54e-3, 56e-3]})
    choice = choose_engine_threads(engine, 2)
    assert choice.threads == 2 and choice.step_ms == {2: 27.0, 1: 54.0}


def test_a_fixed_count_or_one_core_times_nothing() -> None:
    engine = TimedSteps({})
    assert choose_engine_threads(engine, 8, fixed=3).threads == 3
    assert choose_engine_threads(engine, 1).threads == 1
    assert engine.timed == []


def test_torch_threads_restores_the_count_when_the_scope_fails() -> None:
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError), torch_threads(1):
        assert torch.get_num_threads() == 1
        raise RuntimeError("inside")
    assert torch.get_num_threads() == before


def test_step_seconds_times_a_prepared_step_and_leaves_the_cache_empty() -> None:
    model = build("llama")
    example = {"input_ids": torch.randint(6, VOCAB, (1, 6))}
    compiled = cuvil.jit(model, example, task="text-generation", max_batch=3, max_seq=32)
    seconds = compiled.step_seconds(3, runs=3)
    assert 0 < seconds < 5
    assert (3, torch.get_num_threads()) in compiled._decode_calls
    assert all(not cache.any() for cache in compiled.caches)
    with pytest.raises(InputError, match=r"1\.\.3 rows"):
        compiled.step_seconds(4)


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = build("llama")
    example = {"input_ids": torch.randint(6, VOCAB, (1, 6))}
    compiled = cuvil.jit(model, example, task="text-generation", max_batch=3, max_seq=48)
    return compiled.save(tmp_path_factory.mktemp("artifact") / "llama", directory=True)


def test_the_scheduler_runs_the_engine_at_the_count_the_setting_fixes(artifact: Path) -> None:
    settings = SidecarConfig(str(artifact), prefill_chunk=8, generation_threads=1)
    served = loader.ENGINE_FOR_ARTIFACT(artifact, loader.artifact_config(artifact), settings)
    assert served.threads is not None and served.threads.threads == 1
    assert "CUVIL_GENERATION_THREADS" in served.threads.reason
    engine = served.engine
    warmed = set(engine._decode_calls)
    assert {(rows, 1) for rows in (1, 2, 3)} <= warmed
    scheduler = Scheduler(engine, prefill_chunk=8, threads=1)
    try:
        collectors = [Collector() for _ in range(3)]
        for index, collector in enumerate(collectors):
            prompt = list(range(6 + index, 12 + 2 * index))
            scheduler.submit(prompt, SamplingParams(max_new_tokens=5), collector)
        assert all(len(collector.tokens()) == 5 for collector in collectors)
    finally:
        scheduler.close()
    # a step at any other thread count would have added its own direct call
    assert set(engine._decode_calls) == warmed
