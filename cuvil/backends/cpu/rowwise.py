"""RMSNorm and RoPE on Cuvil's native row-wise kernels (``backends/cpu/native/rowwise.c``): one pass
over memory where the torch ops make four or five. The torch ops remain the path wherever the
library is not offered (no C compiler, ``CUVIL_NATIVE=off``) and for calls the kernels do not
take: not fp32 on the CPU, last dim not contiguous, RoPE on other than four dims or an odd
width, or cos/sin that do not broadcast to the input.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from cuvil.backends.cpu.native import load as load_native

_Int = ctypes.c_int64
_Ptr = ctypes.c_void_p


@functools.cache
def _library() -> ctypes.CDLL | None:
    library = load_native("rowwise")
    if library is not None:
        threads = ctypes.c_int
        library.cuvil_rms_norm.argtypes = [
            _Ptr,
            _Int,
            _Int,
            _Int,
            _Ptr,
            ctypes.c_float,
            _Ptr,
            threads,
        ]
        strided: list[type[ctypes._SimpleCData[Any]]] = [_Ptr, _Int, _Int, _Int]
        library.cuvil_rope.argtypes = [*strided * 3, _Int, _Int, _Int, _Int, _Ptr, threads]
    return library


def is_native_available() -> bool:
    return _library() is not None


def address(name: str) -> int | None:
    """The address of the library's function ``name``, for the native plan loop's ops
    (native/kernel_ops.cc), or None where the library is not offered."""
    library = _library()
    if library is None:
        return None
    return int(ctypes.cast(getattr(library, name), ctypes.c_void_p).value or 0)


def _fits(*tensors: torch.Tensor) -> bool:
    return all(t.dtype is torch.float32 and t.is_cpu and t.stride(-1) == 1 for t in tensors)


def rms_norm(weight: torch.Tensor, eps: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x -> x / sqrt(mean(x^2, last dim) + eps) * weight``."""
    shape = [int(weight.shape[-1])]

    def with_torch(x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, shape, weight, eps)

    library = _library()
    if library is None or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return with_torch
    weight = weight.contiguous()
    width = shape[0]

    weight_address = weight.data_ptr()

    def native(x: torch.Tensor) -> torch.Tensor:
        if not x.dim() or x.shape[-1] != width or not _fits(x):
            return with_torch(x)
        out = torch.empty(x.shape)
        stride = width
        if not x.is_contiguous():
            x = x.reshape(-1, width)  # a view wherever the rows are evenly spaced
            stride = x.stride(0)
        rows = x.numel() // width
        if rows:
            library.cuvil_rms_norm(
                x.data_ptr(),
                rows,
                width,
                stride,
                weight_address,
                eps,
                out.data_ptr(),
                torch.get_num_threads(),
            )
        return out

    return native


def rope_with_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, rotated, sin)


def _leading_strides(t: torch.Tensor, shape: torch.Size) -> tuple[int, ...] | None:
    """Strides of ``t`` broadcast to the 4-D ``shape``, first three dims; None if it does not
    broadcast or its last dim is not the full width."""
    if t.dim() > 4 or t.shape[-1] != shape[-1]:
        return None
    pad = 4 - t.dim()
    strides = []
    for size, stride, wanted in zip(t.shape[:-1], t.stride()[:-1], shape[pad:-1], strict=True):
        if size == wanted and wanted != 1:
            strides.append(stride)
        elif size == 1:
            strides.append(0)
        else:
            return None
    return (0,) * pad + tuple(strides)


def rope() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """``(x, cos, sin) -> x * cos + rotate_half(x) * sin`` (cos and sin broadcast to x); the
    native kernel takes 4-D ``x`` ([batch, heads, seq, head_dim] in any dim order)."""
    library = _library()
    if library is None:
        return rope_with_torch

    def native(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if len(shape) != 4 or shape[-1] % 2 or not _fits(x, cos, sin):
            return rope_with_torch(x, cos, sin)
        cos_strides = _leading_strides(cos, shape)
        sin_strides = (
            cos_strides
            if sin.shape == cos.shape and sin.stride() == cos.stride()
            else _leading_strides(sin, shape)
        )
        if cos_strides is None or sin_strides is None:
            return rope_with_torch(x, cos, sin)  # raises torch's broadcasting error if any
        out = torch.empty(shape)
        if out.numel():
            library.cuvil_rope(
                x.data_ptr(),
                *x.stride()[:3],
                cos.data_ptr(),
                *cos_strides,
                sin.data_ptr(),
                *sin_strides,
                *shape,
                out.data_ptr(),
                torch.get_num_threads(),
            )
        return out

    return native
