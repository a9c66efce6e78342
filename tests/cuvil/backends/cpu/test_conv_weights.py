"""Convolution weights are packed per batch class (1, and 2+), lazily, and give the same
answers as a plain convolution at every batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cuvil.backends.cpu.conv_weights import ConvWeight

mkldnn = torch.ops.mkldnn


def _conv(weights: ConvWeight, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    x = x.contiguous(memory_format=torch.channels_last)
    packed = weights.for_batch(x.shape[0])
    return mkldnn._convolution_pointwise(x, packed, bias, [0, 0], [2, 2], [1, 1], 1, "none", [], "")


def test_each_batch_class_is_packed_once_on_first_use() -> None:
    torch.manual_seed(0)
    weight, bias = torch.randn(32, 16, 1, 1), torch.randn(32)
    weights = ConvWeight(weight, [0, 0], [2, 2], [1, 1], 1, (None, 16, 14, 14))
    assert set(weights.packs) == {1} and weights.plain is None  # packed at load, for batch 1
    with torch.inference_mode():
        for batch in (1, 2, 3, 8, 1):
            x = torch.randn(batch, 16, 14, 14)
            expected = F.conv2d(x, weight, bias, stride=2)
            torch.testing.assert_close(_conv(weights, x, bias), expected, atol=1e-4, rtol=1e-4)
    assert set(weights.packs) == {1, 2}
    first = weights.packs[2]
    weights.for_batch(5)
    assert weights.packs[2] is first  # batch 2 and up share one packed copy


def test_a_model_compiled_for_a_fixed_batch_packs_that_class() -> None:
    weights = ConvWeight(torch.randn(8, 4, 3, 3), [1, 1], [1, 1], [1, 1], 1, (4, 4, 9, 9))
    assert set(weights.packs) == {2}


def test_dynamic_spatial_sizes_keep_the_plain_weight() -> None:
    weight = torch.randn(8, 4, 3, 3)
    weights = ConvWeight(weight, [1, 1], [1, 1], [1, 1], 1, (None, 4, None, None))
    plain = weights.for_batch(3)
    assert weights.packs == {} and plain.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(plain, weight)
