"""Kernel lookup: IR op name -> the callable that runs it, bound once when a plan is built.

``aten.*`` ops bind to ``torch.ops.aten`` overloads; Cuvil's own fused ops (``cuvil.*``) come
from the backend's factories (``FusedCall`` in, ``PreparedKernel`` out; nothing registers on
import). Literal arguments that stand for torch enums are decoded here too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from cuvil.dtypes import LAYOUTS, MEMORY_FORMATS, torch_dtype
from cuvil.ir import Enum

Kernel = Callable[..., Any]
# A kernel's native form: given the run-time arguments of one call, the calls a native plan loop
# makes instead (the backend's own call types), or None where this call has no native form.
NativeForm = Callable[[tuple[Any, ...]], Sequence[Any] | None]


class KernelChoices(Protocol):
    """A choice a kernel makes per shape bucket at run time (e.g. which GEMM path is fastest
    on this machine), reported and preset through the plan."""

    def trial_calls(self) -> dict[int, int]:
        """bucket -> calls so far, for the buckets still deciding."""
        ...

    def preset(self, choices: Mapping[int, str]) -> int:
        """Take choices made before (bucket -> name); returns how many were taken."""
        ...

    def describe(self) -> dict[int, str]:
        """bucket -> the name chosen, or ``timing`` while still deciding."""
        ...


@dataclass(frozen=True)
class PreparedKernel:
    """What a fused op's factory returns: the function the plan calls with the run-time
    arguments, the per-shape choice it still makes (None for a kernel with one path), and its
    native form, where the backend runs plans in native code."""

    run: Kernel
    choices: KernelChoices | None = None
    native: NativeForm | None = None  # what a backend's native plan loop may call instead


@dataclass(frozen=True)
class FusedCall:
    """What a factory is told about one fused node when a plan is built."""

    op: str
    node: str
    constants: Mapping[str, Any]  # weights as tensors, literals as values, absent args as None
    runtime: tuple[str, ...]  # the arguments passed at run time, in the order they come
    # static sizes of the run-time arguments (None for a dynamic dim), so kernels can pick layouts
    sizes: Mapping[str, tuple[int | None, ...]] = field(default_factory=dict)
    # the node may write its output over its residual (nothing reads it later: runtime/donation)
    residual_donated: bool = False
    # IR dtype names ("f32", "bf16") of the run-time arguments, and of the node's result
    dtypes: Mapping[str, str] = field(default_factory=dict)
    output_dtype: str = "f32"

    def arg(self, name: str, default: Any = None) -> Any:
        value = self.constants.get(name)
        return default if value is None else value

    def is_runtime(self, name: str) -> bool:
        return name in self.runtime

    def check_runtime(self, allowed: Sequence[str]) -> None:
        """Refuse run-time values where the kernel needs a constant (e.g. a computed weight)."""
        unexpected = [name for name in self.runtime if name not in allowed]
        if unexpected:
            raise ValueError(f"arguments {unexpected} must be constants for {self.op}")


KernelFactory = Callable[[FusedCall], PreparedKernel]


class UnknownKernelError(LookupError):
    pass


def resolve_aten(op: str) -> torch._ops.OpOverload:
    """``aten.linear.default`` -> ``torch.ops.aten.linear.default`` (aten namespace only)."""
    parts = op.split(".")
    if len(parts) != 3 or parts[0] != "aten":
        raise UnknownKernelError(f"not an aten overload name: {op!r}")
    try:
        packet = getattr(torch.ops.aten, parts[1])
        overload = getattr(packet, parts[2])
    except (AttributeError, RuntimeError):
        raise UnknownKernelError(f"this torch ({torch.__version__}) has no op {op}") from None
    if overload._schema.is_mutable:
        raise UnknownKernelError(f"refusing mutating op {op}")
    return overload


def resolve_kernel(op: str, extra: Mapping[str, Kernel]) -> Kernel:
    if op in extra:
        return extra[op]
    if op.startswith("aten."):
        return resolve_aten(op)
    raise UnknownKernelError(f"no kernel for op {op!r}")


def decode_enum(enum: Enum, device: torch.device) -> Any:
    """The torch object an Enum literal stands for; devices map to the plan's device."""
    if enum.kind == "dtype":
        return torch_dtype(enum.name)
    if enum.kind == "device":
        return device
    if enum.kind == "memory_format":
        return MEMORY_FORMATS[enum.name]
    if enum.kind == "layout":
        return LAYOUTS[enum.name]
    raise UnknownKernelError(f"unknown enum kind {enum.kind!r}")


def call_layout(op: Kernel) -> tuple[list[str], set[str], dict[str, Any]]:
    """For an aten overload: positional argument names, keyword-only names, defaults."""
    schema = getattr(op, "_schema", None)
    if schema is None:
        return [], set(), {}
    positional = [a.name for a in schema.arguments if not a.kwarg_only]
    keyword_only = {a.name for a in schema.arguments if a.kwarg_only}
    defaults = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    return positional, keyword_only, defaults
