"""Kernel choices made at compile time travel in the artifact per CPU family
(cuvil/backends/cpu/kernel_choices.py): a load on the same family times nothing, a load on
another family times its kernels as it runs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import cuvil
from cuvil.backends.cpu import kernel_choices
from cuvil.runtime.model import CompiledModel

X = {"input": torch.randn(2, 16)}


@pytest.fixture(autouse=True)
def _timed_tactics(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUVIL_TACTICS", raising=False)  # candidates are timed, not "first"
    monkeypatch.setenv("CUVIL_KERNEL_CHOICES", "compile")  # tests/conftest.py turns it off


def test_choose_kernels_off_carries_no_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUVIL_KERNEL_CHOICES", "off")
    assert kernel_choices.CONFIG_KEY not in _compiled().config
    model = torch.nn.Linear(16, 4).eval()
    chosen = cuvil.jit(model, (X["input"],), choose_kernels=True)
    assert chosen.config[kernel_choices.CONFIG_KEY][kernel_choices.cpu_family()]


def _compiled() -> CompiledModel:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    return cuvil.jit(model.eval(), (X["input"],))


def _carried(model: CompiledModel) -> dict:
    return model.config[kernel_choices.CONFIG_KEY]


def test_compile_makes_the_example_shapes_choices_and_the_artifact_keeps_them() -> None:
    compiled = _compiled()
    family = kernel_choices.cpu_family()
    carried = _carried(compiled)[family]
    assert carried and all("timing" not in buckets.values() for buckets in carried.values())
    assert compiled.plan.kernel_trials() == {}  # nothing left to time at the example's shape
    compiled.run(X)
    assert compiled.plan.kernel_trials() == {}  # the first call runs the chosen kernels
    assert compiled.report["kernel_choice_seconds"] >= 0


def test_a_load_on_the_same_family_runs_the_artifacts_choices_without_trials(
    tmp_path: Path,
) -> None:
    compiled = _compiled()
    loaded = cuvil.load(compiled.save(tmp_path / "model.cuvil"))
    carried = kernel_choices.carried_for_this_cpu(loaded)
    assert carried and loaded.execution()["tactics_from_artifact"] == carried
    for _ in range(3):
        loaded.run(X)
        assert loaded.plan.kernel_trials() == {}  # no call timed a candidate
    assert loaded.execution()["tactics"] == carried
    with torch.inference_mode():
        assert torch.equal(loaded.run(X)["output"], compiled.run(X)["output"])


def test_a_load_on_another_family_times_its_kernels_again() -> None:
    compiled = _compiled()
    other = {"GenuineOther:avx2:1t": _carried(compiled)[kernel_choices.cpu_family()]}
    config = dict(compiled.config) | {kernel_choices.CONFIG_KEY: other}
    moved = CompiledModel(dataclasses.replace(compiled.contents, config=config))
    assert moved.execution()["tactics_from_artifact"] == {}
    moved.run(X)
    trials = moved.plan.kernel_trials()
    assert trials and all(calls == 1 for calls in trials.values())  # each timing from call one


def test_the_family_names_vendor_extensions_and_threads() -> None:
    info = {"vendor_id": "AuthenticAMD", "flags": "fpu sse2 avx2 fma avx512f avx512_bf16"}
    assert kernel_choices.cpu_family(info, 2) == "AuthenticAMD:avx2+fma+avx512f+avx512_bf16:2t"
    amx = {"vendor_id": "GenuineIntel", "flags": "avx2 fma avx512f amx_tile amx_bf16"}
    assert kernel_choices.cpu_family(amx, 2) != kernel_choices.cpu_family(info, 2)
    assert kernel_choices.cpu_family(info, 4) != kernel_choices.cpu_family(info, 2)


def test_compiling_again_keeps_the_families_it_did_not_time_on() -> None:
    compiled = _compiled()
    seen = {"GenuineOther:avx2:1t": {"linear": {"2": "onednn"}}}
    compiled.contents.config[kernel_choices.CONFIG_KEY] = seen
    entry = kernel_choices.choose_at_compile(compiled, X, lambda model, inputs: 0)
    assert set(entry[kernel_choices.CONFIG_KEY]) == {*seen, kernel_choices.cpu_family()}


def test_compile_also_makes_the_choices_of_one_item() -> None:
    """A batch-2 example with a dynamic batch: the first batch-1 call is timed no more."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    batch = cuvil.Dim("batch", min=1, max=8)
    compiled = cuvil.jit(model.eval(), (X["input"],), dynamic_shapes=({0: batch},))
    carried = _carried(compiled)[kernel_choices.cpu_family()]
    assert all({"1", "2"} <= set(buckets) for buckets in carried.values()), carried
    compiled.run({"input": torch.randn(1, 16)})
    assert compiled.plan.kernel_trials() == {}
    compiled.run({"input": torch.randn(8, 16)})  # a bucket neither shape reached: timed
    assert compiled.plan.kernel_trials() != {}
