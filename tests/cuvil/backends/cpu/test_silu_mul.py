"""SwiGLU's gating in the native plan loop (``cuvil_native::silu_mul``, native/kernel_ops.cc):
silu(gate) * up in one pass over fp32 rows, the same as ATen's silu and product to rounding,
on every row count, width (vector lanes and the tail past them) and thread count; other inputs
through ATen's ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cuvil.backends.cpu import plan_loop

pytestmark = pytest.mark.skipif(plan_loop.load() is None, reason="needs the plan loop's library")


def _gated(projected: torch.Tensor, hidden: int) -> torch.Tensor:
    return F.silu(projected[..., :hidden]) * projected[..., hidden:]


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    if expected.numel():
        scale = max(float(expected.abs().max()), 1.0)
        assert float((actual - expected).abs().max()) <= 4e-7 * scale


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    ("shape", "hidden"),
    [((16, 1376), 688), ((3, 5, 26), 13), ((1, 16), 8), ((0, 16), 8), ((200, 4096), 2048)],
)
def test_silu_mul_matches_silu_times_up(shape: tuple[int, ...], hidden: int, threads: int) -> None:
    torch.manual_seed(hidden)
    projected = torch.randn(*shape) * 6
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _close(torch.ops.cuvil_native.silu_mul(projected, hidden), _gated(projected, hidden))
    finally:
        torch.set_num_threads(before)


def test_gates_far_from_zero_and_signed_zeros() -> None:
    gate = torch.tensor([100.0, -100.0, 0.0, -0.0, 1e-30, -1e-30, 20.0, -20.0, 88.0, -88.0])
    gate = torch.cat([gate, torch.linspace(-30, 30, 13)])  # 23: two vectors and a tail
    projected = torch.cat([gate, torch.rand(23) + 0.5]).unsqueeze(0)
    _close(torch.ops.cuvil_native.silu_mul(projected, 23), _gated(projected, 23))


def test_strided_and_bf16_inputs_go_through_aten() -> None:
    torch.manual_seed(0)
    strided = torch.randn(32, 9)[:, ::2].t()  # [5, 32]: not contiguous
    _close(torch.ops.cuvil_native.silu_mul(strided, 16), _gated(strided, 16))
    low = torch.randn(4, 20).bfloat16()
    assert torch.equal(torch.ops.cuvil_native.silu_mul(low, 10), _gated(low, 10))
