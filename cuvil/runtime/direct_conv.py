"""``cuvil.conv2d`` on oneDNN primitives kept across calls (runtime/dnnl.py), channels-last.

One primitive per input shape, built on its first call (or at load, for the shape the model was
compiled for) with the activation and any residual add as post-ops; the weight is packed into the
blocked layout that primitive asks for, once per distinct layout, from the first packed copy (no
plain copy is kept). A call binds the input, output and residual pointers and executes: about
10 us of Python and ctypes, where ATen's call rebuilds the descriptor (about 50 us).

The memory objects that carry those pointers are per thread, so threads may run one model at
once. Past ``MAX_SHAPES`` input shapes (image sizes are rarely that many) a shape takes ATen's
path instead of growing the cache without bound.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from cuvil.runtime.dnnl import (
    ARG_BIAS,
    ARG_DST,
    ARG_SCRATCHPAD,
    ARG_SRC,
    ARG_WEIGHTS,
    Dnnl,
    Handle,
    post_op_source,
)

MAX_SHAPES = 64


def channels_last_strides(shape: Sequence[int]) -> list[int]:
    _, channels, height, width = shape
    return [channels * height * width, 1, width * channels, channels]


def _output_shape(
    x_shape: Sequence[int],
    weight_shape: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
) -> tuple[int, int, int, int]:
    spatial = [
        (size + 2 * pad - dil * (kernel - 1) - 1) // step + 1
        for size, kernel, step, pad, dil in zip(
            x_shape[2:], weight_shape[2:], stride, padding, dilation, strict=True
        )
    ]
    return int(x_shape[0]), int(weight_shape[0]), spatial[0], spatial[1]


@dataclass
class _Primitive:
    """One input shape's primitive, what it writes, and each thread's bound arguments."""

    handle: Handle
    output_shape: tuple[int, int, int, int]
    src: Handle
    dst: Handle
    residual: Handle | None
    weight: Handle
    bias: Handle | None
    scratchpad: Handle
    scratchpad_size: int
    local: threading.local = field(default_factory=threading.local)


class DirectConv:
    """activation(conv(x) [+ residual]) for a constant fp32 weight and bias."""

    def __init__(
        self,
        dnnl: Dnnl,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        geometry: tuple[list[int], list[int], list[int], int],
        activation: str,
        residual: bool,
    ) -> None:
        self.dnnl = dnnl
        self.stride, self.padding, self.dilation, self.groups = geometry
        self.activation = activation
        self.has_residual = residual
        self.weight_shape = tuple(int(size) for size in weight.shape)
        self.bias = bias.float().contiguous() if bias is not None else None
        self.primitives: dict[tuple[int, ...], _Primitive] = {}
        self.owned: dict[str, list[Handle]] = {
            "primitive": [],
            "primitive_desc": [],
            "memory": [],
            "memory_desc": [],
        }
        # packed weights, by layout: (descriptor, tensor); the first one is every later's source
        dims = self._weight_dims()
        plain = self._own("memory_desc", dnnl.strided_desc(dims, _contiguous_strides(dims)))
        self.packs: list[tuple[Handle, torch.Tensor]] = [(plain, weight.float().contiguous())]
        self.plain_kept = True
        self.implementations: dict[tuple[int, ...], str] = {}
        weakref.finalize(self, _free, dnnl, self.owned)

    def _own(self, kind: str, handle: Handle) -> Handle:
        self.owned[kind].append(handle)
        return handle

    def _weight_dims(self) -> list[int]:
        out_channels, in_per_group, *kernel = self.weight_shape
        if self.groups == 1:
            return [out_channels, in_per_group, *kernel]
        return [self.groups, out_channels // self.groups, in_per_group, *kernel]

    def can_run(self, shape: Sequence[int]) -> bool:
        return len(self.primitives) < MAX_SHAPES or (
            (*shape, torch.get_num_threads()) in self.primitives
        )

    def prepare(self, shape: Sequence[int]) -> _Primitive:
        """The primitive for inputs of ``shape`` (built and its weight packed if new)."""
        # oneDNN splits the work for the thread count at creation and keeps that split
        key = (*(int(size) for size in shape), torch.get_num_threads())
        found = self.primitives.get(key)
        if found is not None:
            return found
        dnnl = self.dnnl
        dims = key[:4]
        output_shape = _output_shape(
            dims, self.weight_shape, self.stride, self.padding, self.dilation
        )
        src = self._own("memory_desc", dnnl.strided_desc(dims, channels_last_strides(dims)))
        dst = self._own(
            "memory_desc", dnnl.strided_desc(output_shape, channels_last_strides(output_shape))
        )
        weights = self._own("memory_desc", dnnl.any_desc(self._weight_dims()))
        bias = None
        if self.bias is not None:
            bias = self._own("memory_desc", dnnl.strided_desc([self.weight_shape[0]], [1]))
        attr = dnnl.attributes(dst if self.has_residual else None, self.activation)
        try:
            descriptor = dnnl.convolution(
                src, weights, bias, dst, self.stride, self.dilation, self.padding, attr
            )
        finally:
            dnnl.destroy("primitive_attr", attr)
        self._own("primitive_desc", descriptor)
        handle = self._own("primitive", dnnl.primitive(descriptor))
        packed = self._packed(dnnl.argument_desc(descriptor, ARG_WEIGHTS))
        self.implementations[key] = dnnl.implementation(descriptor)
        scratchpad = dnnl.argument_desc(descriptor, ARG_SCRATCHPAD)
        primitive = _Primitive(
            handle=handle,
            output_shape=output_shape,
            src=src,
            dst=dst,
            residual=dst if self.has_residual else None,
            weight=self._own("memory", dnnl.memory(packed[0], packed[1].data_ptr())),
            bias=(
                self._own("memory", dnnl.memory(bias, self.bias.data_ptr()))
                if bias is not None and self.bias is not None
                else None
            ),
            scratchpad=scratchpad,
            scratchpad_size=dnnl.size(scratchpad),
        )
        self.primitives[key] = primitive
        return primitive

    def _packed(self, wanted: Handle) -> tuple[Handle, torch.Tensor]:
        for pack in self.packs:
            if self.dnnl.same(pack[0], wanted):
                return pack
        dnnl = self.dnnl
        source_desc, source = self.packs[0]
        target_desc = self._own("memory_desc", dnnl.clone(wanted))
        target = torch.empty(dnnl.size(target_desc) // 4, dtype=torch.float32)
        reorder_desc = dnnl.reorder(source_desc, target_desc)
        reorder = dnnl.primitive(reorder_desc)
        memories = [
            dnnl.memory(source_desc, source.data_ptr()),
            dnnl.memory(target_desc, target.data_ptr()),
        ]
        try:
            dnnl.execute(reorder, dnnl.arguments([(ARG_SRC, memories[0]), (ARG_DST, memories[1])]))
        finally:
            dnnl.destroy("primitive", reorder)
            dnnl.destroy("primitive_desc", reorder_desc)
            dnnl.destroy("memory", *memories)
        if self.plain_kept:  # the plain weight is dropped once a packed copy exists
            self.packs[0] = (target_desc, target)
            self.plain_kept = False
        else:
            self.packs.append((target_desc, target))
        return target_desc, target

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """The result, or None for a residual of another shape (a broadcast add)."""
        x = x.contiguous(memory_format=torch.channels_last)
        primitive = self.prepare(x.shape)
        if residual is not None and residual.shape != primitive.output_shape:
            return None
        out = torch.empty(primitive.output_shape, memory_format=torch.channels_last)
        bound = getattr(primitive.local, "bound", None)
        if bound is None:
            bound = self._bind(primitive)
        set_pointer = self.dnnl.lib.dnnl_memory_set_data_handle
        src, dst, extra, scratchpad, stream, arguments = bound
        set_pointer(src, x.data_ptr())
        set_pointer(dst, out.data_ptr())
        if extra is not None and residual is not None:
            residual = residual.contiguous(memory_format=torch.channels_last)  # held until run
            set_pointer(extra, residual.data_ptr())
        if primitive.scratchpad_size:
            set_pointer(scratchpad, self.dnnl.scratchpad(primitive.scratchpad_size))
        self.dnnl.execute(primitive.handle, arguments, stream)
        return out

    def _bind(self, primitive: _Primitive) -> tuple[Any, ...]:
        """This thread's memory objects for the primitive's run-time arguments, and its stream."""
        dnnl = self.dnnl
        src = self._own("memory", dnnl.memory(primitive.src, None))
        dst = self._own("memory", dnnl.memory(primitive.dst, None))
        scratchpad = self._own("memory", dnnl.memory(primitive.scratchpad, None))
        pairs = [
            (ARG_SRC, src),
            (ARG_WEIGHTS, primitive.weight),
            (ARG_DST, dst),
            (ARG_SCRATCHPAD, scratchpad),
        ]
        if primitive.bias is not None:
            pairs.append((ARG_BIAS, primitive.bias))
        extra = None
        if primitive.residual is not None:
            extra = self._own("memory", dnnl.memory(primitive.residual, None))
            pairs.append((post_op_source(0), extra))
        bound = (src, dst, extra, scratchpad, dnnl.stream(), dnnl.arguments(pairs))
        primitive.local.bound = bound
        return bound


def _contiguous_strides(dims: Sequence[int]) -> list[int]:
    strides = [1] * len(dims)
    for i in range(len(dims) - 2, -1, -1):
        strides[i] = strides[i + 1] * int(dims[i + 1])
    return strides


def _free(dnnl: Dnnl, owned: dict[str, list[Handle]]) -> None:
    for kind in ("primitive", "primitive_desc", "memory", "memory_desc"):
        dnnl.destroy(kind, *owned[kind])


def direct_conv(
    dnnl: Dnnl,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    geometry: tuple[list[int], list[int], list[int], int],
    activation: str,
    residual: bool,
    fallback: Callable[..., torch.Tensor],
) -> Callable[..., torch.Tensor]:
    """The kernel: DirectConv, and ``fallback`` (ATen's oneDNN call) for shapes past the cache."""
    conv = DirectConv(dnnl, weight, bias, geometry, activation, residual)

    def run(x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        if conv.can_run(x.shape):
            out = conv(x, *rest)
            if out is not None:
                return out
        return fallback(x, *rest)

    run.direct = conv  # type: ignore[attr-defined]
    return run
