"""MKL's packed GEMM path of fp32 linears (backends/cpu/packed_gemm.py): the same results as
``F.linear``, at every row count and row class, without writing to what it is given."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cuvil.backends.cpu import packed_gemm
from cuvil.backends.cpu.linear_kernels import linear_kernel
from cuvil.backends.cpu.packed_gemm import PackedLinear, packed_linear, row_class
from cuvil.backends.cpu.weight_copies import copies_held
from tests.cuvil.backends.cpu.calls import prepare

pytestmark = pytest.mark.skipif(
    not torch.backends.mkl.is_available(), reason="torch built without MKL"
)

ACTIVATIONS = {"none": lambda y: y, "gelu": F.gelu, "relu": F.relu, "silu": F.silu}


def _packed(weight: torch.Tensor, bias: torch.Tensor | None, activation: str) -> PackedLinear:
    found = packed_linear(weight, bias, activation)
    assert found is not None, "MKL's packing functions were not found in libtorch_cpu"
    return found


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape
    if expected.numel():
        scale = max(float(expected.abs().max()), 1.0)
        assert float((actual - expected).abs().max()) <= 1e-5 * scale


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_packed_linear_matches_linear_at_every_row_count(activation: str) -> None:
    torch.manual_seed(0)
    weight, bias = torch.randn(300, 129), torch.randn(300)
    kept_bias = bias.clone()
    path = _packed(weight, bias, activation)
    with torch.inference_mode():
        for rows in (0, 1, 2, 17, 130, 600):  # 600: the other row class
            x = torch.randn(rows, 129)
            _close(path(x), ACTIVATIONS[activation](F.linear(x, weight, bias)))
            strided = torch.randn(rows, 200)[:, :129]  # rows with a longer stride
            _close(path(strided), ACTIVATIONS[activation](F.linear(strided, weight, bias)))
        one_row = torch.randn(129).as_strided((1, 129), (1, 1))  # a row stride below its width
        _close(path(one_row), ACTIVATIONS[activation](F.linear(one_row, weight, bias)))
    # one row broadcasts the bias to a [1, N] view that is itself contiguous: the GEMM must
    # accumulate into a copy, never into the bias
    assert torch.equal(bias, kept_bias)


@pytest.mark.parametrize("with_bias", [True, False])
def test_packed_residual_is_accumulated_into_a_fresh_buffer(with_bias: bool) -> None:
    torch.manual_seed(1)
    weight = torch.randn(48, 40)
    bias = torch.randn(48) if with_bias else None
    path = _packed(weight, bias, "none")
    with torch.inference_mode():
        for rows in (1, 9, 700):
            x, residual = torch.randn(rows, 40), torch.randn(rows, 48)
            kept = residual.clone()
            _close(path(x, residual), F.linear(x, weight, bias) + residual)
            assert torch.equal(residual, kept)


def test_each_row_class_is_packed_once_on_its_first_call() -> None:
    torch.manual_seed(2)
    weight = torch.randn(64, 32)
    path = _packed(weight, None, "none")
    assert copies_held(weight) == 0
    with torch.inference_mode():
        for rows in (3, 100, 511):
            path(torch.randn(rows, 32))
        assert copies_held(weight) == 1
        path(torch.randn(512, 32))
        path(torch.randn(2000, 32))
    assert copies_held(weight) == 2
    assert row_class(3) != row_class(512)


def test_kernels_on_one_weight_share_its_packed_copies_until_it_changes() -> None:
    torch.manual_seed(4)
    weight, bias = torch.randn(48, 40), torch.randn(48)
    first, second = _packed(weight, bias, "none"), _packed(weight, None, "relu")
    x = torch.randn(6, 40)
    with torch.inference_mode():
        _close(first(x), F.linear(x, weight, bias))
        assert second.packed(6) is first.packed(6)
        _close(second(x), F.relu(F.linear(x, weight)))
        assert copies_held(weight) == 1
    with torch.no_grad():
        weight.mul_(-2.0)  # a kernel made after a change packs afresh, not from the old copy
    third = _packed(weight, None, "relu")
    with torch.inference_mode():
        _close(third(x), F.relu(F.linear(x, weight)))
        assert third.packed(6) is not first.packed(6)
    assert copies_held(weight) == 2


def test_the_linear_kernels_mkl_path_is_the_packed_one_unless_switched_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(3)
    weight, bias = torch.randn(24, 16), torch.randn(24)
    x = torch.randn(5, 16)
    expected = F.gelu(F.linear(x, weight, bias))
    for setting, packed in (("on", True), ("off", False)):
        monkeypatch.setenv("CUVIL_MKL_PACKED", setting)
        packed_gemm.functions.cache_clear()
        kernel = prepare(linear_kernel, {"weight": weight, "bias": bias, "activation": "gelu"})
        mkl = dict(kernel.choices.candidates)["mkl"]
        assert isinstance(mkl, PackedLinear) is packed
        with torch.inference_mode():
            _close(mkl(x), expected)
    packed_gemm.functions.cache_clear()


def test_an_inference_tensor_weight_is_shared_too() -> None:
    torch.manual_seed(5)
    with torch.inference_mode():  # keeps no version counter
        weight = torch.randn(24, 16)
        first, second = _packed(weight, None, "none"), _packed(weight, None, "none")
        x = torch.randn(3, 16)
        _close(second(x), F.linear(x, weight))
        assert first.packed(3) is second.packed(3) and copies_held(weight) == 1
