"""The layout pass keeps channels-last through padding and through ConvNeXt's permute pair:
no conversion at either, and the compiled model still matches eager."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cuvil

batch = cuvil.Dim("batch", min=1, max=8)


class PaddedConvs(nn.Module):
    """MobileNet-style explicit padding between convolutions (TF "same" padding)."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.first = nn.Conv2d(3, 8, 3)
        self.second = nn.Conv2d(8, 8, 3, stride=2, groups=8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.first(x))
        y = F.pad(y, (0, 1, 0, 1), mode=self.mode)
        return self.second(y).flatten(1)


class PermutedNorm(nn.Module):
    """ConvNeXt's block: a LayerNorm over channels between permutes to NHWC and back."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.norm = nn.LayerNorm(16)
        self.project = nn.Conv2d(16, 16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x).permute(0, 2, 3, 1)
        y = self.norm(y).permute(0, 3, 1, 2)
        return (self.project(y) + y).mean(dim=(2, 3))


def _borders(model: nn.Module) -> tuple[cuvil.CompiledModel, int]:
    compiled = cuvil.jit(
        model.eval(), torch.randn(2, 3, 12, 12), dynamic_shapes=({0: batch},), name="layout"
    )
    return compiled, int(compiled.report["fusions"].get("layout_borders", 0))


def _matches_eager(model: nn.Module, compiled: cuvil.CompiledModel) -> None:
    for n in (1, 3):
        x = torch.randn(n, 3, 12, 12)
        with torch.no_grad():
            expected = model(x)
        error = (compiled(x) - expected).abs().max().item()
        assert error <= 1e-5 * max(expected.abs().max().item(), 1.0), (n, error)


@pytest.mark.parametrize("mode", ["constant", "reflect", "replicate"])
def test_padding_between_convolutions_is_no_border(mode: str) -> None:
    model = PaddedConvs(mode)
    compiled, borders = _borders(model)
    assert borders == 2, borders  # into the chain before the first conv, out before flatten
    _matches_eager(model, compiled)


def test_circular_padding_leaves_the_chain_and_still_matches() -> None:
    model = PaddedConvs("circular")
    compiled, borders = _borders(model)
    assert borders > 2, borders  # out of channels-last before the pad, back in after it
    _matches_eager(model, compiled)


def test_permute_pair_around_layer_norm_is_no_border() -> None:
    model = PermutedNorm()
    compiled, borders = _borders(model)
    assert borders == 1, borders  # only the input; mean(dim=(2, 3)) reads channels-last as is
    _matches_eager(model, compiled)
