"""``aten.max_pool2d`` on the CPU backend: Cuvil's C kernels for channels-last fp32 and bf16 maps.

The layout pass keeps a CNN's pooling in channels-last (passes/layout.py), where each output
pixel is the elementwise maximum of its window's input pixels along the contiguous channel dim.
ATen's CPU kernel also computes the index of every maximum and drops it; native/pooling.c does
not, and takes about a third of ATen's time on ResNet's 112x112x64 stem map. Other calls (an
NCHW tensor, another dtype, dilation, ``ceil_mode``) and machines without the native library
run ATen's op, with the same results: both take the first maximum, NaN wins, padding never does.
The native plan loop calls the same C kernel through ``cuvil_native::max_pool2d``
(native/kernel_ops.cc), which makes the same choice between it and ATen's op per call.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import torch

from cuvil.backends.cpu.native import load as load_native
from cuvil.backends.cpu.native_calls import OpCall, op
from cuvil.runtime.kernels import FusedCall, PreparedKernel

aten = torch.ops.aten
_Int = ctypes.c_int64


def _pair(values: Sequence[int] | int | None, default: Sequence[int]) -> tuple[int, int]:
    """An ``int[2]`` argument as ATen reads it: one value for both dims, empty for the default."""
    if values is None:
        values = default
    if isinstance(values, int):
        return values, values
    items = [int(v) for v in values] or [int(v) for v in default]
    return (items[0], items[0]) if len(items) == 1 else (items[0], items[1])


def _library() -> ctypes.CDLL | None:
    library = load_native("pooling")
    if library is not None:
        library.cuvil_max_pool2d_nhwc.argtypes = [
            ctypes.c_void_p,
            *[_Int] * 12,
            ctypes.c_void_p,
            ctypes.c_int,
        ]
        library.cuvil_max_pool2d_nhwc.restype = None
        library.cuvil_max_pool2d_nhwc_bf16.argtypes = library.cuvil_max_pool2d_nhwc.argtypes
        library.cuvil_max_pool2d_nhwc_bf16.restype = None
    return library


def output_size(size: int, kernel: int, stride: int, padding: int) -> int:
    """Output length along one dim without ``ceil_mode`` (dilation 1)."""
    return (size + 2 * padding - kernel) // stride + 1


def max_pool2d_kernel(call: FusedCall) -> PreparedKernel:
    """``aten.max_pool2d(self, kernel_size, stride, padding, dilation, ceil_mode)``."""
    call.check_runtime(("self",))
    kernel = _pair(call.arg("kernel_size"), ())
    stride = _pair(call.arg("stride"), kernel)
    padding = _pair(call.arg("padding"), (0,))
    dilation = _pair(call.arg("dilation"), (1,))
    ceil_mode = bool(call.arg("ceil_mode", False))
    arguments = (list(kernel), list(stride), list(padding), list(dilation), ceil_mode)

    def with_aten(x: torch.Tensor) -> Any:
        return aten.max_pool2d.default(x, *arguments)

    library = _library()
    if library is None or dilation != (1, 1) or ceil_mode:
        return PreparedKernel(with_aten)
    kernels = {torch.float32: library.cuvil_max_pool2d_nhwc}
    kernels[torch.bfloat16] = library.cuvil_max_pool2d_nhwc_bf16
    address, low_address = (
        int(ctypes.cast(k, ctypes.c_void_p).value or 0) for k in kernels.values()
    )
    window = [*kernel, *stride, *padding, low_address]

    def native_form(args: tuple[Any, ...]) -> list[OpCall]:
        return [op(torch.ops.cuvil_native.max_pool2d.default, address, args[0], window)]

    channels_last = torch.channels_last

    def max_pool2d(x: torch.Tensor) -> Any:
        if (
            x.dim() != 4
            or x.dtype not in kernels
            or not x.is_contiguous(memory_format=channels_last)
            or x.numel() == 0
        ):
            return with_aten(x)
        batch, channels, height, width = x.shape
        out_h = output_size(height, kernel[0], stride[0], padding[0])
        out_w = output_size(width, kernel[1], stride[1], padding[1])
        if out_h <= 0 or out_w <= 0 or 2 * max(padding) > min(kernel):
            return with_aten(x)  # ATen's own errors for shapes it refuses
        out = torch.empty(
            (batch, channels, out_h, out_w), dtype=x.dtype, memory_format=channels_last
        )
        kernels[x.dtype](
            x.data_ptr(), batch, height, width, channels, *kernel, *stride, *padding,
            out_h, out_w, out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        return out

    return PreparedKernel(max_pool2d, native=native_form)
