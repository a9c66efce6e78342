"""The native schedules' CPython callers: one builtin function per schedule answers as the
schedule's TorchScript method does, keeps its schedule alive, raises c10's errors as their
Python kinds; switched off or without Python's headers, the method runs and ``reason`` says why."""

from __future__ import annotations

import gc
import sysconfig
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import cuvil
from cuvil.backends.cpu import fast_call, plan_loop
from cuvil.models import mlp
from cuvil.runtime.model import CompiledModel


@pytest.fixture(scope="module")
def settled_mlp() -> CompiledModel:
    spec = mlp()
    compiled = cuvil.jit(spec.model, spec.example_inputs, dynamic_shapes=spec.dynamic_shapes)
    compiled.prepare({"x": torch.randn(4, 784)})
    return compiled


@pytest.fixture
def fresh_library(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """The library looked up again under the test's environment, and again after it."""
    fast_call._library.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    fast_call._library.cache_clear()


def _relu_schedule() -> object:
    """A one-step schedule by hand: slot 1 = relu(slot 0)."""
    assert plan_loop.load()
    schedule = torch.classes.cuvil_native.Schedule(2, [0], [1])
    schedule.op("aten::relu", "")
    schedule.arg_slot(0)
    schedule.outputs([1])
    return schedule


def test_a_settled_shape_runs_through_one_cpython_call(settled_mlp: CompiledModel) -> None:
    assert settled_mlp.execution()["plan_loop"]["calls"] == "one CPython call each"
    (shape,) = (run for run in settled_mlp.runner._shapes.values() if run.whole is not None)
    whole = shape.whole
    assert isinstance(whole.call, types.BuiltinFunctionType)
    x = torch.randn(4, 784)
    fast, method = whole.call([x]), whole.schedule.run([x])
    assert len(fast) == len(method) == 1
    torch.testing.assert_close(fast[0], method[0], atol=0, rtol=0)
    with torch.inference_mode():
        torch.testing.assert_close(fast[0], mlp().model(x), atol=1e-5, rtol=1e-5)
    assert whole.call((x,))[0].shape == (4, 10)  # any sequence of tensors


def test_a_caller_keeps_its_schedule_alive() -> None:
    schedule = _relu_schedule()
    call = fast_call.caller(schedule)
    del schedule
    gc.collect()
    x = torch.randn(3, 5)
    (y,) = call([x])
    torch.testing.assert_close(y, x.relu(), atol=0, rtol=0)


def test_errors_reach_python_as_their_kinds() -> None:
    assert plan_loop.load()
    schedule = torch.classes.cuvil_native.Schedule(2, [0], [1])
    schedule.op("aten::select", "int")
    schedule.arg_slot(0)
    schedule.arg(0)
    schedule.arg(5)
    schedule.outputs([1])
    call = fast_call.caller(schedule)
    with pytest.raises(IndexError, match="index 5 out of range"):
        call([torch.randn(2, 3)])
    with pytest.raises(RuntimeError, match="expected 1 inputs, got 2"):
        call([torch.randn(9, 3), torch.randn(9, 3)])
    with pytest.raises(TypeError, match="input 0 is not a tensor"):
        call([3.0])
    with pytest.raises(TypeError, match="one sequence of tensors"):
        call(torch.randn(9, 3), torch.randn(9, 3))
    assert call([torch.randn(9, 3)])[0].shape == (3,)  # and it still runs


def test_switched_off_the_method_runs_and_says_why(fresh_library: pytest.MonkeyPatch) -> None:
    fresh_library.setenv("CUVIL_FAST_CALL", "off")
    schedule = _relu_schedule()
    call = fast_call.caller(schedule)
    assert not isinstance(call, types.BuiltinFunctionType)
    assert fast_call.reason() == "switched off (CUVIL_FAST_CALL=off)"
    x = torch.randn(4)
    torch.testing.assert_close(call([x])[0], x.relu(), atol=0, rtol=0)


def test_without_python_headers_the_method_runs_and_says_why(
    fresh_library: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    paths = {**sysconfig.get_paths(), "include": str(tmp_path / "include")}
    fresh_library.setattr(sysconfig, "get_paths", lambda: paths)
    fresh_library.setenv("CUVIL_NATIVE_CACHE", str(tmp_path))  # nothing built there
    call = fast_call.caller(_relu_schedule())
    assert not isinstance(call, types.BuiltinFunctionType)
    assert fast_call.reason() == f"no Python.h in {tmp_path / 'include'} (install python3-dev)"
