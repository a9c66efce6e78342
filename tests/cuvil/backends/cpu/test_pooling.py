"""Max pooling on the CPU backend (backends/cpu/pooling.py, native/pooling.c) gives what
``aten.max_pool2d`` gives, bit for bit, for channels-last fp32 maps of every geometry, NaNs and
-inf included; other layouts and options go to ATen; a compiled CNN runs the C kernel and
matches eager."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import cuvil
from cuvil.backends.cpu import native, plan_loop
from cuvil.backends.cpu.pooling import max_pool2d_kernel
from cuvil.runtime.kernels import FusedCall, PreparedKernel

aten = torch.ops.aten


def _kernel(**constants: object) -> PreparedKernel:
    call = FusedCall("aten.max_pool2d.default", "pool", constants, ("self",))
    return max_pool2d_kernel(call)


def _channels_last(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).contiguous(memory_format=torch.channels_last)


# batch, channels, height, width, kernel, stride, padding
GEOMETRIES = [
    (1, 64, 112, 112, [3, 3], [2, 2], [1, 1]),  # ResNet's stem pooling
    (2, 3, 17, 13, [3, 3], [2, 2], [1, 1]),  # few channels, odd sizes
    (1, 70, 9, 11, [2, 2], [], [0, 0]),  # stride defaults to the kernel
    (3, 16, 8, 8, [3, 2], [1, 2], [1, 0]),  # unequal kernel, stride and padding per dim
    (1, 33, 7, 7, [7], [1], [3]),  # one value for both dims, wide padding
]


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_aten_bit_for_bit(geometry: tuple, threads: int, dtype: torch.dtype) -> None:
    assert native.load("pooling") is not None, native.reason("pooling")
    batch, channels, height, width, kernel, stride, padding = geometry
    x = _channels_last(batch, channels, height, width).to(dtype)
    want = aten.max_pool2d.default(x, kernel, stride, padding)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = _kernel(kernel_size=kernel, stride=stride, padding=padding).run(x)
    finally:
        torch.set_num_threads(before)
    assert got.shape == want.shape
    assert got.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_wins_and_padding_never_does(dtype: torch.dtype) -> None:
    x = -torch.rand(1, 16, 6, 6).add(1.0)  # all negative: a zero from the padding would show
    x[0, 3, 2, 2] = float("nan")
    x[0, 5] = float("-inf")
    x = x.to(dtype).contiguous(memory_format=torch.channels_last)
    prepared = _kernel(kernel_size=[3, 3], stride=[2, 2], padding=[1, 1])
    assert prepared.native is not None and plan_loop.load(), plan_loop.reason()
    (call,) = prepared.native((x,))  # the native plan loop's call, kernel_ops.cc's op
    native_result = call.op(*call.args)
    got = prepared.run(x)
    assert native_result.dtype == dtype and torch.equal(native_result.isnan(), got.isnan())
    assert torch.equal(native_result.nan_to_num(), got.nan_to_num())
    want = aten.max_pool2d.default(x, [3, 3], [2, 2], [1, 1])
    assert torch.equal(got.isnan(), want.isnan()) and bool(got.isnan().any())
    assert torch.equal(got.isneginf(), want.isneginf()) and bool(got[0, 5].isneginf().all())
    finite = got.isfinite()
    assert torch.equal(got[finite], want[finite]) and float(got[finite].max()) < 0


@pytest.mark.parametrize(
    "x, options",
    [
        (torch.randn(1, 8, 10, 10), {}),  # NCHW: not the layout the C kernel reads
        (_channels_last(1, 8, 10, 10).double(), {}),
        (_channels_last(1, 8, 10, 10), {"dilation": [2, 2]}),
        (_channels_last(1, 8, 10, 10), {"ceil_mode": True}),
    ],
)
def test_other_calls_match_aten(x: torch.Tensor, options: dict) -> None:
    kernel = _kernel(kernel_size=[3, 3], stride=[2, 2], padding=[1, 1], **options)
    want = aten.max_pool2d.default(
        x, [3, 3], [2, 2], [1, 1], options.get("dilation", [1, 1]), options.get("ceil_mode", False)
    )
    assert torch.equal(kernel.run(x), want)


class _Stem(torch.nn.Module):
    """A CNN stem: convolution, ReLU, max pooling, then a second convolution."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 24, 7, stride=2, padding=3)
        self.pool = torch.nn.MaxPool2d(3, stride=2, padding=1)
        self.head = torch.nn.Conv2d(24, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(F.relu(self.conv(x))))


def test_compiled_cnn_runs_the_c_kernel_and_matches_eager() -> None:
    torch.manual_seed(0)
    model = _Stem().eval()
    example = torch.randn(2, 3, 64, 64)
    compiled = cuvil.jit(model, (example,))
    pool = [step for step in compiled.plan.steps if "max_pool2d" in step.name]
    assert len(pool) == 1 and getattr(pool[0].kernel, "__name__", "") == "max_pool2d"
    x = torch.randn(2, 3, 64, 64)
    with torch.inference_mode():
        want = model(x)
    got = compiled(x)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-4
