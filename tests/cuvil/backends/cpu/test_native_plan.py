"""The native plan loop: settled shapes run as C++ schedules and still match eager PyTorch and
the Python plan; steps without a native form stay Python calls between schedules; without the
library the Python plan runs and says why."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch

import cuvil
from cuvil import fused_ops as fused
from cuvil.backends.cpu import native_plan, plan_loop
from cuvil.backends.cpu.kernels import CPU_KERNELS
from cuvil.models import mlp, tiny_llama
from cuvil.runtime.model import CompiledModel
from cuvil.runtime.signature import InputError


@pytest.fixture(scope="module")
def compiled_mlp() -> CompiledModel:
    spec = mlp()
    return cuvil.jit(spec.model, spec.example_inputs, dynamic_shapes=spec.dynamic_shapes)


def _shapes(model: CompiledModel) -> dict[str, dict]:
    described = model.execution()["plan_loop"]
    assert described["status"] == "native schedules per settled shape", described
    return described["shapes"]


@pytest.mark.parametrize("batch", [1, 5])
def test_a_settled_mlp_runs_as_one_schedule_and_matches_eager(
    compiled_mlp: CompiledModel, batch: int
) -> None:
    model = mlp().model
    x = torch.randn(batch, 784)
    compiled_mlp.prepare({"x": x})
    shapes = _shapes(compiled_mlp)
    entry = next(summary for key, summary in shapes.items() if key.startswith(f"batch={batch} "))
    assert entry["whole_plan_native"] and entry["python_steps"] == []
    with torch.inference_mode():
        expected = model(x)
        reference = compiled_mlp.plan.run({"x": x}, {"batch": batch})["output"]
    for _ in range(2):
        y = torch.randn(batch, 784)  # new data at the settled shape: not what was recorded
        with torch.inference_mode():
            torch.testing.assert_close(compiled_mlp(y), model(y), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(compiled_mlp(x), expected, atol=1e-5, rtol=1e-5)
    outside = compiled_mlp(x)  # the direct call, outside inference mode: it sets its own
    assert outside.is_inference() and not outside.requires_grad
    torch.testing.assert_close(outside, reference, atol=1e-6, rtol=1e-6)


def test_steps_without_a_native_form_run_between_schedules(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def without_native(factory: Any) -> Any:
        return lambda call: replace(factory(call), native=None)

    for name in (fused.RMS_NORM, fused.SWIGLU):  # as a kernel with no native form would be
        monkeypatch.setitem(CPU_KERNELS, name, without_native(CPU_KERNELS[name]))
    spec = tiny_llama()
    compiled = cuvil.jit(spec.model, spec.example_inputs, dynamic_shapes=spec.dynamic_shapes)
    ids = torch.randint(0, 2048, (1, 24), generator=torch.Generator().manual_seed(1))
    compiled.prepare({"input_ids": ids})
    (entry,) = _shapes(compiled).values()
    python = entry["python_steps"]
    assert python and entry["native_steps"] > len(python) and entry["schedules"] >= 2
    assert not entry["whole_plan_native"]
    ops = {node.name: node.op for node in compiled.graph.nodes}
    assert {ops[name] for name in python} == {"cuvil.rms_norm", "cuvil.swiglu"}
    with torch.inference_mode():
        expected = spec.model(ids).logits
    for _ in range(2):
        torch.testing.assert_close(
            compiled.run({"input_ids": ids})["logits"], expected, atol=2e-4, rtol=2e-4
        )


@pytest.fixture
def slow_switches() -> Iterator[None]:
    """A thread holding the GIL keeps it: another runs only where the GIL is released."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(100.0)
    yield
    sys.setswitchinterval(interval)


def test_a_native_call_lets_other_python_threads_run(
    compiled_mlp: CompiledModel, slow_switches: None
) -> None:
    x = torch.randn(64, 784)
    compiled_mlp.prepare({"x": x})
    assert _shapes(compiled_mlp)  # settled, so the calls below are native
    ticks = [0]
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            ticks[0] += 1
            stop.wait(0.0005)  # waits without the GIL, then needs it back to count

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        before = ticks[0]
        for _ in range(30):
            compiled_mlp(x)
        during = ticks[0] - before
    finally:
        stop.set()
        ticker.join()
    assert during > 0


def test_without_the_library_the_python_plan_runs_and_says_why(
    compiled_mlp: CompiledModel, monkeypatch: pytest.MonkeyPatch, tmp_path: object
) -> None:
    spec = mlp()
    monkeypatch.setenv("CUVIL_NATIVE_CACHE", str(tmp_path))  # nothing built there
    monkeypatch.setenv("PATH", str(tmp_path))  # and no compiler to build it
    monkeypatch.delenv("CXX", raising=False)
    plan_loop.load.cache_clear()
    try:
        fresh = cuvil.load(compiled_mlp.save(f"{tmp_path}/mlp.cuvil"))
        x = torch.randn(3, 784)
        fresh.prepare({"x": x})
        status = fresh.execution()["plan_loop"]["status"]
        assert status == "Python plan: no C++ compiler (c++ or g++) on PATH"
        with torch.inference_mode():
            torch.testing.assert_close(fresh(x), spec.model(x), atol=1e-5, rtol=1e-5)
    finally:
        monkeypatch.undo()
        plan_loop.load.cache_clear()
    assert plan_loop.load()


