"""Shape-only values (rotary tables, causal masks, position ids) are computed once per shape."""

from __future__ import annotations

import torch
from torch.export import Dim

import cuvil
from cuvil.runtime import shape_cache
from cuvil.runtime.shape_cache import ShapeCache


class Positions(torch.nn.Module):
    """Adds a table built from arange(seq) — shape-only — and also returns a shape-only tensor."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(x.shape[1], dtype=torch.float32)
        table = torch.sin(positions[:, None] * torch.linspace(0.1, 1.0, x.shape[-1]))
        causal = torch.ones(x.shape[1], x.shape[1]).tril()
        return x + table, causal


def _compiled() -> cuvil.CompiledModel:
    batch, seq = Dim("batch", min=1, max=8), Dim("seq", min=2, max=64)
    shapes = ({0: batch, 1: seq},)
    return cuvil.jit(Positions(), (torch.randn(2, 8, 4),), dynamic_shapes=shapes)


def test_shape_only_steps_run_once_per_shape_and_answers_stay_right() -> None:
    compiled = _compiled()
    plan = compiled.plan
    assert plan.shape_steps and plan.data_steps
    plan.shape_cache = ShapeCache(plan.shape_cache.kept_slots)  # forget the verification calls
    for seq in (8, 16, 8, 16, 32):
        x = torch.randn(3, seq, 4)
        expected, expected_causal = Positions()(x)
        actual, causal = compiled(x)
        torch.testing.assert_close(actual, expected)
        torch.testing.assert_close(causal, expected_causal)
    assert len(plan.shape_cache) == 3  # batch 3 at seq 8, 16 and 32


def test_outputs_are_never_served_from_the_cache() -> None:
    compiled = _compiled()
    _, causal = compiled(torch.randn(1, 8, 4))
    with torch.inference_mode():
        causal.fill_(7.0)  # the caller owns its outputs
    _, again = compiled(torch.randn(1, 8, 4))
    torch.testing.assert_close(again, torch.ones(8, 8).tril())


def test_least_recently_used_shapes_are_dropped(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(shape_cache, "MAX_SHAPES", 2)
    cache = ShapeCache([0])
    for n in (1, 2, 1, 3):
        cache.put(cache.key({"seq": n}), [torch.tensor(n)])
    assert cache.get(cache.key({"seq": 2})) is None
    assert cache.get(cache.key({"seq": 1})) is not None and len(cache) == 2


def test_tiny_llama_builds_its_rotary_tables_and_mask_once() -> None:
    from cuvil.models import tiny_llama

    spec = tiny_llama()
    compiled = cuvil.jit(spec.model, spec.example_inputs, dynamic_shapes=spec.dynamic_shapes)
    shape_ops = {step.name for step in compiled.plan.shape_steps}
    ops = {compiled.graph.node(name).op for name in shape_ops}
    assert {"aten.cos.default", "aten.sin.default", "aten.arange.default"} <= ops
    assert len(compiled.plan.shape_steps) >= 20


class SharedPositions(torch.nn.Module):
    """A shape-only value read by a data step and, later in graph order, by another shape-only
    step (Gemma2's sliding-window mask after CSE merged its position chain with the full one)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], dtype=x.dtype)
        shifted = x + positions  # data step
        doubled = positions * 2  # shape-only, the last reader of positions in graph order
        return shifted + doubled


def test_a_shape_step_does_not_free_what_a_data_step_reads_later() -> None:
    seq = Dim("seq", min=2, max=64)
    compiled = cuvil.jit(SharedPositions(), (torch.randn(2, 8),), dynamic_shapes=({1: seq},))
    for length in (8, 5, 8):
        x = torch.randn(2, length)
        torch.testing.assert_close(compiled(x), SharedPositions()(x))
