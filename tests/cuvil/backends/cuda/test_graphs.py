"""CUDA graphs per shape, their bookkeeping checked on the CPU with a stand-in graph whose replay
runs the plan into the captured outputs (as a replay writes into the captured memory): a shape
is captured on its second call or by ``capture``, replays copy the caller's inputs in and hand
back outputs of their own, the latest shapes keep their graphs, and a shape whose capture fails
runs the plan directly from then on."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.export import Dim

import cuvil
from cuvil.backends.cuda import graphs
from cuvil.backends.cuda.graphs import GraphedPlan
from tests.cuvil.backends.cuda.models import NormMLP
from tests.cuvil.backends.cuda.nodes import relative_to_scale


class StandInGraph:
    def __init__(self, run: Callable[[], dict[str, Any]], outputs: dict[str, Any]) -> None:
        self.run, self.outputs, self.replays = run, outputs, 0

    def replay(self) -> None:
        self.replays += 1
        with torch.inference_mode():  # as CompiledModel.run calls it
            for name, value in self.run().items():
                self.outputs[name].copy_(value)


def stand_in_capture(
    device: torch.device, run: Callable[[], dict[str, Any]]
) -> tuple[StandInGraph, dict[str, Any]]:
    outputs = run()
    return StandInGraph(run, outputs), outputs


@pytest.fixture(scope="module")
def model_and_plan() -> tuple[torch.nn.Module, Any]:
    torch.manual_seed(0)
    model = NormMLP().eval()
    batch = {"x": {0: Dim("batch", min=1, max=64)}}
    compiled = cuvil.jit(model, (torch.randn(4, 32),), target="cuda-sm_90", dynamic_shapes=batch)
    return model, compiled


def test_a_shape_is_captured_on_its_second_call_and_replayed_after(
    model_and_plan: tuple[torch.nn.Module, Any],
) -> None:
    model, compiled = model_and_plan
    graphed = GraphedPlan(compiled.plan, capture=stand_in_capture)
    x, y = torch.randn(5, 32), torch.randn(5, 32)
    symbols = compiled.bind({"x": x})
    first = graphed.run({"x": x}, symbols)  # the plan itself
    assert graphed.shapes == []
    second = graphed.run({"x": y}, symbols)  # captured, then replayed
    third = graphed.run({"x": x}, symbols)
    (key,) = graphed.shapes
    captured = graphed._graphs[key]
    assert captured.graph.replays == 2  # type: ignore[attr-defined]
    out_first, out_second, out_third = (next(iter(o.values())) for o in (first, second, third))
    assert out_third.data_ptr() != captured.outputs[next(iter(captured.outputs))].data_ptr()
    with torch.no_grad():
        assert relative_to_scale(out_second, model(y)) <= 1e-4  # not the captured call's values
        assert relative_to_scale(out_third, model(x)) <= 1e-4
    torch.testing.assert_close(out_first, out_third)
    assert captured.held is not None or not compiled.plan.shape_steps


def test_the_latest_shapes_keep_their_graphs(
    model_and_plan: tuple[torch.nn.Module, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, compiled = model_and_plan
    monkeypatch.setattr(graphs, "CAPACITY", 2)
    graphed = GraphedPlan(compiled.plan, capture=stand_in_capture)
    for rows in (1, 2, 3):
        x = torch.randn(rows, 32)
        graphed.capture({"x": x}, compiled.bind({"x": x}))
    assert [key[0][1] for key in graphed.shapes] == [(2, 32), (3, 32)]


def test_a_shape_that_cannot_be_captured_runs_the_plan(
    model_and_plan: tuple[torch.nn.Module, Any],
) -> None:
    model, compiled = model_and_plan

    def failing(device: torch.device, run: Callable[[], dict[str, Any]]) -> Any:
        raise RuntimeError("operation not permitted when stream is capturing")

    graphed = GraphedPlan(compiled.plan, capture=failing)
    x = torch.randn(3, 32)
    for _ in range(3):
        out = next(iter(graphed.run({"x": x}, compiled.bind({"x": x})).values()))
    assert graphed.shapes == [] and "not permitted" in next(iter(graphed.uncaptured.values()))
    with torch.no_grad():
        assert relative_to_scale(out, model(x)) <= 1e-4
