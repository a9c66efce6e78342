"""CPU kernels for ``cuvil.linear`` and ``cuvil.swiglu``: GEMM paths, chosen per shape.

    mkl     MKL's sgemm on the weight packed once (backends/cpu/packed_gemm.py), or addmm on
            the pre-transposed weight where MKL's packing is not offered; then the activation
            in place; a residual is added first (residual + bias) and the GEMM accumulates into it
    onednn  oneDNN's prepacked inner product with the activation or the residual add as a
            post-op: kept primitives (backends/cpu/direct_linear.py), or ATen's call without libdnnl
    split   for up to 4 rows: the weight split across threads as a batched GEMM
            (MKL runs a one-row GEMM on one thread; see backends/cpu/split_gemm.py)
    bf16_weights  a bf16 weight on a CPU without bf16 GEMMs: kept in bf16 and widened as it
            is read, for steps bounded by reading the weight (backends/cpu/bf16_weights.py)
    int8    an int8 weight (``weight_scale`` per output row): calls of up to FEW_ROWS rows on
            AMX int8 tiles reading the int8 weight, others (and other CPUs) on the paths
            above over its bf16 values (backends/cpu/int8_weights.py)

None wins everywhere (see cuvil/backends/cpu/tactics.py for why), so each linear
times them, in place, over its first calls in a new row-count bucket and keeps the fastest.
Both paths keep their own copy of the weight (oneDNN's blocked layout and MKL's packed one are
opaque to each other): fp32 linear weights take twice their size in memory while loaded.

bf16 weights run in bf16 on CPUs whose oneDNN has bf16 instructions (AVX512-BF16, AMX); on
others they are widened to fp32 once at load — the fp32 GEMM is several times faster there
than ATen's emulated bf16, and the result only carries bf16's weight rounding — and the
bf16_weights path, which reads the bf16 weight itself, is timed beside the fp32 ones.
``compute_precision()`` says which one runs. Where the graph gives a bf16 GEMM its input in
bf16 (passes/low_activations.py; ``FusedCall.dtypes``, ``output_dtype``), it runs on kept
oneDNN primitives that read bf16 and write bf16 or fp32, with no cast of its own; elsewhere
ATen's oneDNN call with the casts at the op's borders.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from cuvil.backends.cpu.activations import INPLACE_ACTIVATIONS, ONEDNN_ACTIVATIONS
from cuvil.backends.cpu.bf16_weights import bf16_weight_candidates
from cuvil.backends.cpu.direct_linear import DirectLinear
from cuvil.backends.cpu.dnnl import load as load_dnnl
from cuvil.backends.cpu.int8_weights import by_rows, dequantized, int8_kernel
from cuvil.backends.cpu.kept_primitives import KeptWithFallback
from cuvil.backends.cpu.kernel_choices import cpuinfo
from cuvil.backends.cpu.native_calls import (
    bf16_linear_form,
    gated_form,
    kept_linear_form,
    linear_form,
    mkl_linear_form,
    widened_form,
)
from cuvil.backends.cpu.packed_gemm import packed_linear
from cuvil.backends.cpu.split_gemm import SPLIT_MAX_ROWS, split_linear, split_parts
from cuvil.backends.cpu.tactics import Tactics, bucket
from cuvil.backends.cpu.weight_copies import shared_copy
from cuvil.runtime.kernels import FusedCall, PreparedKernel

mkldnn = torch.ops.mkldnn


ONE_THREAD_MAX_ROWS = 16  # rows up to which a bf16 GEMM also times a one-thread run


# CPU flags (/proc/cpuinfo) of instructions that compute bf16 products natively
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "avx_ne_convert"})


@functools.cache
def has_onednn_bf16() -> bool:
    """Whether bf16 GEMMs run on oneDNN's bf16 here: where it computes them natively, with
    AVX512-BF16, AMX or AVX-NE-CONVERT. ATen's own check also says yes on AVX-512 CPUs without
    them, where oneDNN emulates bf16, several times slower than the fp32 GEMMs on the widened
    weight for prompts and batched decode steps (benchmarks/README.md, ``bf16_compute.py``).
    ``CUVIL_BF16_GEMM=onednn`` takes oneDNN's bf16 wherever ATen offers it; where
    /proc/cpuinfo is missing, ATen's answer stands."""
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    flags = set(cpuinfo().get("flags", "").split())
    if os.environ.get("CUVIL_BF16_GEMM", "auto") == "onednn" or not flags:
        return True
    return bool(flags & NATIVE_BF16_FLAGS)


