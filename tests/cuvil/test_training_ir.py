"""The training IR, rewritten locally, gives the same Cuvil IR as ``run_decompositions({})``;
graphs the rewrites cannot prove safe take the retrace; compiled models still match eager."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.export import Dim

import cuvil
from cuvil.frontend.convert import convert_exported_program
from cuvil.frontend.training_ir import as_inference_ir
from cuvil.ir import Graph, Value


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.reduce = nn.Conv2d(channels, channels // 4, 1)
        self.expand = nn.Conv2d(channels // 4, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = x.mean((2, 3), keepdim=True)
        scale = torch.sigmoid(self.expand(torch.relu(self.reduce(scale))))
        return x * scale


class MobileBlockNet(nn.Module):
    """In-place activations, ReLU6, hardswish, squeeze-excite, a residual ``+=``, dropout and
    flatten: the CNN ops the direct route rewrites or keeps."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 16, 3, 2, 1), nn.BatchNorm2d(16), nn.ReLU6(inplace=True)
        )
        self.block = nn.Sequential(
            nn.Conv2d(16, 16, 3, 1, 1, groups=16),
            nn.BatchNorm2d(16),
            nn.Hardswish(inplace=True),
            SqueezeExcite(16),
            nn.Conv2d(16, 16, 1),
            nn.BatchNorm2d(16),
        )
        self.head = nn.Sequential(
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(16, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        y = self.block(x)
        y += x
        return self.head(torch.relu_(y))


class OverwritesAView(nn.Module):
    """``relu_`` overwrites a value whose view, taken before, is read after: the view sees the
    overwrite, so the op cannot simply become functional."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        head = y[:, :2]
        y.relu_()
        return head * 2 + y[:, 2:]


def _small_hf_resnet() -> nn.Module:
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    config = ResNetConfig(
        embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="bottleneck"
    )
    return ResNetForImageClassification(config).eval()


def _export(model: nn.Module, example: torch.Tensor) -> torch.export.ExportedProgram:
    batch = Dim("batch", min=1, max=16)
    with torch.no_grad():
        return torch.export.export(model.eval(), (example,), dynamic_shapes=({0: batch},))


def _canonical(graph: Graph) -> list[tuple[Any, ...]]:
    """The graph with node names replaced by positions: equal for the same computation."""
    position = {node.name: index for index, node in enumerate(graph.nodes)}

    def canon(arg: Any) -> Any:
        if isinstance(arg, Value):
            return ("value", position[arg.node], arg.index)
        if isinstance(arg, tuple):
            return tuple(canon(item) for item in arg)
        return arg

    return [
        (node.op, tuple((key, canon(arg)) for key, arg in node.args), node.types)
        for node in graph.nodes
    ]


def _both_routes(model: nn.Module, example: torch.Tensor) -> tuple[Graph, Graph, bool]:
    decomposed = _export(model, example).run_decompositions({})
    direct = _export(model, example)
    rewritten = as_inference_ir(direct)
    names = {("x", 0): "batch"}
    a = convert_exported_program(decomposed, "m", names).graph
    b = convert_exported_program(direct, "m", names).graph
    return a, b, rewritten


@pytest.mark.parametrize(
    "build", [MobileBlockNet, _small_hf_resnet], ids=["mobile-block", "hf-resnet"]
)
def test_direct_route_gives_the_decomposed_ir(build: Any) -> None:
    decomposed, direct, rewritten = _both_routes(build(), torch.randn(2, 3, 32, 32))
    assert rewritten
    ops = [node.op for node in direct.nodes]
    assert "aten._native_batch_norm_legit_no_training.default" in ops
    assert not any(op.endswith("_.Tensor") or op.endswith("_.default") for op in ops)
    assert _canonical(direct) == _canonical(decomposed)


def test_unsafe_in_place_op_takes_the_retrace() -> None:
    program = _export(OverwritesAView(), torch.randn(2, 3, 8, 8))
    before = [str(node.target) for node in program.graph.nodes]
    assert not as_inference_ir(program)
    assert [str(node.target) for node in program.graph.nodes] == before  # left untouched


@pytest.mark.parametrize("build", [MobileBlockNet, OverwritesAView])
def test_compiled_models_match_eager_on_either_route(build: Any) -> None:
    torch.manual_seed(1)
    model = build().eval()
    example = torch.randn(2, 3, 32, 32)
    compiled = cuvil.jit(model, (example,), dynamic_shapes=({0: Dim("batch", max=16)},))
    direct = any("converted directly" in note for note in compiled.report["notes"])
    assert direct == (build is MobileBlockNet)
    for batch in (1, 3, 16):
        x = torch.randn(batch, 3, 32, 32)
        with torch.no_grad():
            expected = model(x)
        (actual,) = compiled(x) if isinstance(compiled(x), tuple) else (compiled(x),)
        scale = max(float(expected.abs().max()), 1.0)
        assert float((actual - expected).abs().max()) <= 1e-4 * scale
