"""Donated residuals (cuvil/runtime/donation.py): a convolution writes its output over its
residual only when nothing can read that residual afterwards, and the numbers stay eager's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cuvil
from cuvil.backends.cpu.kernels import conv2d_kernel
from cuvil.ir import Graph, Node, Value
from cuvil.runtime.donation import donated_residuals
from tests.cuvil.backends.cpu.calls import prepare
from tests.cuvil.graphs import f32


class Block(nn.Module):
    """stem conv -> two convs -> + the stem's output (a ResNet block); ``leak`` says where else
    the stem's output goes."""

    def __init__(self, leak: str) -> None:
        super().__init__()
        self.leak = leak
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.first = nn.Conv2d(8, 8, 3, padding=1)
        self.second = nn.Conv2d(8, 8, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        source = x.repeat(1, 8, 1, 1) if self.leak == "aten" else self.stem(x)
        y = F.relu(self.second(F.relu(self.first(source))) + source)
        if self.leak == "output":
            return y, source
        if self.leak == "view":
            return y, source.flatten(1).sum(1)
        return (y,)


def _compiled(leak: str) -> tuple[cuvil.CompiledModel, nn.Module]:
    torch.manual_seed(0)
    model = Block(leak).eval()
    channels = 1 if leak == "aten" else 3
    example = (torch.randn(2, channels, 10, 10),)
    batch = torch.export.Dim("batch", min=1, max=4)
    return cuvil.jit(model, example, dynamic_shapes=({0: batch},)), model


@pytest.mark.parametrize(
    "leak, donates",
    [
        ("none", True),  # the stem's output dies at the residual add: written over
        ("output", False),  # it is also a graph output
        ("view", False),  # a non-convolution reads it too
        ("aten", False),  # made by an aten op, not a convolution
    ],
)
def test_only_a_dead_fresh_residual_is_donated(leak: str, donates: bool) -> None:
    compiled, model = _compiled(leak)
    convs_with_residual = [
        node.name
        for node in compiled.graph.nodes
        if node.op == "cuvil.conv2d" and dict(node.args).get("residual") is not None
    ]
    assert len(convs_with_residual) == 1, "the add must have fused into the second convolution"
    assert (donated_residuals(compiled.graph) == set(convs_with_residual)) is donates
    for batch in (1, 3):
        x = torch.randn(batch, 1 if leak == "aten" else 3, 10, 10)
        with torch.inference_mode():
            expected = model(x)
        for _ in range(3):  # the tactic trials of both 1x1 paths included
            actual = compiled(x)
            actual = actual if isinstance(actual, tuple) else (actual,)
            for got, want in zip(actual, expected, strict=True):
                torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kernel_size", [1, 3])
def test_a_donated_residual_holds_the_result(kernel_size: int) -> None:
    torch.manual_seed(1)
    weight, bias = torch.randn(8, 4, kernel_size, kernel_size), torch.randn(8)
    args = {
        "weight": weight,
        "bias": bias,
        "stride": [1, 1],
        "padding": [kernel_size // 2] * 2,
        "dilation": [1, 1],
        "groups": 1,
        "activation": "relu",
    }
    conv = prepare(conv2d_kernel, args, ["input", "residual"], donated=True).run
    for _ in range(12):  # every tactic candidate (1x1: GEMM, 3x3: Winograd) takes its turn
        x = torch.randn(2, 4, 6, 6).contiguous(memory_format=torch.channels_last)
        residual = torch.randn(2, 8, 6, 6).contiguous(memory_format=torch.channels_last)
        expected = F.relu(F.conv2d(x, weight, bias, padding=kernel_size // 2) + residual)
        y = conv(x, residual)
        torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-4)  # Winograd: ~5e-6 of scale
        assert y.data_ptr() == residual.data_ptr()  # written over, no new buffer


def _conv(name: str, source: str, residual: str | None = None) -> Node:
    args: list[tuple[str, object]] = [("input", Value(source)), ("weight", Value("w"))]
    args.append(("residual", Value(residual) if residual else None))
    return Node(name, "cuvil.conv2d", tuple(args), (f32(1, 8, 4, 4),))  # type: ignore[arg-type]


def _graph(*middle: Node, last: str = "add") -> Graph:
    nodes = (
        Node("x", "input", (), (f32(1, 8, 4, 4),)),
        Node("w", "const", (("key", "w"),), (f32(8, 8, 1, 1),)),
        _conv("stem", "x"),
        *middle,
        _conv("add", "stem", residual="stem") if last == "self" else _conv("add", "mid", "stem"),
    )
    return Graph("block", nodes, ("x",), (("out", Value("add")),))


def test_a_view_made_before_the_add_keeps_the_residual() -> None:
    """A view of the residual read after the add aliases it: the add must not write over it,
    even though the add is the residual's last reader by name."""
    view = Node(
        "alias", "aten.view.default", (("self", Value("stem")), ("size", (1, 128))), (f32(1, 128),)
    )
    plain = _graph(_conv("mid", "stem"))
    aliased = _graph(_conv("mid", "stem"), view)
    assert donated_residuals(plain) == {"add"}
    assert donated_residuals(aliased) == frozenset()


def test_a_convolution_adding_its_own_input_keeps_it() -> None:
    assert donated_residuals(_graph(last="self")) == frozenset()
