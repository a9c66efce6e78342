"""bf16 activations between GEMM-like ops: casts only where values enter and leave a bf16 chain
or reach an op that needs fp32, results within the bf16 budget of eager fp32, and a bf16 CNN and
transformer still one native call at a settled shape."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import cuvil
from cuvil.backends.cpu import linear_kernels
from cuvil.precisions import PRECISIONS
from tests.cuvil.backends.cpu.test_whole_native import MODELS, _outputs, _settled_native
from tests.cuvil.passes.rule_cases import ConvBlock

BUDGET = PRECISIONS["bf16"].budget
# a fleet target: its artifact may run on CPUs with bf16 GEMMs, so its values stay bf16
# whatever CPU compiles it (the bare ``cpu`` target asks the compiling CPU)
FLEET = "cpu-x86_64"


def _casts(compiled: cuvil.CompiledModel) -> list[str]:
    nodes = compiled.graph.nodes
    return [str(node.arg("dtype")) for node in nodes if node.op == "aten._to_copy.default"]


def _within_budget(expected: torch.Tensor, got: torch.Tensor) -> None:
    assert got.dtype == torch.float32
    scale = float(expected.abs().max())
    assert float((got - expected).abs().max()) <= BUDGET * scale


class Softmaxed(nn.Module):
    """A linear, a softmax (fp32 only), a linear: each linear reads bf16 and writes fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(32, 48), nn.Linear(48, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.softmax(self.first(x), dim=-1) * 4.0)


def test_a_conv_chain_passes_bf16_with_casts_only_at_its_borders() -> None:
    torch.manual_seed(0)
    model = ConvBlock(torch.relu).eval()
    x = torch.randn(2, 8, 10, 10)
    compiled = cuvil.jit(model, (x,), precision="bf16", target=FLEET)
    assert compiled.report["fusions"]["bf16_activations"] >= 1
    assert _casts(compiled) == ["dtype<bf16>"]  # in once; the last conv writes fp32 itself
    convs = [node for node in compiled.graph.nodes if node.op == "cuvil.conv2d"]
    # the last conv and its residual (the shortcut conv) are fp32: what the graph returns
    assert [node.type.dtype for node in convs] == ["bf16", "f32", "f32"]
    assert compiled.execution()["activations"] == "bf16"
    with torch.no_grad():
        _within_budget(model(x), compiled(x))


def test_an_op_that_needs_fp32_gets_it_from_the_linear_before_it() -> None:
    torch.manual_seed(0)
    model = Softmaxed().eval()
    x = torch.randn(4, 32)
    compiled = cuvil.jit(model, (x,), precision="bf16", target=FLEET)
    (softmax,) = [node for node in compiled.graph.nodes if "softmax" in node.op]
    assert compiled.graph.type_of(softmax.inputs[0]).dtype == "f32"
    assert _casts(compiled) == ["dtype<bf16>", "dtype<bf16>"]  # into each linear; out, fp32
    linears = [node for node in compiled.graph.nodes if node.op == "cuvil.linear"]
    assert [node.type.dtype for node in linears] == ["f32", "f32"]
    with torch.no_grad():
        _within_budget(model(x), compiled(x))


def test_without_the_pass_values_stay_fp32() -> None:
    model = ConvBlock(torch.relu).eval()
    x = torch.randn(2, 8, 10, 10)
    compiled = cuvil.jit(model, (x,), precision="bf16", disable_passes=("low_activations",))
    assert compiled.execution()["activations"] == "fp32"
    assert not any(t.dtype == "bf16" for node in compiled.graph.nodes for t in node.types[:1]
                   if node.op != "const")  # fmt: skip


@pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="oneDNN has no bf16 GEMMs here"
)
@pytest.mark.parametrize("name", ["resnet18_shaped", "minilm_shaped", "tiny_llama_shaped"])
def test_a_bf16_model_keeps_bf16_activations_and_runs_whole_native(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # oneDNN's bf16, as a CPU with bf16 instructions runs it (emulated on AVX-512 without them,
    # where Cuvil computes in fp32 unless CUVIL_BF16_GEMM=onednn)
    monkeypatch.setattr(linear_kernels, "has_onednn_bf16", lambda: True)
    build, inputs_of, dynamic, _ = MODELS[name]
    eager = build()
    compiled = cuvil.jit(eager, inputs_of(2, 0), dynamic_shapes=dynamic, precision="bf16")
    execution = compiled.execution()
    assert (execution["weights"], execution["activations"]) == ("bf16", "bf16")
    for node in compiled.graph.nodes:  # attention in bf16 (its softmax fp32 inside ATen's)
        if node.op == "cuvil.attention":
            assert [compiled.graph.type_of(v).dtype for v in node.inputs[:3]] == ["bf16"] * 3
    _settled_native(compiled, inputs_of(1, 1))
    fresh = inputs_of(1, 2)
    with torch.inference_mode():
        expected, got = _outputs(eager(**fresh)), _outputs(compiled(**fresh))
    assert got
    for want, have in zip(expected, got, strict=False):
        _within_budget(want, have)


@pytest.mark.parametrize("name", ["resnet18_shaped", "minilm_shaped", "tiny_llama_shaped"])
def test_without_bf16_instructions_the_widened_kernels_stay_whole_native(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a CPU without bf16 GEMMs runs, here or on any other: every GEMM-like kernel the pass
    feeds bf16 (convolution, linear, SwiGLU) widens it for its fp32 weight."""
    monkeypatch.setattr(linear_kernels, "has_onednn_bf16", lambda: False)
    build, inputs_of, dynamic, _ = MODELS[name]
    eager = build()
    compiled = cuvil.jit(eager, inputs_of(2, 0), dynamic_shapes=dynamic, precision="bf16",
                         target=FLEET)  # fmt: skip
    assert compiled.report["bisection"] is None
    execution = compiled.execution()
    assert (execution["gemm_compute"], execution["activations"]) == ("fp32", "bf16")
    _settled_native(compiled, inputs_of(1, 1))
    fresh = inputs_of(1, 2)
    with torch.inference_mode():
        expected, got = _outputs(eager(**fresh)), _outputs(compiled(**fresh))
    assert got
    for want, have in zip(expected, got, strict=False):
        _within_budget(want, have)


def test_for_its_own_cpu_without_bf16_gemms_a_bf16_compile_keeps_fp32_activations(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(linear_kernels, "has_onednn_bf16", lambda: False)
    build, inputs_of, dynamic, _ = MODELS["minilm_shaped"]
    eager = build()
    compiled = cuvil.jit(eager, inputs_of(2, 0), dynamic_shapes=dynamic, precision="bf16")
    execution = compiled.execution()
    assert (execution["weights"], execution["activations"]) == ("bf16", "fp32")
    assert "low_activations" not in [entry["name"] for entry in compiled.report["passes"]]
    assert "dtype<bf16>" not in _casts(compiled)  # no value converted for the fp32 GEMMs
    fresh = inputs_of(1, 2)
    with torch.inference_mode():
        expected, got = _outputs(eager(**fresh)), _outputs(compiled(**fresh))
    for want, have in zip(expected, got, strict=True):
        _within_budget(want, have)


class Joined(nn.Module):
    """Two linears joined by a concat (a list operand: read in fp32), then a linear."""

    def __init__(self) -> None:
        super().__init__()
        self.left, self.right, self.last = nn.Linear(16, 24), nn.Linear(16, 8), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.last(torch.cat([self.left(x), self.right(y)], dim=-1))


def test_values_read_in_a_list_stay_fp32() -> None:
    torch.manual_seed(0)
    model = Joined().eval()
    x, y = torch.randn(4, 16), torch.randn(4, 16)
    compiled = cuvil.jit(model, (x, y), precision="bf16", target=FLEET)
    (cat,) = [node for node in compiled.graph.nodes if node.op == "aten.cat.default"]
    assert {compiled.graph.type_of(v).dtype for v in cat.inputs} == {"f32"}
    with torch.no_grad():
        _within_budget(model(x, y), compiled(x, y))
