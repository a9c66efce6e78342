"""The memory plan: buffers alive at the same time never share bytes; the arena beats the naive
sum on deep models; views allocate nothing."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cuvil
from cuvil.analysis.memory import (
    PLANNERS,
    MemoryBudgetError,
    MemoryPlan,
    lifetimes,
    place,
    plan_memory,
)
from cuvil.ir import Value
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


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 40), st.integers(0, 12), st.integers(1, 64).map(lambda n: n * 64)),
        min_size=1,
        max_size=40,
    ),
    st.sampled_from(PLANNERS),
)
def test_no_two_live_buffers_overlap_in_any_plan(
    buffers: list[tuple[int, int, int]], planner: str
) -> None:
    spans = {
        Value(f"v{i}"): (first, first + length) for i, (first, length, _) in enumerate(buffers)
    }
    sizes = {Value(f"v{i}"): size for i, (_, _, size) in enumerate(buffers)}
    offsets = place(spans, sizes, planner)
    plan = MemoryPlan({}, offsets, sizes, max(offsets[v] + sizes[v] for v in offsets), 0)
    _check_no_overlap(plan, spans)
    live_peak = max(
        sum(sizes[v] for v, (first, last) in spans.items() if first <= step <= last)
        for step in range(0, 53)
    )
    assert live_peak <= plan.arena_bytes <= sum(sizes.values())


def test_a_plan_over_budget_fails_at_compile_time_with_the_numbers() -> None:
    from cuvil.models import mlp

    spec = mlp()
    # batch up to 64: 64 x (512 + 256 + 10) floats, about 200 KB of activations
    with pytest.raises(MemoryBudgetError, match=r"needs \d+ bytes .* at batch=64 .* of 100000"):
        cuvil.jit(
            spec.model,
            spec.example_inputs,
            dynamic_shapes=spec.dynamic_shapes,
            memory=cuvil.MemoryPolicy(budget_bytes=100_000),
        )
    fits = cuvil.jit(
        spec.model,
        spec.example_inputs,
        dynamic_shapes=spec.dynamic_shapes,
        memory=cuvil.MemoryPolicy(planner="naive", budget_bytes=10_000_000),
    )
    summary = fits.report["memory_plan"]
    assert summary["arena_bytes"] == summary["naive_bytes"]
    assert fits.config["memory_policy"]["planner"] == "naive"


def test_without_in_place_no_convolution_writes_over_its_residual() -> None:
    spec = resnet18()
    x = torch.randn(1, 3, 224, 224)
    kept = cuvil.jit(
        spec.model,
        spec.example_inputs,
        dynamic_shapes=spec.dynamic_shapes,
        memory=cuvil.MemoryPolicy(in_place=False),
    )
    assert kept.memory_policy.in_place is False
    assert kept.plan.donated == frozenset()
    donating = cuvil.jit(spec.model, spec.example_inputs, dynamic_shapes=spec.dynamic_shapes)
    assert donating.plan.donated  # the same model donates its residuals by default
    with torch.inference_mode():
        expected = spec.model(pixel_values=x).logits
    torch.testing.assert_close(
        kept.run({"pixel_values": x})["logits"], expected, atol=1e-3, rtol=1e-3
    )


def test_measured_peak_activation_memory_stays_within_the_plan() -> None:
    spec = resnet18()
    compiled = cuvil.jit(spec.model, spec.example_inputs, dynamic_shapes=spec.dynamic_shapes)
    inputs = {"pixel_values": torch.randn(1, 3, 224, 224)}
    compiled.prepare(inputs)
    report = compiled.measure_memory(inputs)
    assert 0 < report["measured_bytes"] <= 1.1 * report["arena_bytes"], report
