"""The two GEMM paths of cuvil.linear agree with F.linear; tactics pick one per row bucket; bf16
weights run widened to fp32 where the CPU has no bf16 instructions."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from cuvil.backends.cpu import plan_loop
from cuvil.backends.cpu.linear_kernels import (
    INPLACE_ACTIVATIONS,
    compute_precision,
    has_onednn_bf16,
    linear_kernel,
    swiglu_kernel,
)
from cuvil.backends.cpu.tactics import BLOCKS, ROUNDS, Tactics, bucket, trial_length
from cuvil.runtime.kernels import PreparedKernel
from tests.cuvil.backends.cpu.calls import prepare

REFERENCE = {
    "none": lambda y: y,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda y: F.gelu(y, approximate="tanh"),
    "silu": F.silu,
    "hardswish": F.hardswish,
    "relu6": F.relu6,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
}


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    scale = max(float(expected.abs().max()), 1.0)
    assert float((actual - expected).abs().max()) <= 1e-5 * scale


@pytest.mark.parametrize("activation", sorted(INPLACE_ACTIVATIONS))
def test_every_path_matches_linear_with_activation(activation: str) -> None:
    torch.manual_seed(0)
    weight, bias = torch.randn(24, 16), torch.randn(24)
    kernel = prepare(linear_kernel, {"weight": weight, "bias": bias, "activation": activation})
    tactics = _tactics(kernel)
    with torch.inference_mode():
        for rows in (1, 7, 130):
            x = torch.randn(2, rows, 16)
            expected = REFERENCE[activation](F.linear(x, weight, bias))
            _close(kernel.run(x), expected)  # the chosen path
            for _, path in tactics.candidates:  # and every other one
                _close(path(x.reshape(-1, 16)).view(2, rows, 24), expected)
    assert set(tactics.describe()) == {bucket(2), bucket(14), bucket(260)}


@pytest.mark.parametrize("bias", [True, False])
def test_every_path_matches_linear_plus_residual(bias: bool) -> None:
    torch.manual_seed(1)
    weight = torch.randn(8, 12)
    b = torch.randn(8) if bias else None
    kernel = prepare(
        linear_kernel, {"weight": weight, "bias": b, "activation": "none"}, ["input", "residual"]
    )
    with torch.inference_mode():
        x, residual = torch.randn(3, 5, 12), torch.randn(3, 5, 8)
        expected = F.linear(x, weight, b) + residual
        _close(kernel.run(x, residual), expected)
        for _, path in _tactics(kernel).candidates:
            _close(path(x.reshape(15, 12), residual.reshape(15, 8)).view(3, 5, 8), expected)
        assert torch.equal(residual, residual.clone())  # the residual is not written to


def test_linear_refuses_activation_and_residual_together() -> None:
    with pytest.raises(ValueError, match="not both"):
        prepare(
            linear_kernel,
            {"weight": torch.randn(4, 4), "bias": None, "activation": "relu"},
            ["input", "residual"],
        )


def _tactics(kernel: PreparedKernel) -> Tactics:
    assert isinstance(kernel.choices, Tactics)
    return kernel.choices


def test_tactics_time_candidates_in_place_then_keep_the_faster() -> None:
    calls: list[str] = []

    def slow(x: int) -> int:
        calls.append("slow")
        sum(range(20000))
        return x + 1

    def fast(x: int) -> int:
        calls.append("fast")
        return x + 1

    tactics = Tactics([("slow", slow), ("fast", fast)])
    length = trial_length(2)
    results = [tactics.run(8, n) for n in range(length)]
    assert results == [n + 1 for n in range(length)]  # every call answered, once
    runs = [calls[at : at + ROUNDS + 1] for at in range(0, length, ROUNDS + 1)]
    assert all(len(set(run)) == 1 for run in runs)  # runs of one candidate
    assert [run[0] for run in runs[:2]] * BLOCKS == [run[0] for run in runs]  # taking turns
    assert tactics.describe() == {8: "fast"}
    assert tactics.run(8, 1) == 2 and calls[-1] == "fast" and len(calls) == length + 1
    assert tactics.run(16, 1) == 2 and tactics.describe() == {8: "fast", 16: "timing"}


def test_one_slow_stretch_does_not_decide_a_tactic() -> None:
    """The fast candidate's first run is slowed (a neighbour's burst); its other runs decide."""
    fast_calls = 0

    def steady() -> str:
        time.sleep(0.002)
        return "steady"

    def fast() -> str:
        nonlocal fast_calls
        fast_calls += 1
        time.sleep(0.006 if fast_calls <= ROUNDS + 1 else 0)
        return "fast"

    tactics = Tactics([("steady", steady), ("fast", fast)])
    for _ in range(trial_length(2)):
        tactics.run(1)
    assert tactics.describe() == {1: "fast"}


def test_tactics_start_their_rounds_at_different_candidates() -> None:
    firsts = set()
    for _ in range(4):
        tactics = Tactics([("a", lambda: "a"), ("b", lambda: "b")])
        firsts.add(tactics.run(1))
    assert firsts == {"a", "b"}


def test_tactics_first_disables_timing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUVIL_TACTICS", "first")
    tactics = Tactics([("a", lambda: "a"), ("b", lambda: "b")])
    assert tactics.run(1) == "a" and tactics.run(1) == "a"
    assert tactics.describe() == {1: "a"}


def test_bucket_rounds_up_to_a_power_of_two() -> None:
    assert [bucket(n) for n in (1, 2, 3, 100, 128, 129)] == [1, 2, 4, 128, 128, 256]


def test_bf16_weights_compute_as_the_cpu_allows() -> None:
    torch.manual_seed(2)
    weight = torch.randn(32, 16).to(torch.bfloat16)
    kernel = prepare(linear_kernel, {"weight": weight, "bias": None, "activation": "none"})
    x = torch.randn(4, 16)
    with torch.inference_mode():
        actual = kernel.run(x)
    assert actual.dtype == torch.float32
    if has_onednn_bf16():
        assert compute_precision(torch.bfloat16) == "bf16"
        assert float((actual - F.linear(x, weight.float())).abs().max()) < 0.1
    else:  # widened once: exactly the fp32 product with the bf16-rounded weight
        assert compute_precision(torch.bfloat16) == "fp32"
        _close(actual, F.linear(x, weight.float()))


def test_swiglu_matches_its_definition() -> None:
    torch.manual_seed(3)
    gate, up = torch.randn(10, 8), torch.randn(10, 8)
    kernel = prepare(swiglu_kernel, {"gate_up_weight": torch.cat([gate, up]), "hidden": 10})
    x = torch.randn(2, 6, 8)
    with torch.inference_mode():
        _close(kernel.run(x), F.silu(F.linear(x, gate)) * F.linear(x, up))


def test_compiled_model_reports_the_paths_its_linears_chose() -> None:
    import cuvil

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    compiled = cuvil.jit(model.eval(), (torch.randn(2, 8),))
    for _ in range(trial_length(3)):  # the calls that time the paths (2 rows: three of them)
        compiled(torch.randn(2, 8))
    tactics = compiled.execution()["tactics"]
    assert len(tactics) == 2
    assert all(set(choice) == {2} for choice in tactics.values())
    paths = {path for choice in tactics.values() for path in choice.values()}
    assert paths <= {"mkl", "onednn", "split"}


def test_prepare_makes_the_choices_a_shape_meets_then_results_are_bit_stable() -> None:
    import cuvil
    from cuvil.backends.cpu.backend import SETTLE_RUNS

    torch.manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    rows = cuvil.Dim("rows", min=1, max=64)
    example = torch.randn(4, 32)
    compiled = cuvil.jit(model.eval(), (example,), dynamic_shapes=({0: rows},), choose_kernels=True)
    assert compiled.prepare({"input": example}) == 1  # the compiler made the example's choices
    x = torch.randn(16, 32)  # a bucket the example did not reach
    runs = compiled.prepare({"input": x})
    assert 1 < runs <= SETTLE_RUNS
    choices = compiled.execution()["tactics"]
    assert all(choice[bucket(16)] in ("mkl", "onednn", "split") for choice in choices.values())
    first, second = compiled(x), compiled(x)
    assert torch.equal(first, second)
    assert compiled.prepare({"input": x}) == 1  # nothing left to choose


def test_few_row_candidates_join_only_small_buckets() -> None:
    calls: list[str] = []

    def path(name: str) -> Any:
        return lambda: calls.append(name) or name

    tactics = Tactics([("a", path("a")), ("b", path("b"))], [("c", path("c"))], small_keys=4)
    for _ in range(trial_length(3)):
        tactics.run(4)
    assert set(calls) == {"a", "b", "c"} and tactics.describe()[4] in {"a", "b", "c"}
    calls.clear()
    for _ in range(trial_length(2)):
        tactics.run(8)
    assert set(calls) == {"a", "b"} and tactics.describe()[8] in {"a", "b"}


ACTIVATE = {"none": lambda y: y, "relu": torch.relu, "gelu": F.gelu}


@pytest.mark.parametrize("parts", [2, 3])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("activation, residual", [("none", True), ("relu", False), ("gelu", False)])
@pytest.mark.parametrize("features", [10, 7])  # 7: not a multiple of the parts (padded)
@pytest.mark.parametrize("with_bias", [True, False])
def test_split_gemm_matches_the_linear(
    parts: int, rows: int, activation: str, residual: bool, features: int, with_bias: bool
) -> None:
    from cuvil.backends.cpu.split_gemm import split_linear

    torch.manual_seed(5)
    weight, x = torch.randn(features, 12), torch.randn(rows, 12)
    bias = torch.randn(features) if with_bias else None
    extra = (torch.randn(rows, features),) if residual else ()
    expected = ACTIVATE[activation](F.linear(x, weight, bias) + (extra[0] if residual else 0))
    _close(split_linear(weight, bias, activation, residual, parts)(x, *extra), expected)


@pytest.mark.parametrize("residual", [False, True])
def test_bf16_gemms_of_few_rows_also_time_one_thread(residual: bool) -> None:
    """One-thread oneDNN joins the bf16 GEMM's candidates for few rows; it computes what two
    threads do, as a Python call and as the native plan's one call, and leaves the thread count
    as it was."""
    torch.manual_seed(3)
    weight, bias = torch.randn(48, 32).to(torch.bfloat16), torch.randn(48)
    constants = {"weight": weight, "bias": bias, "activation": "none" if residual else "relu"}
    runtime = ("input", "residual") if residual else ("input",)
    x, added = torch.randn(3, 32), torch.randn(3, 48)
    args = (x, added) if residual else (x,)
    kernels = {path: prepare(linear_kernel, constants, runtime) for path in ("onednn", "1t")}
    tactics = kernels["onednn"].choices
    assert isinstance(tactics, Tactics)
    names = {key: [name for name, _ in tactics.candidates_for(key)] for key in (4, 32)}
    if not has_onednn_bf16() or torch.get_num_threads() == 1:  # no bf16 GEMM, or no 2nd thread
        assert all("onednn_1t" not in found for found in names.values())
        return
    assert names == {4: ["onednn", "onednn_1t"], 32: ["onednn"]}
    kernels["onednn"].choices.preset({4: "onednn"})
    kernels["1t"].choices.preset({4: "onednn_1t"})
    threads = torch.get_num_threads()
    with torch.inference_mode():
        two, one = (kernels[path].run(*args) for path in ("onednn", "1t"))
        native = kernels["1t"].native
        assert native is not None
        assert plan_loop.load(), plan_loop.reason()
        calls = native(args)
        assert calls is not None
        first = calls[0]
        values = [first.op(*first.args)]
        if residual:
            values.append(values[0] + added)
    expected = F.linear(x, weight.float(), bias)
    expected = expected + added if residual else F.relu(expected)
    assert float((two - expected).abs().max()) < 0.1  # bf16 weights, bf16 inputs
    _close(one, two)
    _close(values[-1], one)
    assert torch.get_num_threads() == threads