def fp32_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight in fp32: itself, or one widened copy that every kernel on it shares (and so
    the packed copies made from it: weight_copies.py)."""
    if weight.dtype == torch.float32:
        return weight
    return shared_copy(weight, "fp32", weight.float)


def compute_precision(weight_dtype: torch.dtype) -> str:
    """What a GEMM with weights of this dtype computes in on this CPU."""
    if weight_dtype == torch.bfloat16 and has_onednn_bf16():
        return "bf16"
    return "fp32"


def widened(prepared: PreparedKernel, low_out: bool) -> PreparedKernel:
    """An fp32 kernel (a CPU without bf16 instructions) where the graph passes bf16 values:
    inputs widened, the result narrowed, natively too (``widened_form``)."""
    inner = prepared.run

    def run(*values: torch.Tensor) -> torch.Tensor:
        y = inner(*(v.float() for v in values))
        return y.to(torch.bfloat16) if low_out else y

    return PreparedKernel(run, prepared.choices, widened_form(prepared.native, low_out))


def takes_low_input(call: FusedCall) -> bool:
    """A GEMM-like node the graph gives a bf16 input, and a residual (if any) in its result's
    dtype: what kept bf16 primitives take (the residual is read in the output's layout)."""
    residual = call.dtypes.get("residual", call.output_dtype)
    return call.dtypes.get("input") == "bf16" and residual == call.output_dtype


def _as_fp32(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return tensor.float() if tensor is not None else None


def linear_kernel(call: FusedCall) -> PreparedKernel:
    """``cuvil.linear(input, weight, bias, activation, residual)``: activation(x W^T + b), or
    x W^T + b + residual."""
    call.check_runtime(("input", "residual"))
    activation = str(call.arg("activation"))
    residual = call.is_runtime("residual")
    if residual and activation != "none":
        raise ValueError("cuvil.linear fuses an activation or a residual add, not both")
    weight: torch.Tensor = call.arg("weight")
    low_out = call.output_dtype == "bf16"
    if weight.dtype == torch.int8:
        scale: torch.Tensor = call.arg("weight_scale")
        few = int8_kernel(weight, scale, call.arg("bias"), activation, low_out)
        many = functools.partial(
            _linear_on, call, dequantized(weight, scale), activation, residual, low_out
        )
        return many() if few is None else by_rows(few, many)
    return _linear_on(call, weight, activation, residual, low_out)


def _linear_on(
    call: FusedCall, weight: torch.Tensor, activation: str, residual: bool, low_out: bool
) -> PreparedKernel:
    """The linear's kernel on ``weight`` (fp32 or bf16)."""
    if compute_precision(weight.dtype) == "bf16":
        bias = call.arg("bias")
        dnnl = load_dnnl()
        if dnnl is None or not takes_low_input(call):
            return _bf16_linear(weight, bias, activation, residual, low_out)
        dtypes = (torch.bfloat16, torch.bfloat16 if low_out else torch.float32)
        kept = DirectLinear(dnnl, weight, bias, activation, residual, dtypes)
        # ATen's call (and its packed weight) only on first need
        aten = KeptWithFallback(
            kept, lambda: _bf16_linear(weight, bias, activation, residual, low_out).run
        )
        return _kept_rows(aten, weight.shape[-1])
    fp32 = _fp32_linear(weight, _as_fp32(call.arg("bias")), activation, residual)
    if low_out or "bf16" in call.dtypes.values():
        return widened(fp32, low_out)
    return fp32


def _kept_rows(kernel: KeptWithFallback, in_features: int) -> PreparedKernel:
    """A linear on kept primitives that read bf16 (passes/low_activations.py gives it bf16
    values) and write bf16 or fp32: leading dims flattened to rows, ATen's oneDNN call past
    their cache."""

    def linear(x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = x.reshape(-1, in_features)
        y = kernel.run(rows, *(r.reshape(rows.shape[0], -1) for r in rest))
        return y.view(*lead, y.shape[-1])

    return PreparedKernel(linear, native=kept_linear_form(kernel.kept, in_features))


def _fp32_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, activation: str, residual: bool
) -> PreparedKernel:
    """The fp32 linear: MKL, oneDNN and split-GEMM paths timed per row bucket; for a bf16
    weight (on a CPU without bf16 GEMMs), the bf16-weight path too, the others on its fp32
    copy."""
    wide = fp32_weight(weight)
    mkl, mkl_form = _mkl_path(wide, bias, activation, residual)
    if residual:
        candidates = [("mkl", mkl), ("onednn", _onednn_residual(wide, bias))]
    else:
        candidates = [("mkl", mkl), ("onednn", _onednn_activation(wide, bias, activation))]
    candidates += bf16_weight_candidates(weight, bias, activation)
    return _tactic_linear(
        candidates,
        wide.shape[-1],
        _split_candidates(wide, bias, activation, residual),
        mkl_form,
    )


def _mkl_path(
    weight: torch.Tensor, bias: torch.Tensor | None, activation: str, residual: bool
) -> tuple[Callable[..., torch.Tensor], Callable[[Any, Any, int, int], list[Any]]]:
    """MKL's GEMM and its native form: on a packed copy of the weight where MKL's packing is
    offered (packed_gemm.py), else ``addmm`` on a transposed copy."""
    packed = packed_linear(weight, bias, activation)
    if packed is not None:
        return packed, packed.native_form
    transposed = weight.t().contiguous()
    form = mkl_linear_form(transposed, bias, activation)
    if residual:

        def mkl_add(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
            # residual + bias into a fresh buffer, then the GEMM accumulates into it (beta = 1)
            start = torch.add(residual, bias) if bias is not None else residual.clone()
            return start.addmm_(x, transposed)

        return mkl_add, form
    activate = INPLACE_ACTIVATIONS[activation]

    def mkl(x: torch.Tensor) -> torch.Tensor:
        y = torch.addmm(bias, x, transposed) if bias is not None else torch.mm(x, transposed)
        return activate(y)

    return mkl, form


def _split_candidates(
    weight: torch.Tensor, bias: torch.Tensor | None, activation: str, residual: bool
) -> list[tuple[str, Callable[..., torch.Tensor]]]:
    """The weight split across threads, for calls with a few rows (backends/cpu/split_gemm.py)."""
    parts = split_parts()
    if parts < 2:
        return []
    return [("split", split_linear(weight, bias, activation, residual, parts))]


def _tactic_linear(
    candidates: list[tuple[str, Callable[..., torch.Tensor]]],
    in_features: int,
    few_rows: list[tuple[str, Callable[..., torch.Tensor]]] | None = None,
    mkl_form: Callable[[Any, Any, int, int], list[Any]] | None = None,
) -> PreparedKernel:
    """Flatten leading dims to rows, let the tactics pick the GEMM path per row bucket
    (``few_rows`` candidates join in for buckets up to SPLIT_MAX_ROWS rows). ``mkl_form``: the
    MKL path as native calls (native_calls.py), for the native plan loop."""
    tactics = Tactics(candidates, few_rows or (), SPLIT_MAX_ROWS)
    decided: dict[int, Callable[..., torch.Tensor]] = {}  # 2-D calls: rows -> chosen path

    def linear(x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:  # already rows: skip the reshapes and the bucket (most of a 1-row call)
            path = decided.get(x.shape[0])
            if path is not None:
                return path(x, *rest)
        lead = x.shape[:-1]
        rows = x.reshape(-1, in_features)
        flat = [r.reshape(rows.shape[0], -1) for r in rest]
        key = bucket(rows.shape[0])
        y = tactics.run(key, rows, *flat)
        if x.dim() == 2 and key in tactics.chosen:
            decided[x.shape[0]] = tactics.chosen[key][1]
        return y.view(*lead, y.shape[-1])

    native = linear_form(tactics, in_features, mkl_form) if mkl_form is not None else None
    return PreparedKernel(linear, tactics, native)


def _onednn_activation(
    weight: torch.Tensor, bias: torch.Tensor | None, activation: str
) -> Callable[..., torch.Tensor]:
    def aten_onednn() -> Callable[..., torch.Tensor]:
        attr, scalars, algorithm = ONEDNN_ACTIVATIONS[activation]
        packed = mkldnn._reorder_linear_weight(weight, None)

        def onednn(x: torch.Tensor) -> torch.Tensor:
            return mkldnn._linear_pointwise(x.contiguous(), packed, bias, attr, scalars, algorithm)

        return onednn

    return _onednn_path(weight, bias, activation, False, aten_onednn)


def _onednn_path(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str,
    residual: bool,
    aten: Callable[[], Callable[..., torch.Tensor]],
) -> Callable[..., torch.Tensor]:
    """oneDNN's linear: kept primitives where libdnnl is loaded (ATen's call past their cache),
    else ATen's call, which rebuilds its primitive each time."""
    dnnl = load_dnnl()
    if dnnl is None:
        return aten()
    return KeptWithFallback(DirectLinear(dnnl, weight, bias, activation, residual), aten).run


def _onednn_residual(
    weight: torch.Tensor, bias: torch.Tensor | None
) -> Callable[..., torch.Tensor]:
    def aten_onednn() -> Callable[..., torch.Tensor]:
        packed = mkldnn._reorder_linear_weight(weight, None)

        def onednn(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
            return mkldnn._linear_pointwise.binary(
                x.contiguous(), residual.contiguous(), packed, bias, "add"
            )

        return onednn

    return _onednn_path(weight, bias, "none", True, aten_onednn)


def _bf16_linear(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str,
    residual: bool,
    low_out: bool = False,
) -> PreparedKernel:
    """oneDNN bf16: inputs cast in where they arrive in fp32; the result cast out (and a
    residual added in fp32) unless the graph keeps it bf16 (``low_out``), where the residual
    add is the inner product's post-op. Calls of up to ONE_THREAD_MAX_ROWS rows with an fp32
    result also time the same GEMM on the calling thread alone (a decode step's GEMM of a small
    weight waits longer for a second thread than it computes)."""
    attr, scalars, algorithm = ("none", [], "") if residual else ONEDNN_ACTIVATIONS[activation]
    packed = mkldnn._reorder_linear_weight(weight, None)
    low_bias = bias.to(torch.bfloat16) if bias is not None else None
    in_features = weight.shape[-1]
    low = torch.bfloat16
    if residual and low_out:

        def linear_add_low(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
            return mkldnn._linear_pointwise.binary(
                x.to(low), residual.to(low).contiguous(), packed, low_bias, "add"
            )

        native = bf16_linear_form(None, packed, low_bias, (attr, scalars, algorithm), True, True)
        return PreparedKernel(linear_add_low, native=native)

    def gemm(x: torch.Tensor) -> torch.Tensor:
        y = mkldnn._linear_pointwise(x.to(low), packed, low_bias, attr, scalars, algorithm)
        return y if low_out else y.float()

    def gemm_one_thread(x: torch.Tensor) -> torch.Tensor:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return gemm(x)
        finally:
            torch.set_num_threads(threads)

    one_thread = torch.get_num_threads() > 1 and not low_out  # its native op writes fp32
    few_rows = [("onednn_1t", gemm_one_thread)] if one_thread else []
    tactics = Tactics([("onednn", gemm)], few_rows, ONE_THREAD_MAX_ROWS)

    def linear(x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        y = tactics.run(bucket(x.numel() // in_features), x)
        return y + rest[0] if residual else y

    post_op = (attr, scalars, algorithm)
    native = bf16_linear_form(tactics, packed, low_bias, post_op, residual, low_out)
    return PreparedKernel(linear, tactics, native)


def swiglu_kernel(call: FusedCall) -> PreparedKernel:
    """``cuvil.swiglu(input, gate_up_weight, hidden)``: silu(x Wg^T) * (x Wu^T) with the two
    projections packed into one GEMM (its path chosen like a linear's)."""
    call.check_runtime(("input",))
    hidden = int(call.arg("hidden"))
    weight: torch.Tensor = call.arg("gate_up_weight")
    if weight.dtype == torch.int8:
        scale: torch.Tensor = call.arg("weight_scale")
        few = int8_kernel(weight, scale, None, "none", low_out=False)
        many = functools.partial(_swiglu_gemm, call, dequantized(weight, scale))
        gemm = many() if few is None else by_rows(few, many)
    else:
        gemm = _swiglu_gemm(call, weight)
    project = gemm.run

    def swiglu(x: torch.Tensor) -> torch.Tensor:
        gate, up = project(x).split(hidden, dim=-1)
        return F.silu(gate).mul_(up)

    return PreparedKernel(swiglu, gemm.choices, gated_form(gemm.native, hidden))


def _swiglu_gemm(call: FusedCall, weight: torch.Tensor) -> PreparedKernel:
    """The SwiGLU's packed GEMM on ``weight`` (fp32 or bf16), its result fp32."""
    if compute_precision(weight.dtype) == "bf16":
        dnnl = load_dnnl()
        if dnnl is not None and takes_low_input(call):  # bf16 in, the gate's fp32 out
            dtypes = (torch.bfloat16, torch.float32)
            kept = DirectLinear(dnnl, weight, None, "none", False, dtypes)
            aten = KeptWithFallback(kept, lambda: _bf16_linear(weight, None, "none", False).run)
            gemm = _kept_rows(aten, weight.shape[-1])
        else:
            gemm = _bf16_linear(weight, None, "none", residual=False)
    else:
        wide = fp32_weight(weight)
        mkl, mkl_form = _mkl_path(wide, None, "none", residual=False)
        candidates = [("mkl", mkl), ("onednn", _onednn_activation(wide, None, "none"))]
        candidates += bf16_weight_candidates(weight, None, "none")
        gemm = _tactic_linear(candidates, wide.shape[-1], mkl_form=mkl_form)
        if "bf16" in call.dtypes.values():  # bf16 values on a CPU without bf16 GEMMs
            gemm = widened(gemm, low_out=False)
    return gemm
