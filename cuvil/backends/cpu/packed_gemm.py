"""MKL's sgemm on a weight packed once: the ``mkl`` GEMM path of fp32 linears where MKL's
packing API is there.

``torch.addmm`` hands MKL the weight as a plain matrix, and MKL copies it into its own blocked
layout inside every call. ``cblas_sgemm_pack`` does that copy once, at load, and
``cblas_sgemm_compute`` multiplies by the packed copy, so a call does only the arithmetic. That
is what torch.compile's freezing does for fp32 linears on CPU (``mkl._mkl_linear``), except that
torch's op takes only the row count it was packed for. Here a packing serves any row count: its
size does not depend on the count it is made for, and every count computes the same product
from it. Its speed does depend on that count, though, so each weight is packed once per row
class (``ROW_CLASSES``), on a class's first call (benchmarks/README.md, ``block_attention.py``'s
section: 128 rows of MiniLM's second feed-forward GEMM ran at 210 GFLOP/s on a packing made
for 128 rows, 117 on one made for 512).

The functions are MKL's, as exported by the ``libtorch_cpu`` this process loaded (found with
ctypes, as ``dnnl.py`` finds libdnnl's), and the GEMM runs as the dispatcher ops of
``native/packed_gemm.cc``, natively in the plan loop too. Where torch was built without MKL, the
native library is not loaded, or ``CUVIL_MKL_PACKED=off``, ``functions()`` is None and the
``mkl`` path stays ``addmm`` on a transposed copy of the weight (``linear_kernels.py``).
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cuvil.backends.cpu.activations import INPLACE_ACTIVATIONS
from cuvil.backends.cpu.native_calls import epilogue_form, op
from cuvil.backends.cpu.weight_copies import shared_copy

_ROW_MAJOR, _TRANS, _B_MATRIX = 101, 112, 162
# (fewest rows, the row count a packing for them is made for)
ROW_CLASSES = ((0, 128), (512, 512))


def row_class(rows: int) -> int:
    """The row count a GEMM of ``rows`` rows runs a packing for."""
    return [made_for for fewest, made_for in ROW_CLASSES if rows >= fewest][-1]


@dataclass(frozen=True)
class MklPacking:
    """MKL's packing functions in this process: ``pack`` is called from Python at load, and
    ``compute`` is an address handed to the native op."""

    size: Any  # cblas_sgemm_pack_get_size
    pack: Any  # cblas_sgemm_pack
    compute: int  # the address of cblas_sgemm_compute


@functools.cache
def functions() -> MklPacking | None:
    """MKL's packed-GEMM functions and the native op that calls them, or None where either is
    missing or ``CUVIL_MKL_PACKED=off``."""
    if os.environ.get("CUVIL_MKL_PACKED", "on") == "off":
        return None
    from cuvil.backends.cpu import plan_loop

    if not plan_loop.load():
        return None
    try:
        library = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        size, pack = library.cblas_sgemm_pack_get_size, library.cblas_sgemm_pack
        compute = library.cblas_sgemm_compute
    except (OSError, AttributeError):
        return None
    size.restype = ctypes.c_size_t
    size.argtypes = [ctypes.c_int] * 4
    floats = ctypes.c_void_p
    pack.restype = None
    pack.argtypes = [*[ctypes.c_int] * 6, ctypes.c_float, floats, ctypes.c_int, floats]
    address = ctypes.cast(compute, ctypes.c_void_p).value
    return MklPacking(size, pack, int(address or 0)) if address else None


def pack(weight: torch.Tensor, packing: MklPacking, made_for: int) -> torch.Tensor:
    """``weight`` [out, in] (fp32) in MKL's packed layout of its transpose for GEMMs of
    ``made_for`` rows, as a byte tensor. MKL sizes the buffer with room to spare; only the
    layout's own bytes are written, so the rest takes no memory."""
    weight = weight.contiguous()
    out_features, in_features = (int(size) for size in weight.shape)
    nbytes = int(packing.size(_B_MATRIX, made_for, out_features, in_features))
    packed = torch.empty(nbytes, dtype=torch.uint8)
    packing.pack(
        _ROW_MAJOR, _B_MATRIX, _TRANS, made_for, out_features, in_features, 1.0,
        weight.data_ptr(), in_features, packed.data_ptr(),
    )  # fmt: skip
    return packed


class PackedLinear:
    """``(x)`` or ``(x, residual)`` -> activation(x W^T + b) [+ residual], x of shape [rows, K],
    on MKL's packed copy of W for the row class of the call; the activation in place after the
    GEMM, a residual (with the bias) accumulated into, as ``addmm`` does it."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        activation: str,
        packing: MklPacking,
    ) -> None:
        self.features = int(weight.shape[0])
        self.source = weight  # the key of its packed copies, shared with other kernels
        self.packing = packing
        self.packs: dict[int, torch.Tensor] = {}  # row class -> its packing, once looked up
        self.bias = bias
        self.activation = activation
        self.activate = INPLACE_ACTIVATIONS[activation]

    def packed(self, rows: int) -> torch.Tensor:
        """The packing GEMMs of ``rows`` rows run, made on the row class's first call by any
        kernel on this weight (weight_copies.py)."""
        made_for = row_class(rows)
        found = self.packs.get(made_for)
        if found is None:
            source, packing = self.source, self.packing
            found = self.packs[made_for] = shared_copy(
                source, ("mkl", made_for), lambda: pack(source.float(), packing, made_for)
            )
        return found

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        packed, compute = self.packed(x.shape[0]), self.packing.compute
        if residual is not None:
            start = torch.add(residual, self.bias) if self.bias is not None else residual.clone()
            return torch.ops.cuvil_native.packed_linear_add_(compute, start, x, packed)
        y = torch.ops.cuvil_native.packed_linear(compute, x, packed, self.features, self.bias)
        return self.activate(y)

    def native_form(self, x: Any, residual: Any, rows: int, first: int) -> list[Any]:
        """The same calls for the native plan loop (native_calls.py), on ``x`` (``rows`` rows)
        and the residual rows, numbered from ``first`` in the form they join."""
        native, compute, packed = torch.ops.cuvil_native, self.packing.compute, self.packed(rows)
        return epilogue_form(
            residual,
            self.bias,
            self.activation,
            first,
            lambda: op(native.packed_linear.default, compute, x, packed, self.features, self.bias),
            lambda start: op(native.packed_linear_add_.default, compute, start, x, packed),
        )


def packed_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, activation: str
) -> PackedLinear | None:
    """The packed path for this weight, or None where MKL's packing is not offered."""
    packing = functions()
    if packing is None:
        return None
    return PackedLinear(weight, bias, activation, packing)