def test_direct_calls_at_a_settled_shape_still_refuse_other_inputs(
    compiled_mlp: CompiledModel,
) -> None:
    model = mlp().model
    x = torch.randn(2, 784)
    compiled_mlp.prepare({"x": x})
    for _ in range(3):  # the first call is checked, later ones go straight to the schedule
        y = torch.randn(2, 784)
        with torch.inference_mode():
            torch.testing.assert_close(compiled_mlp(y), model(y), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            compiled_mlp.run({"x": y})["output"], compiled_mlp(y), atol=0, rtol=0
        )
    with pytest.raises(InputError):
        compiled_mlp(torch.randn(2, 784, dtype=torch.float64))
    with pytest.raises(InputError):
        compiled_mlp(torch.randn(2, 783))
    with pytest.raises(InputError):
        compiled_mlp.run({"x": torch.randn(65, 784)})
    y = torch.randn(2, 784)
    with torch.no_grad():  # outside inference mode: the direct call enters it, as run() does
        torch.testing.assert_close(compiled_mlp(y), model(y), atol=1e-5, rtol=1e-5)


class _Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.linear(a) * b


def test_one_tensor_given_as_two_inputs_is_not_recorded_as_one_input() -> None:
    """Schedules bind arguments to inputs by identity: a call that passes one tensor for two
    inputs (a caller's shared zeros) must not become the shape's schedule, or every later call
    would read one input for both."""
    model = _Scaled().eval()
    compiled = cuvil.jit(model, (torch.randn(2, 8), torch.randn(2, 8)))
    same = torch.randn(2, 8)
    for _ in range(60):  # past every kernel choice: a settled shape would be recorded
        compiled.run({"a": same, "b": same})
    a, b = torch.randn(2, 8), torch.randn(2, 8)
    for _ in range(3):
        with torch.no_grad():
            torch.testing.assert_close(compiled.run({"a": a, "b": b})["output"], model(a, b))


def test_once_its_schedules_are_full_a_model_records_no_new_shape(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A shape past ``MAX_SCHEDULES`` runs the Python plan without the recording pass (which
    would be built and thrown away on every call)."""
    spec = mlp()
    compiled = cuvil.jit(spec.model, spec.example_inputs, dynamic_shapes=spec.dynamic_shapes)
    compiled.prepare({"x": torch.randn(3, 784)})
    monkeypatch.setattr(native_plan, "MAX_SCHEDULES", 1)
    recordings = []
    recording = native_plan._Recording
    monkeypatch.setattr(
        native_plan, "_Recording", lambda *args: recordings.append(1) or recording(*args)
    )
    x = torch.randn(4, 784)  # 3's row bucket: its choices are made already
    assert compiled.prepare({"x": x}) == 1  # no runs spent trying to record it
    for _ in range(3):
        with torch.inference_mode():
            torch.testing.assert_close(compiled(x), spec.model(x), atol=1e-5, rtol=1e-5)
    assert recordings == []
    assert list(_shapes(compiled)) == [f"batch=3 threads={torch.get_num_threads()}"]


class _NormedHead(torch.nn.Module):
    """LayerNorm then a linear, the normed values rounded to bf16 between them when ``half``
    (as a bf16 plan passes its activations)."""

    def __init__(self, half: bool) -> None:
        super().__init__()
        self.half = half
        self.norm = torch.nn.LayerNorm(64)
        self.head = torch.nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = self.norm(x)
        return self.head(normed.to(torch.bfloat16).float() if self.half else normed)


@pytest.mark.parametrize(
    ("half", "skew", "native"),
    [(True, 1e-3, True), (False, 1e-3, False), (True, 5e-2, False)],
)
def test_schedules_answer_within_the_plans_own_precision(
    monkeypatch: pytest.MonkeyPatch, half: bool, skew: float, native: bool
) -> None:
    """A native form may round other than its Python form. Where values pass between ops in
    bf16, such a difference can tip values to the next bf16 step and is no error; in an fp32
    plan the same difference is refused, and in a bf16 plan so is one past the plan's own
    rounding. (The Python LayerNorm made to answer ``1 + skew`` times its native form.)"""

    def skewed(factory: Any) -> Any:
        def prepared(call: Any) -> Any:
            kernel = factory(call)
            return replace(kernel, run=lambda *a, **k: kernel.run(*a, **k) * (1 + skew))

        return prepared

    monkeypatch.setitem(CPU_KERNELS, fused.LAYER_NORM, skewed(CPU_KERNELS[fused.LAYER_NORM]))
    torch.manual_seed(0)
    compiled = cuvil.jit(_NormedHead(half).eval(), (torch.randn(4, 64),), tolerance=0.1)
    x = torch.randn(4, 64)
    compiled.prepare({"x": x})
    (entry,) = _shapes(compiled).values()
    assert entry["whole_plan_native"] is native, entry
    assert ("refused" in entry) is not native
