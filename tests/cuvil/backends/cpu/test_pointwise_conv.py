"""1x1 convolutions: the GEMM path computes what oneDNN's convolution does, with every epilogue,
and both run under one tactic choice (cuvil/backends/cpu/pointwise_conv.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cuvil.backends.cpu.kernels import conv2d_kernel
from cuvil.backends.cpu.pointwise_conv import gemm_conv, is_pointwise
from cuvil.backends.cpu.tactics import trial_length
from tests.cuvil.backends.cpu.calls import prepare

ACTIVATIONS = {"none": lambda y: y, "relu": torch.relu, "silu": F.silu, "relu6": F.relu6}
SHAPES = [(1, 16, 24, 7), (3, 8, 5, 5), (2, 8, 8, 1)]  # batch, in, out, size (1: ambiguous layout)


def _channels_last(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).contiguous(memory_format=torch.channels_last)


def _expected(x, weight, bias, activation, residual=None):  # type: ignore[no-untyped-def]
    y = F.conv2d(x, weight, bias)
    return ACTIVATIONS[activation](y if residual is None else y + residual)


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape
    error = (actual - expected).abs().max().item()
    assert error <= 1e-5 * max(expected.abs().max().item(), 1.0), error


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_gemm_path_matches_convolution(
    activation: str, residual: bool, with_bias: bool, shape: tuple[int, ...]
) -> None:
    torch.manual_seed(0)
    batch, inputs, outputs, size = shape
    weight = torch.randn(outputs, inputs, 1, 1)
    bias = torch.randn(outputs) if with_bias else None
    x = _channels_last(batch, inputs, size, size)
    extra = (_channels_last(batch, outputs, size, size),) if residual else ()
    y = gemm_conv(weight, bias, activation, residual)(x, *extra)
    _close(y, _expected(x, weight, bias, activation, *extra))
    assert y.is_contiguous(memory_format=torch.channels_last)


def test_plain_layout_inputs_are_accepted() -> None:
    weight, x = torch.randn(6, 4, 1, 1), torch.randn(2, 4, 3, 5)  # contiguous NCHW, not square
    _close(gemm_conv(weight, None, "none", False)(x), F.conv2d(x, weight))


@pytest.mark.parametrize(
    "kernel_size, stride, padding, groups, pointwise",
    [
        (1, 1, 0, 1, True),
        (3, 1, 1, 1, False),
        (1, 2, 0, 1, False),
        (1, 1, 1, 1, False),
        (1, 1, 0, 2, False),
    ],
)
def test_only_stride_one_unpadded_ungrouped_1x1_is_a_gemm(
    kernel_size: int, stride: int, padding: int, groups: int, pointwise: bool
) -> None:
    weight = torch.randn(8, 8 // groups, kernel_size, kernel_size)
    assert is_pointwise(weight, [stride] * 2, [padding] * 2, [1, 1], groups) is pointwise
    assert not is_pointwise(weight.bfloat16(), [1, 1], [0, 0], [1, 1], 1)


@pytest.mark.parametrize("residual", [False, True])
def test_kernel_times_both_paths_and_keeps_matching(residual: bool) -> None:
    torch.manual_seed(1)
    weight, bias = torch.randn(12, 8, 1, 1), torch.randn(12)
    args = {
        "weight": weight,
        "bias": bias,
        "stride": [1, 1],
        "padding": [0, 0],
        "dilation": [1, 1],
        "groups": 1,
        "activation": "relu" if not residual else "none",
    }
    dynamic = ["input", "residual"] if residual else ["input"]
    kernel = prepare(conv2d_kernel, args, dynamic, input_sizes=(1, 8, 6, 6))
    assert kernel.choices is not None
    x = _channels_last(1, 8, 6, 6)
    extra = (_channels_last(1, 12, 6, 6),) if residual else ()
    expected = _expected(x, weight, bias, str(args["activation"]), *extra)
    for _ in range(trial_length(2)):  # every call of the trial, whichever path it takes
        _close(kernel.run(x, *extra), expected)
    assert kernel.choices.describe()[1] in {"onednn", "gemm"}
    _close(kernel.run(x, *extra), expected)


def test_three_by_three_convolution_has_no_tactic() -> None:
    args = {
        "weight": torch.randn(4, 4, 3, 3),
        "bias": None,
        "stride": [1, 1],
        "padding": [1, 1],
        "dilation": [1, 1],
        "groups": 1,
        "activation": "none",
    }
    assert prepare(conv2d_kernel, args, input_sizes=(1, 4, 5, 5)).choices is None
