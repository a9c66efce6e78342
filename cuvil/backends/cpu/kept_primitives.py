"""oneDNN primitives kept across calls, one per input shape, for one constant weight.

The shared half of direct_conv.py and direct_linear.py. A primitive is built on the first call
with a new input shape (the costly step, weight packing included, which the sidecar's warm-up
takes before serving) with the activation and any residual add as post-ops; the weight is packed
into the blocked layout that primitive asks for, once per distinct layout for every kernel on that
weight (``WeightPacks``, shared through weight_copies.py), and no plain copy is kept once a
packed one exists. A call only binds the input, output and residual
pointers and executes, where ATen's call rebuilds the primitive descriptor every time, which
costs more than the arithmetic of a small convolution.

Keys carry the thread count: oneDNN splits the work for the count at creation and keeps that
split. The memory objects that carry pointers are per thread, so threads may run one model at
once. Past ``MAX_SHAPES`` keys a shape is refused (``can_run`` is False) and the caller takes
another path, rather than the cache growing without bound.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from cuvil.backends.cpu.dnnl import (
    ARG_BIAS,
    ARG_DST,
    ARG_SCRATCHPAD,
    ARG_SRC,
    ARG_WEIGHTS,
    Dnnl,
    Handle,
    post_op_source,
)
from cuvil.backends.cpu.weight_copies import shared_copy

MAX_SHAPES = 64


def contiguous_strides(dims: Sequence[int]) -> list[int]:
    strides = [1] * len(dims)
    for i in range(len(dims) - 2, -1, -1):
        strides[i] = strides[i + 1] * int(dims[i + 1])
    return strides


@dataclass
class Layouts:
    """What one input shape's primitive reads and writes (descriptors owned by the cache)."""

    src: Handle
    dst: Handle
    weights: Handle  # the "any" layout: the primitive picks
    bias: Handle | None
    output_shape: tuple[int, ...]


@dataclass
class _Primitive:
    """One input shape's primitive, what it writes, and each thread's bound arguments."""

    handle: Handle
    output_shape: tuple[int, ...]
    src: Handle
    dst: Handle
    weight: Handle
    bias: Handle | None
    scratchpad: Handle
    scratchpad_size: int
    local: threading.local = field(default_factory=threading.local)


class KeptPrimitives:
    """The cache; subclasses say how a shape's layouts and primitive descriptor are made."""

    def __init__(
        self,
        dnnl: Dnnl,
        weight: torch.Tensor,
        weight_dims: Sequence[int],
        bias: torch.Tensor | None,
        activation: str,
        residual: bool,
        donated: bool = False,
        dtypes: tuple[torch.dtype, torch.dtype] = (torch.float32, torch.float32),
    ) -> None:
        self.dnnl = dnnl
        # what the input and weight are in, and what the output (and a residual) is in: fp32,
        # or bf16 (AVX512-BF16/AMX; accumulation stays fp32 inside the primitive)
        self.dtype, self.out_dtype = dtypes
        self.activation = activation
        self.has_residual = residual
        # a donated residual is dead after this op: the output is written over it (oneDNN's sum
        # post-op, which saves the binary add's read of a separate input and a fresh output)
        self.donated = residual and donated
        self.bias = bias.float().contiguous() if bias is not None else None
        self.primitives: dict[tuple[int, ...], _Primitive] = {}
        self.implementations: dict[tuple[int, ...], str] = {}
        self.owned: dict[str, list[Handle]] = {kind: [] for kind in _KINDS}
        # the weight as given, the source of its first packed copy, dropped once one exists
        plain = self.own(
            "memory_desc",
            dnnl.strided_desc(weight_dims, contiguous_strides(weight_dims), self.dtype),
        )
        self.plain: tuple[Handle, torch.Tensor] | None = (plain, weight.to(self.dtype).contiguous())
        # packed copies by layout, shared with every kept primitive on this weight
        self.packs = shared_copy(
            weight, ("onednn", self.dtype, tuple(weight_dims)), lambda: WeightPacks(dnnl)
        )
        weakref.finalize(self, _free, dnnl, self.owned)

    def own(self, kind: str, handle: Handle) -> Handle:
        self.owned[kind].append(handle)
        return handle

    def layouts(self, dims: tuple[int, ...]) -> Layouts:
        raise NotImplementedError

    def describe(self, layouts: Layouts, attr: Handle) -> Handle:
        """The primitive descriptor for these layouts and post-ops."""
        raise NotImplementedError

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """The result, or None for a call these primitives cannot take."""
        raise NotImplementedError

    def can_run(self, shape: Sequence[int]) -> bool:
        return len(self.primitives) < MAX_SHAPES or (
            (*shape, torch.get_num_threads()) in self.primitives
        )

    def prepare(self, shape: Sequence[int]) -> _Primitive:
        """The primitive for inputs of ``shape`` (built and its weight packed if new)."""
        key = (*(int(size) for size in shape), torch.get_num_threads())
        found = self.primitives.get(key)
        if found is not None:
            return found
        dnnl = self.dnnl
        layouts = self.layouts(key[:-1])
        attr = dnnl.attributes(
            layouts.dst if self.has_residual else None, self.activation, self.donated
        )
        try:
            descriptor = self.own("primitive_desc", self.describe(layouts, attr))
        finally:
            dnnl.destroy("primitive_attr", attr)
        handle = self.own("primitive", dnnl.primitive(descriptor))
        packed_desc, packed = self._packed(dnnl.argument_desc(descriptor, ARG_WEIGHTS))
        self.implementations[key] = dnnl.implementation(descriptor)
        scratchpad = dnnl.argument_desc(descriptor, ARG_SCRATCHPAD)
        bias = None
        if layouts.bias is not None and self.bias is not None:
            bias = self.own("memory", dnnl.memory(layouts.bias, self.bias.data_ptr()))
        primitive = _Primitive(
            handle=handle,
            output_shape=layouts.output_shape,
            src=layouts.src,
            dst=layouts.dst,
            weight=self.own("memory", dnnl.memory(packed_desc, packed.data_ptr())),
            bias=bias,
            scratchpad=scratchpad,
            scratchpad_size=dnnl.size(scratchpad),
        )
        self.primitives[key] = primitive
        return primitive

    def _packed(self, wanted: Handle) -> tuple[Handle, torch.Tensor]:
        found = self.packs.get(wanted, self.plain)
        self.plain = None
        return found

    def execute(
        self,
        primitive: _Primitive,
        x: torch.Tensor,
        out: torch.Tensor,
        residual: torch.Tensor | None,
    ) -> None:
        """Runs the primitive on these tensors (each laid out as its descriptor says)."""
        bound = getattr(primitive.local, "bound", None)
        if bound is None:
            bound = self._bind(primitive)
        set_pointer = self.dnnl.lib.dnnl_memory_set_data_handle
        src, dst, extra, scratchpad, stream, arguments = bound
        set_pointer(src, x.data_ptr())
        set_pointer(dst, out.data_ptr())
        if extra is not None and residual is not None:
            set_pointer(extra, residual.data_ptr())
        if primitive.scratchpad_size:
            set_pointer(scratchpad, self.dnnl.scratchpad(primitive.scratchpad_size))
        self.dnnl.execute(primitive.handle, arguments, stream)

    def _bind(self, primitive: _Primitive) -> tuple[Any, ...]:
        """This thread's memory objects for the primitive's run-time arguments, and its stream."""
        dnnl = self.dnnl
        src = self.own("memory", dnnl.memory(primitive.src, None))
        dst = self.own("memory", dnnl.memory(primitive.dst, None))
        scratchpad = self.own("memory", dnnl.memory(primitive.scratchpad, None))
        pairs = [
            (ARG_SRC, src),
            (ARG_WEIGHTS, primitive.weight),
            (ARG_DST, dst),
            (ARG_SCRATCHPAD, scratchpad),
        ]
        if primitive.bias is not None:
            pairs.append((ARG_BIAS, primitive.bias))
        extra = None
        if self.has_residual and not self.donated:  # post-op 0's input, the output's layout
            extra = self.own("memory", dnnl.memory(primitive.dst, None))
            pairs.append((post_op_source(0), extra))
        bound = (src, dst, extra, scratchpad, dnnl.stream(), dnnl.arguments(pairs))
        primitive.local.bound = bound
        return bound


