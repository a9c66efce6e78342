"""The CUDA plan on a GPU (``gpu`` tests: skipped only where no CUDA device exists): compiled for
this GPU's architecture, verified there against eager fp32, its kernels launched through the
driver, one CUDA graph per shape captured by ``prepare`` and replayed with outputs that are the
caller's own; the caller's device memory read in place; the precisions within budget."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.export import Dim

import cuvil
from cuvil.models import tiny_llama
from cuvil.precisions import PRECISIONS
from tests.cuvil.backends.cuda.models import NormBlock, NormMLP
from tests.cuvil.backends.cuda.nodes import relative_to_scale

pytestmark = pytest.mark.gpu
TOLERANCE = 1e-4


def _target() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"cuda-sm_{major}{minor}"


def test_a_block_runs_on_the_gpu_through_a_cuda_graph(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, x = NormBlock().eval(), torch.randn(2, 5, 48)
    compiled = cuvil.jit(model, (x,), target=_target())
    assert compiled.report["verification"]["method"].startswith("verified on the GPU")
    assert compiled.report["verification"]["max_relative_to_scale"] <= TOLERANCE
    loaded = cuvil.load(compiled.save(tmp_path / "block.cuvil"))
    assert loaded.device.type == "cuda"
    execution = loaded.execution()
    assert execution["executor"].startswith("gpu:") and execution["kernels"]
    with torch.no_grad():
        want = model(x)
    direct = loaded(x)  # a CPU input: copied in, and the output back
    assert direct.device.type == "cpu" and relative_to_scale(direct, want) <= TOLERANCE
    loaded.prepare({"x": x})
    assert len(loaded.execution()["cuda_graphs"]) == 1
    on_gpu = x.cuda()
    first, second = loaded(on_gpu), loaded(on_gpu * 2)  # replays of the captured graph
    assert first.device.type == "cuda" and first.data_ptr() != second.data_ptr()
    assert relative_to_scale(first.cpu(), want) <= TOLERANCE
    with torch.no_grad():
        assert relative_to_scale(second.cpu(), model(x * 2)) <= TOLERANCE


def test_every_batch_size_gets_its_own_graph() -> None:
    torch.manual_seed(1)
    model = NormMLP().eval()
    batch = {"x": {0: Dim("batch", min=1, max=64)}}
    compiled = cuvil.jit(model, (torch.randn(4, 32),), target=_target(), dynamic_shapes=batch)
    for rows in (1, 7, 64):
        x = torch.randn(rows, 32)
        compiled.prepare({"x": x})
        with torch.no_grad():
            assert relative_to_scale(compiled(x.cuda()).cpu(), model(x)) <= TOLERANCE
    assert len(compiled.execution()["cuda_graphs"]) == 3


@pytest.mark.parametrize("precision", ["bf16", "fp16", "tf32"])
def test_low_precisions_stay_within_budget_on_the_gpu(precision: str) -> None:
    torch.manual_seed(2)
    model, x = NormMLP().eval(), torch.randn(8, 32)
    compiled = cuvil.jit(model, (x,), target=_target(), precision=precision)
    error = compiled.report["verification"]["max_relative_to_scale"]
    assert error <= PRECISIONS[precision].budget


def test_the_tiny_llama_matches_eager_on_the_gpu() -> None:
    spec = tiny_llama()
    compiled = cuvil.jit(
        spec.model, spec.example_inputs, dynamic_shapes=spec.dynamic_shapes, target=_target()
    )
    assert compiled.report["verification"]["max_relative_to_scale"] <= TOLERANCE
    ids = torch.randint(0, 2048, (1, 40), generator=torch.Generator().manual_seed(3))
    compiled.prepare({"input_ids": ids})
    with torch.no_grad():
        want = spec.model(input_ids=ids).logits
    got = next(iter(compiled.run({"input_ids": ids.cuda()}).values()))
    assert relative_to_scale(got.cpu(), want) <= TOLERANCE


def test_the_worker_times_the_plan_on_the_gpu_against_eager_there() -> None:
    from cuvil_worker import checks

    torch.manual_seed(3)
    model, x = NormMLP().eval(), torch.randn(8, 32)
    compiled = cuvil.jit(model, (x,), target=_target())
    assert compiled.backend.speed_measured  # a GPU of the target's own architecture
    measured = checks.benchmark(compiled, model, (x,), 10)
    assert measured["compiled_p50_ms"] > 0 and measured["speedup"] > 0
