"""bf16: GEMM-like ops get bf16 weights, normalisations stay fp32, results stay within the
stated error budget (3e-2 of the output scale), and the artifact keeps the bf16 weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import cuvil
from cuvil.backends.cpu.linear_kernels import has_onednn_bf16
from cuvil.models import mlp, tiny_llama
from cuvil.precisions import PRECISIONS
from cuvil.runtime.model import CompiledModel
from tests.cuvil.passes.rule_cases import ConvBlock


@pytest.mark.parametrize("factory", [mlp, tiny_llama], ids=["mlp", "tiny_llama"])
def test_bf16_stays_within_budget_and_halves_gemm_weights(factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    spec = factory()
    fp32 = cuvil.jit(spec.model, spec.example_inputs, dynamic_shapes=spec.dynamic_shapes)
    bf16 = cuvil.jit(
        spec.model, spec.example_inputs, dynamic_shapes=spec.dynamic_shapes, precision="bf16"
    )
    report = bf16.report
    assert report["fusions"]["bf16_weights"] >= 3
    assert report["bisection"] is None
    assert 0 < report["verification"]["max_relative_to_scale"] <= PRECISIONS["bf16"].budget
    assert report["weights_bytes"] < 0.75 * fp32.report["weights_bytes"]
    dtypes = {tensor.dtype for tensor in bf16.contents.weights.values()}
    assert torch.bfloat16 in dtypes
    for node in bf16.graph.nodes:  # norms keep fp32 weights
        if node.op == "cuvil.rms_norm":
            weight = node.arg("weight")
            assert (
                bf16.contents.weights[str(bf16.graph.node(weight.node).arg("key"))].dtype
                == torch.float32
            )
    execution = bf16.execution()
    assert execution["weights"] == "bf16"
    assert execution["gemm_compute"] == ("bf16" if has_onednn_bf16() else "fp32")
    assert fp32.execution()["gemm_compute"] == "fp32"
    loaded = cuvil.load(bf16.save(tmp_path / "m.cuvil"))
    assert_loaded_runs_alike(bf16, loaded, golden_inputs(bf16))


def golden_inputs(compiled: CompiledModel) -> dict[str, torch.Tensor]:
    """The example inputs the artifact keeps with its golden outputs, by input name."""
    return {
        k.removeprefix("input."): v
        for k, v in compiled.contents.golden.items()
        if k.startswith("input.")
    }


def assert_loaded_runs_alike(
    compiled: CompiledModel, loaded: CompiledModel, inputs: dict[str, torch.Tensor]
) -> None:
    """The saved-and-loaded model gives the compiled one's outputs on ``inputs``, with the same
    kernels both sides: on a CPU without bf16 GEMMs an fp32 path's last-bit differences from
    another path move some bf16 roundings downstream by an ulp."""
    compiled.prepare(inputs)
    loaded.preset_tactics(compiled.execution()["tactics"])
    for name, value in loaded.run(inputs).items():
        torch.testing.assert_close(value, compiled.run(inputs)[name])


def test_bf16_convolutions_match_within_budget() -> None:
    model = ConvBlock(torch.relu).eval()
    x = torch.randn(2, 8, 10, 10)
    compiled = cuvil.jit(model, (x,), precision="bf16")
    assert compiled.report["fusions"]["bf16_weights"] == 3
    with torch.no_grad():
        expected = model(x)
    error = (compiled(x) - expected).abs().max() / expected.abs().max()
    assert error <= PRECISIONS["bf16"].budget


def test_unknown_precision_is_refused() -> None:
    with pytest.raises(ValueError, match="precision 'int3'"):
        cuvil.jit(torch.nn.Linear(2, 2), (torch.randn(2, 2),), precision="int3")


def test_bf16_with_nothing_to_convert_says_it_runs_fp32() -> None:
    class Elementwise(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(x) * 2

    compiled = cuvil.jit(Elementwise(), (torch.randn(2, 3),), precision="bf16")
    assert any("runs in fp32" in note for note in compiled.report["notes"])
    converted = cuvil.jit(torch.nn.Linear(3, 3).eval(), (torch.randn(2, 3),), precision="bf16")
    assert not any("runs in fp32" in note for note in converted.report["notes"])
