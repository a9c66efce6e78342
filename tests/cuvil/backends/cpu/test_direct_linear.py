"""Linears on kept oneDNN inner-product primitives (backends/cpu/direct_linear.py): the "onednn"
path of cuvil.linear where libdnnl is loaded; same answers as F.linear, each weight layout packed
once, and ATen's call past the cache or with the library switched off."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from cuvil.backends.cpu import dnnl as dnnl_module
from cuvil.backends.cpu import kept_primitives, linear_kernels
from cuvil.backends.cpu.linear_kernels import INPLACE_ACTIVATIONS, linear_kernel
from cuvil.backends.cpu.native_calls import KeptCall
from cuvil.backends.cpu.tactics import Tactics
from cuvil.runtime.kernels import FusedCall, PreparedKernel
from tests.cuvil.backends.cpu.calls import kept_of, prepare
from tests.cuvil.backends.cpu.test_linear_kernels import REFERENCE


def _onednn_path(kernel: PreparedKernel) -> Callable[..., torch.Tensor]:
    assert isinstance(kernel.choices, Tactics)
    return dict(kernel.choices.candidates)["onednn"]


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape
    scale = max(float(expected.abs().max()), 1.0)
    assert float((actual - expected).abs().max()) <= 1e-5 * scale


@pytest.mark.parametrize("activation", sorted(INPLACE_ACTIVATIONS))
@pytest.mark.parametrize("with_bias", [True, False])
def test_kept_inner_product_matches_linear(activation: str, with_bias: bool) -> None:
    torch.manual_seed(0)
    weight = torch.randn(40, 24)
    bias = torch.randn(40) if with_bias else None
    kernel = prepare(
        linear_kernel, {"weight": weight, "bias": bias, "activation": activation}, ["input"]
    )
    path = _onednn_path(kernel)
    kept = kept_of(PreparedKernel(path))
    assert kept is not None, "libdnnl.so.3 is a dependency: the kept path must be used"
    for rows in (1, 5, 130, 5):
        x = torch.randn(rows, 24)
        _close(path(x), REFERENCE[activation](F.linear(x, weight, bias)))
    direct = kept
    assert len(direct.primitives) == 3
    # one packed copy per weight layout the primitives ask for (oneDNN may want another for one
    # row than for many: it does with AVX-512), none twice, and no plain copy kept beside them
    copies = direct.packs.copies
    assert 1 <= len(copies) <= len(direct.primitives) and direct.plain is None
    for index, (layout, packed) in enumerate(copies):
        assert packed.dim() == 1
        assert not any(direct.dnnl.same(layout, other) for other, _ in copies[:index])


def test_kept_inner_products_on_one_weight_share_its_packed_copies() -> None:
    torch.manual_seed(5)
    weight, bias = torch.randn(40, 24), torch.randn(40)

    def kept(weight: torch.Tensor, bias: torch.Tensor | None, runtime: list[str]) -> Any:
        activation = "none" if "residual" in runtime else "gelu"
        constants = {"weight": weight, "bias": bias, "activation": activation}
        found = kept_of(PreparedKernel(_onednn_path(prepare(linear_kernel, constants, runtime))))
        assert found is not None
        return found

    first = kept(weight, bias, ["input"])
    second = kept(weight, None, ["input", "residual"])
    other = kept(weight.clone(), bias, ["input"])
    x, residual = torch.randn(7, 24), torch.randn(7, 40)
    _close(first(x), F.gelu(F.linear(x, weight, bias)))
    _close(second(x, residual), F.linear(x, weight) + residual)
    _close(other(x), F.gelu(F.linear(x, weight, bias)))
    assert second.packs is first.packs and other.packs is not first.packs
    assert len(first.packs.copies) == 1  # one layout at 7 rows: packed once, for both
    assert first.plain is None and second.plain is None


def test_kept_inner_product_adds_the_residual_without_writing_it() -> None:
    torch.manual_seed(1)
    weight, bias = torch.randn(16, 32), torch.randn(16)
    kernel = prepare(
        linear_kernel, {"weight": weight, "bias": bias, "activation": "none"}, ["input", "residual"]
    )
    path = _onednn_path(kernel)
    x = torch.randn(32, 9).t()  # [9, 32], not contiguous
    residual = torch.randn(16, 9).t()
    kept = residual.clone()
    _close(path(x, residual), F.linear(x, weight, bias) + residual)
    assert torch.equal(residual, kept)


def test_row_counts_past_the_cache_take_aten(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kept_primitives, "MAX_SHAPES", 1)
    torch.manual_seed(2)
    weight = torch.randn(12, 8)
    kernel = prepare(
        linear_kernel, {"weight": weight, "bias": None, "activation": "relu"}, ["input"]
    )
    path = _onednn_path(kernel)
    for rows in (3, 4, 3):
        x = torch.randn(rows, 8)
        _close(path(x), F.relu(F.linear(x, weight)))
    kept = kept_of(PreparedKernel(path))
    assert kept is not None and len(kept.primitives) == 1


def test_switched_off_the_path_is_atens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUVIL_DNNL", "off")
    dnnl_module.load.cache_clear()
    try:
        weight = torch.randn(6, 4)
        kernel = prepare(
            linear_kernel, {"weight": weight, "bias": None, "activation": "none"}, ["input"]
        )
        path = _onednn_path(kernel)
        assert kept_of(PreparedKernel(path)) is None
        x = torch.randn(3, 4)
        _close(path(x), F.linear(x, weight))
    finally:
        monkeypatch.delenv("CUVIL_DNNL")
        dnnl_module.load.cache_clear()


@pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="no bf16 instructions here"
)
@pytest.mark.parametrize(("activation", "residual"), [("gelu", False), ("none", True)])
def test_a_linear_given_bf16_runs_kept_bf16_primitives_in_and_out(
    activation: str, residual: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # where oneDNN only emulates bf16 (AVX-512 without AVX512-BF16) the kernel widens to fp32
    # instead; the kept bf16 primitives it would take on a bf16 CPU run here all the same
    monkeypatch.setattr(linear_kernels, "has_onednn_bf16", lambda: True)
    torch.manual_seed(0)
    low = torch.bfloat16
    weight, bias = torch.randn(40, 24).to(low), torch.randn(40)
    runtime = ["input", "residual"] if residual else ["input"]
    call = FusedCall(
        "cuvil.linear", "node", {"weight": weight, "bias": bias, "activation": activation},
        tuple(runtime), dtypes=dict.fromkeys(runtime, "bf16"), output_dtype="bf16",
    )  # fmt: skip
    kernel = linear_kernel(call)
    assert kernel.native is not None
    x = torch.randn(2, 7, 24).to(low)
    extra = torch.randn(2, 7, 40).to(low) if residual else None
    got = kernel.run(x, *([extra] if extra is not None else []))
    assert got.dtype == low and got.shape == (2, 7, 40)
    expected = F.linear(x.float(), weight.float(), bias)
    expected = expected + extra.float() if extra is not None else REFERENCE[activation](expected)
    torch.testing.assert_close(got.float(), expected, atol=0.1, rtol=0.02)
    (step,) = kernel.native((x, *([extra] if extra is not None else [])))
    assert isinstance(step, KeptCall) and step.kept.out_dtype == low
