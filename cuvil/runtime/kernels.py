"""Kernel lookup: IR op name -> the callable that runs it, bound once when a plan is built.

``aten.*`` ops bind to ``torch.ops.aten`` overloads; Cuvil's own fused ops (``cuvil.*``) come
from a table that backends extend by passing their kernels in (nothing registers on import).
Literal arguments that stand for torch enums are decoded here too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from cuvil.dtypes import LAYOUTS, MEMORY_FORMATS, torch_dtype
from cuvil.ir import Enum

Kernel = Callable[..., Any]


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
