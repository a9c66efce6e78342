"""Cuvil's fused ops, declared once: name, arguments in order, and what each argument may hold.

The rewrite rules build fused nodes through ``fused_node`` (arguments by name, put in the
table's order), the IR verifier checks every ``cuvil.*`` node of a graph against the table (so a
graph from an artifact with an unknown fused op or a misplaced argument is refused before
anything runs), and every backend implements each op here or declares a fallback for it
(``tests/cuvil/backends/test_backends.py`` holds them to that).

A tensor argument holds a ``Value`` (or None where it is optional); a literal argument holds a
plain value of one of the listed kinds, or one of its ``choices``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace

import sympy

from cuvil.ir import Arg, Node, TensorType, Value

CONV2D = "cuvil.conv2d"
LINEAR = "cuvil.linear"
SWIGLU = "cuvil.swiglu"
RMS_NORM = "cuvil.rms_norm"
LAYER_NORM = "cuvil.layer_norm"
ROPE = "cuvil.rope"
ATTENTION = "cuvil.attention"
KV_CACHE_WRITE = "cuvil.kv_cache_write"
CACHED_ATTENTION = "cuvil.cached_attention"

# Epilogue activations a fused convolution or linear applies to its result.
ACTIVATIONS = ("none", "relu", "relu6", "silu", "gelu", "gelu_tanh", "hardswish", "tanh", "sigmoid")


@dataclass(frozen=True)
class Param:
    name: str
    tensor: bool  # a Value (tensor) or a literal
    optional: bool = False  # may be None
    kinds: tuple[type, ...] = ()  # literal kinds accepted
    choices: tuple[str, ...] = ()  # for a string literal: the values accepted

    def problem(self, arg: Arg) -> str | None:
        """Why ``arg`` cannot stand for this parameter, or None."""
        if arg is None:
            return None if self.optional else f"{self.name!r} is required"
        if self.tensor:
            return None if isinstance(arg, Value) else f"{self.name!r} must be a tensor value"
        if isinstance(arg, Value):
            return f"{self.name!r} must be a literal, not a tensor value"
        if self.kinds and not isinstance(arg, self.kinds):
            kinds = "/".join(kind.__name__ for kind in self.kinds)
            return f"{self.name!r} must be {kinds}, not {type(arg).__name__}"
        if self.choices and arg not in self.choices:
            return f"{self.name!r} is {arg!r}, not one of {list(self.choices)}"
        return None


def tensor(name: str, *, optional: bool = False) -> Param:
    return Param(name, tensor=True, optional=optional)


def literal(
    name: str, *kinds: type, optional: bool = False, choices: tuple[str, ...] = ()
) -> Param:
    return Param(name, tensor=False, optional=optional, kinds=kinds, choices=choices)


NUMBER = (int, float, sympy.Number)


@dataclass(frozen=True)
class FusedOp:
    name: str
    params: tuple[Param, ...]
    summary: str
    # The tensor argument the op writes in place and returns (its output aliases it), or None
    # for a pure op. The IR verifier holds such writes to graph inputs (ir_verify.py).
    writes: str | None = None

    @property
    def arg_names(self) -> tuple[str, ...]:
        return tuple(param.name for param in self.params)

    @property
    def tensor_args(self) -> tuple[str, ...]:
        return tuple(param.name for param in self.params if param.tensor)


FUSED_OPS: dict[str, FusedOp] = {
    op.name: op
    for op in (
        FusedOp(
            CONV2D,
            (
                tensor("input"),
                tensor("weight"),
                tensor("bias", optional=True),
                literal("stride", tuple),
                literal("padding", tuple),
                literal("dilation", tuple),
                literal("groups", int),
                literal("activation", str, choices=ACTIVATIONS),
                tensor("residual", optional=True),
            ),
            "activation(conv2d(input, weight, bias) + residual)",
        ),
        FusedOp(
            LINEAR,
            (
                tensor("input"),
                tensor("weight"),
                tensor("bias", optional=True),
                literal("activation", str, choices=ACTIVATIONS),
                tensor("residual", optional=True),
                tensor("weight_scale", optional=True),
            ),
            "activation(input @ weight.T + bias), or input @ weight.T + bias + residual; "
            "an int8 weight stands for weight * weight_scale[:, None]",
        ),
        FusedOp(
            SWIGLU,
            (
                tensor("input"),
                tensor("gate_up_weight"),
                literal("hidden", int),
                tensor("weight_scale", optional=True),
            ),
            "silu(input @ gate.T) * (input @ up.T), gate and up packed in one weight (int8 with "
            "weight_scale per output row, or float)",
        ),
        FusedOp(
            RMS_NORM,
            (tensor("input"), tensor("weight"), literal("eps", *NUMBER)),
            "input * rsqrt(mean(input^2, -1) + eps) * weight",
        ),
        FusedOp(
            LAYER_NORM,
            (
                tensor("input"),
                tensor("weight", optional=True),
                tensor("bias", optional=True),
                literal("eps", *NUMBER),
            ),
            "layer_norm over the last dim",
        ),
        FusedOp(
            ROPE,
            (tensor("input"), tensor("cos"), tensor("sin")),
            "input * cos + rotate_half(input) * sin",
        ),
        FusedOp(
            ATTENTION,
            (
                tensor("query"),
                tensor("key"),
                tensor("value"),
                tensor("mask", optional=True),
                literal("scale", *NUMBER, optional=True),
                literal("causal", bool),
                literal("gqa", bool),
            ),
            "softmax(query @ key.T * scale + mask) @ value, causal and grouped-query optional",
        ),
        FusedOp(
            KV_CACHE_WRITE,
            (tensor("cache"), tensor("new"), tensor("slots"), tensor("positions")),
            "cache[slots[b], :, positions[b] + t] = new[b, :, t], in place; returns cache",
            writes="cache",
        ),
        FusedOp(
            CACHED_ATTENTION,
            (
                tensor("query"),
                tensor("key_cache"),
                tensor("value_cache"),
                tensor("slots"),
                tensor("positions"),
                literal("scale", *NUMBER, optional=True),
            ),
            "causal attention of query[b] over cache[slots[b], :, :positions[b] + tokens], "
            "grouped-query when the cache has fewer heads",
        ),
    )
}


def in_place_ops() -> dict[str, str]:
    """op -> the argument it writes in place, for the ops that write one."""
    return {name: op.writes for name, op in FUSED_OPS.items() if op.writes is not None}


class FusedOpError(ValueError):
    """A fused node built against the table with unknown, missing or ill-typed arguments."""


def fused_node(
    op: str, name: str, args: Mapping[str, Arg], types: tuple[TensorType, ...], origin: str = ""
) -> Node:
    """A ``cuvil.*`` node with ``args`` in the table's order (absent optional ones as None)."""
    spec = FUSED_OPS.get(op)
    if spec is None:
        raise FusedOpError(f"{op} is not a fused op; fused ops: {sorted(FUSED_OPS)}")
    unknown = set(args) - set(spec.arg_names)
    if unknown:
        raise FusedOpError(f"{op} has no argument(s) {sorted(unknown)}")
    ordered = tuple((param.name, args.get(param.name)) for param in spec.params)
    node = Node(name, op, ordered, types, origin)
    problems = list(fused_op_problems(node))
    if problems:
        raise FusedOpError(f"%{name}: " + "; ".join(problems))
    return node


def with_absent_optionals(node: Node) -> Node:
    """A ``cuvil.*`` node written before the table gave its op trailing optional arguments
    (``weight_scale``), with those arguments as None; any other node as it is."""
    spec = FUSED_OPS.get(node.op)
    if spec is None or len(node.args) >= len(spec.params):
        return node
    names = tuple(name for name, _ in node.args)
    missing = spec.params[len(names) :]
    if names != spec.arg_names[: len(names)] or not all(param.optional for param in missing):
        return node
    return replace(node, args=(*node.args, *((param.name, None) for param in missing)))


def fused_op_problems(node: Node) -> Iterator[str]:
    """What is wrong with a ``cuvil.*`` node against the table (nothing for other ops)."""
    if not node.op.startswith("cuvil."):
        return
    spec = FUSED_OPS.get(node.op)
    if spec is None:
        yield f"unknown fused op {node.op}"
        return
    names = tuple(name for name, _ in node.args)
    if names != spec.arg_names:
        yield f"arguments {list(names)}, the table says {list(spec.arg_names)}"
        return
    for param, (_, arg) in zip(spec.params, node.args, strict=True):
        problem = param.problem(arg)
        if problem is not None:
            yield problem
