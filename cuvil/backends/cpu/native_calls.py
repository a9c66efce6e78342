"""What the CPU's native plan loop calls in place of a fused kernel: the kernels' native forms.

A native form (``PreparedKernel.native``) is asked, with one recorded call's run-time
arguments, what the native loop should do instead of calling the Python kernel at that shape.
It answers with a few calls, or None where its path has no native form (a tactic still timing
its candidates, a kernel whose library is not offered). A path object may carry its own
``native_calls`` (the Winograd, 1x1-GEMM and split-GEMM paths); Cuvil's C kernels are reached
through the dispatcher ops of native/kernel_ops.cc (``torch.ops.cuvil_native``):

    OpCall    a dispatcher operator (ATen's, oneDNN's ``mkldnn`` ops) on the call's arguments,
              constants (weights) and ``Result(i)``, the value call ``i`` of the same form made
    KeptCall  one of the oneDNN primitives kept by kept_primitives.py, executed on its handles

The last call's value is the kernel's result. Only tensors the call received, ``Result``s and
constants the kernel holds may appear: native_plan.py binds the first to slots by identity and
refuses any other tensor rather than bake a run-time value in as a constant.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from cuvil.backends.cpu.kept_primitives import KeptPrimitives, KeptWithFallback
from cuvil.backends.cpu.tactics import Tactics, bucket

aten = torch.ops.aten
mkldnn = torch.ops.mkldnn


@dataclass(frozen=True)
class Result:
    """The value an earlier call of the same native form made."""

    index: int


@dataclass(frozen=True)
class OpCall:
    op: torch._ops.OpOverload
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class KeptCall:
    """A kept primitive on ``source`` (viewed as ``rows`` for a linear) and an optional residual;
    the result is viewed as ``result_shape`` (empty: as the primitive writes it)."""

    kept: KeptPrimitives
    source: Any
    residual: Any
    source_shape: tuple[int, ...]
    result_shape: tuple[int, ...]
    channels_last: bool


def op(overload: torch._ops.OpOverload, *args: Any, **kwargs: Any) -> OpCall:
    return OpCall(overload, args, kwargs)


# activation name -> the in-place op applied to a fresh GEMM result (activations.py's table)
INPLACE_OPS: dict[str, Callable[[Any], OpCall]] = {
    "relu": lambda y: op(aten.relu_.default, y),
    "gelu": lambda y: op(aten.gelu_.default, y),
    "gelu_tanh": lambda y: op(aten.gelu_.default, y, approximate="tanh"),
    "silu": lambda y: op(aten.silu_.default, y),
    "hardswish": lambda y: op(aten.hardswish_.default, y),
    "relu6": lambda y: op(aten.hardtanh_.default, y, 0.0, 6.0),
    "tanh": lambda y: op(aten.tanh_.default, y),
    "sigmoid": lambda y: op(aten.sigmoid_.default, y),
}


def chosen_path(tactics: Tactics, key: int) -> tuple[str, Callable[..., Any]] | None:
    """The candidate a decided bucket runs, or None while it still times them."""
    return tactics.chosen.get(key)


def kept_of(path: Callable[..., Any]) -> KeptPrimitives | None:
    """The kept primitives behind a ``KeptWithFallback.run`` path, if that is what it is."""
    owner = getattr(path, "__self__", None)
    return owner.kept if isinstance(owner, KeptWithFallback) else None


def kept_conv_call(
    kept: KeptPrimitives, x: torch.Tensor, residual: torch.Tensor | None
) -> list[Any] | None:
    """A kept convolution on ``x`` (and a residual of the output's shape), channels-last."""
    shape = tuple(int(size) for size in x.shape)
    if not kept.can_run(shape):
        return None
    primitive = kept.prepare(shape)
    if residual is not None and tuple(residual.shape) != primitive.output_shape:
        return None  # a broadcast residual: the Python kernel's ATen fallback
    return [KeptCall(kept, x, residual, shape, (), channels_last=True)]


def linear_form(
    tactics: Tactics,
    in_features: int,
    mkl_form: Callable[[Any, Any, int, int], list[Any]],
) -> Callable[[tuple[Any, ...]], Sequence[Any] | None]:
    """``cuvil.linear``'s native form: the decided path of its row bucket, oneDNN's kept inner
    product, MKL's GEMM (``mkl_form(x_rows, residual_rows, rows, first)``) or the split or
    bf16-weight GEMM's calls; inputs that are already rows are passed as they are, without
    reshapes."""

    def native(args: tuple[Any, ...]) -> Sequence[Any] | None:
        x, residual = args[0], (args[1] if len(args) > 1 else None)
        lead = tuple(int(size) for size in x.shape[:-1])
        rows = 1
        for size in lead:
            rows *= size
        chosen = chosen_path(tactics, bucket(rows))
        if chosen is None:
            return None
        name, path = chosen
        kept = kept_of(path)
        if name == "onednn" and kept is not None and kept.can_run((rows, in_features)):
            out_features = kept.prepare((rows, in_features)).output_shape[-1]
            return [KeptCall(kept, x, residual, (rows, in_features), (*lead, out_features), False)]
        # the split and bf16-weight paths build their own calls
        own = getattr(path, "native_calls", None) if name not in ("mkl", "onednn") else None
        if name != "mkl" and own is None:
            return None
        calls: list[Any] = []
        flat_x, flat_residual = x, residual  # already rows: no reshapes either way
        if len(lead) != 1:
            calls.append(op(aten.reshape.default, x, [rows, in_features]))
            flat_x = Result(0)
            if residual is not None:
                calls.append(op(aten.reshape.default, residual, [rows, -1]))
                flat_residual = Result(1)
        if own is not None:
            calls += own(flat_x, flat_residual, rows, len(calls))
        else:
            calls += mkl_form(flat_x, flat_residual, rows, len(calls))
        if len(lead) != 1:
            calls.append(op(aten.reshape.default, Result(len(calls) - 1), [*lead, -1]))
        return calls

    return native


def epilogue_form(
    residual: Any,
    bias: torch.Tensor | None,
    activation: str,
    first: int,
    gemm: Callable[[], OpCall],
    accumulate: Callable[[Any], OpCall],
) -> list[Any]:
    """An MKL GEMM path's calls, numbered from ``first`` in the form they join: residual + bias
    into a fresh buffer that ``accumulate(start)`` adds the product to (beta 1); or ``gemm()``
    (the bias included), then the activation in place."""
    if residual is not None:
        start = (
            op(aten.add.Tensor, residual, bias)
            if bias is not None
            else op(aten.clone.default, residual)
        )
        return [start, accumulate(Result(first))]
    calls: list[Any] = [gemm()]
    if activation != "none":
        calls.append(INPLACE_OPS[activation](Result(first)))
    return calls


def mkl_linear_form(
    transposed: torch.Tensor, bias: torch.Tensor | None, activation: str
) -> Callable[[Any, Any, int, int], list[Any]]:
    """MKL's ``addmm`` path as calls on ``rows`` and residual rows (``count`` of them),
    numbered from ``first`` in the form they join (``epilogue_form``)."""

    def form(rows: Any, residual: Any, count: int, first: int) -> list[Any]:
        def gemm() -> OpCall:
            if bias is not None:
                return op(aten.addmm.default, bias, rows, transposed)
            return op(aten.mm.default, rows, transposed)

        def accumulate(start: Any) -> OpCall:
            return op(aten.addmm_.default, start, rows, transposed)

        return epilogue_form(residual, bias, activation, first, gemm, accumulate)

    return form


def single_op_form(
    build: Callable[[tuple[Any, ...]], OpCall],
) -> Callable[[tuple[Any, ...]], Sequence[Any] | None]:
    """A kernel that is one dispatcher call (layer norm, attention)."""
    return lambda args: [build(args)]


def bf16_linear_form(
    tactics: Tactics | None,
    packed: torch.Tensor,
    low_bias: torch.Tensor | None,
    post_op: tuple[str, list[Any], str],
    residual: bool,
    low_out: bool = False,
) -> Callable[[tuple[Any, ...]], Sequence[Any] | None]:
    """A bf16 linear's native form, the decided path of its row bucket (``tactics``; None: one
    path): the input cast to bf16 where it arrives in fp32, oneDNN's inner product with the
    activation as its post-op; the result cast back and the residual added in fp32, or
    (``low_out``: the graph keeps it bf16) the residual added as a post-op. ``onednn_1t`` is
    the same with an fp32 result as one call on the calling thread alone (native/kernel_ops.cc)."""
    attr, scalars, algorithm = post_op
    linear_op = mkldnn._linear_pointwise.default
    low = torch.bfloat16

    def native(args: tuple[Any, ...]) -> Sequence[Any] | None:
        x = args[0]
        chosen: tuple[str, Any] | None = ("onednn", None)
        if tactics is not None:
            rows = 1
            for size in x.shape[:-1]:
                rows *= int(size)
            key = bucket(rows)
            offered = tactics.candidates_for(key)
            chosen = chosen_path(tactics, key) or (offered[0] if len(offered) == 1 else None)
        if chosen is None:
            return None
        calls: list[Any] = []
        if chosen[0] == "onednn_1t":  # the native library is loaded once forms are asked for
            one_thread = torch.ops.cuvil_native.bf16_linear_one_thread.default
            calls.append(op(one_thread, x, packed, low_bias, attr, scalars, algorithm))
        else:
            if x.dtype != low:
                calls.append(op(aten.to.dtype, x, low))
                x = Result(0)
            if residual and low_out:
                if args[1].dtype != low or not args[1].is_contiguous():
                    return None  # the graph gives it bf16 and contiguous; else the Python kernel
                binary = mkldnn._linear_pointwise.binary
                return [*calls, op(binary, x, args[1], packed, low_bias, "add")]
            calls.append(op(linear_op, x, packed, low_bias, attr, scalars, algorithm))
            if low_out:
                return calls
            calls.append(op(aten.to.dtype, Result(len(calls) - 1), torch.float32))
        if residual:
            calls.append(op(aten.add.Tensor, Result(len(calls) - 1), args[1]))
        return calls

    return native


def kept_linear_form(
    kept: KeptPrimitives, in_features: int
) -> Callable[[tuple[Any, ...]], Sequence[Any] | None]:
    """A linear on kept primitives alone (bf16 in): its input viewed as rows."""

    def native(args: tuple[Any, ...]) -> Sequence[Any] | None:
        x, residual = args[0], (args[1] if len(args) > 1 else None)
        lead = tuple(int(size) for size in x.shape[:-1])
        rows = 1
        for size in lead:
            rows *= size
        if not kept.can_run((rows, in_features)):
            return None
        out_features = kept.prepare((rows, in_features)).output_shape[-1]
        return [KeptCall(kept, x, residual, (rows, in_features), (*lead, out_features), False)]

    return native


def widened_form(
    inner: Callable[[tuple[Any, ...]], Sequence[Any] | None] | None, low_out: bool
) -> Callable[[tuple[Any, ...]], Sequence[Any] | None] | None:
    """An fp32 kernel's native form for bf16 values (a CPU without bf16 instructions): the bf16
    arguments widened first, the fp32 form's calls on them, the result narrowed to bf16 where
    the graph keeps it so."""
    if inner is None:
        return None

    def native(args: tuple[Any, ...]) -> Sequence[Any] | None:
        casts: list[Any] = []
        wide: list[Any] = []
        stand_ins: dict[int, Result] = {}
        for value in args:
            if isinstance(value, torch.Tensor) and value.dtype == torch.bfloat16:
                stand_in = value.float()  # what the fp32 form sees; replaced by the cast's result
                stand_ins[id(stand_in)] = Result(len(casts))
                casts.append(op(aten.to.dtype, value, torch.float32))
                wide.append(stand_in)
            else:
                wide.append(value)
        calls = inner(tuple(wide))
        if calls is None:
            return None
        shifted = [_renumbered(call, len(casts), stand_ins) for call in calls]
        if low_out:
            shifted.append(op(aten.to.dtype, Result(len(casts) + len(calls) - 1), torch.bfloat16))
        return [*casts, *shifted]

    return native


def _renumbered(call: Any, shift: int, stand_ins: dict[int, Result]) -> Any:
    def move(value: Any) -> Any:
        if isinstance(value, Result):
            return Result(value.index + shift)
        if isinstance(value, torch.Tensor) and id(value) in stand_ins:
            return stand_ins[id(value)]
        if isinstance(value, (list, tuple)):
            return type(value)(move(item) for item in value)
        return value

    if isinstance(call, KeptCall):
        return replace(call, source=move(call.source), residual=move(call.residual))
    return OpCall(
        call.op, tuple(move(a) for a in call.args), {k: move(v) for k, v in call.kwargs.items()}
    )


def gated_form(
    gemm: Callable[[tuple[Any, ...]], Sequence[Any] | None] | None, hidden: int
) -> Callable[[tuple[Any, ...]], Sequence[Any] | None] | None:
    """``cuvil.swiglu``'s native form: its packed GEMM's form, then silu(gate) * up."""
    if gemm is None:
        return None

    def native(args: tuple[Any, ...]) -> Sequence[Any] | None:
        calls = gemm(args)
        if calls is None:
            return None
        gate = torch.ops.cuvil_native.silu_mul.default
        return [*calls, op(gate, Result(len(calls) - 1), hidden)]

    return native
