"""The memory plan: buffers alive at the same time never share bytes; the arena beats the naive
sum on deep models; views allocate nothing."""

from __future__ import annotations

import itertools

import torch

import cuvil
from cuvil.analysis.memory import lifetimes, plan_memory
from cuvil.models import resnet18


def _check_no_overlap(plan, spans) -> None:  # type: ignore[no-untyped-def]
    for a, b in itertools.combinations(plan.offsets, 2):
        (fa, la), (fb, lb) = spans[a], spans[b]
        if fa <= lb and fb <= la:  # alive together
            a0, a1 = plan.offsets[a], plan.offsets[a] + plan.sizes[a]
            b0, b1 = plan.offsets[b], plan.offsets[b] + plan.sizes[b]
            assert a1 <= b0 or b1 <= a0, (a, b)


def test_resnet18_arena_is_far_below_the_naive_sum() -> None:
    spec = resnet18()
    compiled = cuvil.jit(spec.model, spec.example_inputs, dynamic_shapes=spec.dynamic_shapes)
    for batch in (1, 8):
        plan = plan_memory(compiled.graph, {"batch": batch})
        _check_no_overlap(plan, lifetimes(compiled.graph))
        assert plan.arena_bytes <= 0.5 * plan.naive_bytes
    summary = compiled.report["memory_plan"]
    assert summary["at"] == {"batch": 2} and summary["arena_vs_naive"] < 0.5


def test_views_allocate_nothing_and_extend_their_source() -> None:
    class Viewer(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.relu(x)
            z = y.view(-1).unsqueeze(0)  # views of y
            return torch.sigmoid(x) + z.view_as(x)

    compiled = cuvil.jit(Viewer(), (torch.randn(4, 4),))
    spans = lifetimes(compiled.graph)
    relu = next(v for v in spans if compiled.graph.node(v.node).op == "aten.relu.default")
    add = next(i for i, n in enumerate(compiled.graph.nodes) if n.op == "aten.add.Tensor")
    assert spans[relu][1] == add  # the views' use at the add keeps relu's buffer alive
    assert all(
        compiled.graph.node(v.node).op not in ("aten.view.default", "aten.unsqueeze.default")
        for v in spans
    )


def test_compiled_model_plans_memory_at_the_call_shape() -> None:
    from cuvil.models import mlp

    spec = mlp()
    compiled = cuvil.jit(spec.model, spec.example_inputs, dynamic_shapes=spec.dynamic_shapes)
    small = compiled.memory_plan({"x": torch.randn(1, 784)})
    large = compiled.memory_plan({"x": torch.randn(64, 784)})
    assert list(small["at"].values()) == [1]
    assert 0 < small["arena_bytes"] <= small["naive_bytes"]
    assert large["arena_bytes"] > 32 * small["arena_bytes"] // 2
