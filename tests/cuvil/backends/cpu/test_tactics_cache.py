"""The tactics cache (cuvil/backends/cpu/tactics_cache.py): a load takes the kernel choices an
earlier load of the same artifact made on this machine, and anything else is a miss."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch

import cuvil
from cuvil.backends.cpu import kernel_choices, tactics_cache
from cuvil.backends.cpu.tactics import Tactics, trial_length
from cuvil.runtime.model import CompiledModel

DIGEST = "sha256:" + "ab" * 32


def _compiled() -> CompiledModel:
    """A model as loaded on a CPU family its artifact carries no kernel choices for (the
    compiler's own, kernel_choices.py, would take precedence): its kernels time as they run."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    compiled = cuvil.jit(model.eval(), (torch.randn(2, 16),))
    config = {k: v for k, v in compiled.config.items() if k != kernel_choices.CONFIG_KEY}
    return CompiledModel(dataclasses.replace(compiled.contents, config=config))


def test_preset_takes_offered_names_and_leaves_the_rest_to_timing() -> None:
    calls: list[str] = []
    tactics = Tactics([("a", lambda: calls.append("a")), ("b", lambda: calls.append("b"))])
    assert tactics.preset({1: "b", 2: "nonesuch"}) == 1
    tactics.run(1)
    assert calls == ["b"] and tactics.describe() == {1: "b"}
    tactics.run(2)  # the unknown name was skipped: bucket 2 is timed
    assert tactics.describe() == {1: "b", 2: "timing"}


def test_a_second_load_runs_the_first_loads_kernels_without_timing(tmp_path: Path) -> None:
    x = {"input": torch.randn(2, 16)}
    first = _compiled()
    cached = tactics_cache.take_cached(first, DIGEST, tmp_path)
    assert cached == {}  # nothing kept yet
    first.prepare(x)
    tactics_cache.keep(first, DIGEST, tmp_path, cached)
    kept = first.execution()["tactics"]
    assert kept and all("timing" not in by_bucket.values() for by_bucket in kept.values())

    # the file says oneDNN everywhere (a path both linears offer): the second load runs that
    forced = {node: dict.fromkeys(by_bucket, "onednn") for node, by_bucket in kept.items()}
    tactics_cache.write_choices(tactics_cache.cache_file(tmp_path, DIGEST), DIGEST, forced)
    second = _compiled()
    assert tactics_cache.take_cached(second, DIGEST, tmp_path) == forced
    assert second.execution()["tactics"] == forced  # chosen before any run
    second.run(x)
    assert second.plan.kernel_trials() == {}  # nothing timed
    with torch.inference_mode():
        assert torch.allclose(second.run(x)["output"], first.run(x)["output"], atol=1e-5)


def test_another_artifact_or_thread_count_is_a_miss(tmp_path: Path) -> None:
    here = tactics_cache.cache_file(tmp_path, DIGEST)
    assert tactics_cache.cache_file(tmp_path, "sha256:" + "cd" * 32) != here
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert tactics_cache.cache_file(tmp_path, DIGEST) != here
    finally:
        torch.set_num_threads(threads)
    assert tactics_cache.cache_file(tmp_path, DIGEST) == here


@pytest.mark.parametrize("content", ["{not json", '{"tactics": [1, 2]}', '{"other": {}}'])
def test_a_damaged_cache_file_is_a_miss_and_is_replaced(
    tmp_path: Path, content: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = tactics_cache.cache_file(tmp_path, DIGEST)
    path.write_text(content)
    model = _compiled()
    with caplog.at_level(logging.WARNING, "cuvil.backends.cpu.tactics_cache"):
        assert tactics_cache.take_cached(model, DIGEST, tmp_path) == {}
    assert "ignoring the tactics cache" in caplog.text
    for _ in range(trial_length(3)):
        model.run({"input": torch.randn(2, 16)})
    tactics_cache.keep(model, DIGEST, tmp_path, {})
    assert tactics_cache.read_choices(path) == model.execution()["tactics"]


def test_an_unwritable_cache_does_not_fail_the_load(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    model = _compiled()
    model.prepare({"input": torch.randn(2, 16)})
    with caplog.at_level(logging.WARNING, "cuvil.backends.cpu.tactics_cache"):
        tactics_cache.keep(model, DIGEST, blocker / "tactics", {})  # a file in the way
    assert "cannot keep the kernel choices" in caplog.text
