"""The worker's benchmark times a compiled model as it serves: prepared at the example's shape
first, so kernel choices not made at compile time are not timed as the model's speed."""

from __future__ import annotations

import torch
from cuvil_worker import checks

import cuvil


def test_benchmark_prepares_the_model_before_timing_it() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 8)
    ).eval()
    example = torch.randn(4, 64)
    compiled = cuvil.jit(model, (example,), choose_kernels=False)
    assert compiled.plan.kernel_trials()  # choices open: their trials run on the first calls
    result = checks.benchmark(compiled, model, (example,), iterations=1)
    assert result["iterations"] == 1 and result["compiled_p50_ms"] > 0
    assert compiled.plan.kernel_trials() == {}  # every choice at this shape made before timing
    name = compiled.signature.input_names[0]
    assert compiled.prepare({name: example}) == 1  # and none is left at this shape