class KeptWithFallback:
    """A kernel: ``kept``, and ``fallback()``'s kernel (ATen's oneDNN call, built on first need)
    for shapes past the cache and calls ``kept`` cannot take (a broadcast residual). The plan
    calls ``run``."""

    def __init__(
        self, kept: KeptPrimitives, fallback: Callable[[], Callable[..., torch.Tensor]]
    ) -> None:
        self.kept = kept
        self._fallback = fallback
        self._built: list[Callable[..., torch.Tensor]] = []

    def run(self, x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        if self.kept.can_run(x.shape):
            out = self.kept(x, *rest)
            if out is not None:
                return out
        if not self._built:
            self._built.append(self._fallback())
        return self._built[0](x, *rest)


class WeightPacks:
    """One weight's copies in the blocked layouts oneDNN's primitives ask for, each made once
    (by a reorder from the plain weight or an earlier copy) and shared by every kept primitive
    on that weight (weight_copies.py); their descriptors are freed with it."""

    def __init__(self, dnnl: Dnnl) -> None:
        self.dnnl = dnnl
        self.lock = threading.Lock()
        self.copies: list[tuple[Handle, torch.Tensor]] = []
        self.owned: dict[str, list[Handle]] = {kind: [] for kind in _KINDS}
        weakref.finalize(self, _free, dnnl, self.owned)

    def get(
        self, wanted: Handle, plain: tuple[Handle, torch.Tensor] | None
    ) -> tuple[Handle, torch.Tensor]:
        """The copy in layout ``wanted``, reordered from ``plain`` (or the first copy, where the
        caller has dropped its plain weight) if there is none yet."""
        dnnl = self.dnnl
        with self.lock:
            for copy in self.copies:
                if dnnl.same(copy[0], wanted):
                    return copy
            source_desc, source = plain if plain is not None else self.copies[0]
            target_desc = dnnl.clone(wanted)
            self.owned["memory_desc"].append(target_desc)
            element = torch.empty(0, dtype=source.dtype).element_size()
            target = torch.empty(dnnl.size(target_desc) // element, dtype=source.dtype)
            reorder_desc = dnnl.reorder(source_desc, target_desc)
            reorder = dnnl.primitive(reorder_desc)
            memories = [
                dnnl.memory(source_desc, source.data_ptr()),
                dnnl.memory(target_desc, target.data_ptr()),
            ]
            try:
                arguments = [(ARG_SRC, memories[0]), (ARG_DST, memories[1])]
                dnnl.execute(reorder, dnnl.arguments(arguments))
            finally:
                dnnl.destroy("primitive", reorder)
                dnnl.destroy("primitive_desc", reorder_desc)
                dnnl.destroy("memory", *memories)
            self.copies.append((target_desc, target))
            return target_desc, target


_KINDS = ("primitive", "primitive_desc", "memory", "memory_desc")


def _free(dnnl: Dnnl, owned: dict[str, list[Handle]]) -> None:
    for kind in _KINDS:
        dnnl.destroy(kind, *owned[kind])
