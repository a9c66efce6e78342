"""Normalisation and gated-MLP rules: LayerNorm, RMSNorm, SwiGLU, RoPE.

# layer_norm(x, [d], w, b, eps)                     -> cuvil.layer_norm(x, w, b, eps)
# w * ((x - mean(x)) / sqrt(var(x) + eps)) + b        -> cuvil.layer_norm(x, w, b, eps)
# w * (x * rsqrt(mean(x^2, -1) + eps))              -> cuvil.rms_norm(x, w, eps)
# silu(linear(x, Wg)) * linear(x, Wu)               -> cuvil.swiglu(x, [Wg; Wu])
# x*cos + cat(-x[..., d/2:], x[..., :d/2])*sin      -> cuvil.rope(x, cos, sin)
"""

from __future__ import annotations

import torch

from cuvil.fused_ops import LAYER_NORM, RMS_NORM, ROPE, SWIGLU, fused_node
from cuvil.ir import Node, Value
from cuvil.passes.program import const_node
from cuvil.passes.rewrite import L, Match, P, Rewriter, Rule, V

ADD, SUB, MUL, DIV = "aten.add.Tensor", "aten.sub.Tensor", "aten.mul.Tensor", "aten.div.Tensor"
MEAN, POW, RSQRT, SQRT = (
    "aten.mean.dim",
    "aten.pow.Tensor_Scalar",
    "aten.rsqrt.default",
    "aten.sqrt.default",
)
LINEAR, SILU = "aten.linear.default", "aten.silu.default"


def _new(match: Match, rewriter: Rewriter, base: str, op: str, args: tuple) -> Node:
    """The fused node replacing the match's root, its arguments checked against the table."""
    name = rewriter.names.fresh(base)
    return fused_node(op, name, dict(args), match.root.types, match.root.origin)


def _is_const_vector(match: Match, name: str) -> bool:
    tensor = match.const(name) if name in match.values else None
    return tensor is not None and tensor.dim() == 1


def _reduces_last_dim(node: Node, rank: int) -> bool:
    dims = node.arg("dim")
    return (
        isinstance(dims, tuple)
        and len(dims) == 1
        and int(dims[0]) % rank == rank - 1
        and bool(node.arg("keepdim", False))
    )


# ---------------------------------------------------------------- LayerNorm


def is_layer_norm(match: Match) -> bool:
    root = match.root
    shape = root.arg("normalized_shape")
    return isinstance(shape, tuple) and len(shape) == 1


def canonical_layer_norm(match: Match, rewriter: Rewriter) -> list[Node]:
    root = match.root
    args = (
        ("input", match.values["x"]),
        ("weight", root.arg("weight")),
        ("bias", root.arg("bias")),
        ("eps", root.float_arg("eps", 1e-5)),
    )
    return [_new(match, rewriter, "layer_norm", LAYER_NORM, args)]


def _decomposed_layer_norm() -> P:
    centred = P(
        SUB, {"self": V("x"), "other": P(MEAN, {"self": V("x")}, name="mean")}, name="centred"
    )
    variance = P(
        MEAN,
        {
            "self": P(POW, {"self": centred, "exponent": 2}),
        },
        name="var",
    )
    normed = P(
        DIV,
        {
            "self": centred,
            "other": P(SQRT, {"self": P(ADD, {"self": variance, "other": L("eps")})}),
        },
    )
    return P(ADD, {"self": P(MUL, {"self": V("w"), "other": normed}), "other": V("b")})


def is_decomposed_layer_norm(match: Match) -> bool:
    rank = match.program.graph.type_of(match.values["x"]).rank
    return (
        _reduces_last_dim(match.node("mean"), rank)
        and _reduces_last_dim(match.node("var"), rank)
        and _is_const_vector(match, "w")
        and _is_const_vector(match, "b")
        and isinstance(match.literals.get("eps"), float)
    )


def fuse_layer_norm(match: Match, rewriter: Rewriter) -> list[Node]:
    args = (
        ("input", match.values["x"]),
        ("weight", match.values["w"]),
        ("bias", match.values["b"]),
        ("eps", float(match.literals["eps"])),
    )
    return [_new(match, rewriter, "layer_norm", LAYER_NORM, args)]


rules_layer_norm = (
    Rule(
        "layer_norm",
        P("aten.layer_norm.default", {"input": V("x")}),
        canonical_layer_norm,
        is_layer_norm,
    ),
    Rule("layer_norm", _decomposed_layer_norm(), fuse_layer_norm, is_decomposed_layer_norm),
)

# ---------------------------------------------------------------- RMSNorm


def _rms_norm(weight_first: bool) -> P:
    mean = P(MEAN, {"self": P(POW, {"self": V("x"), "exponent": 2})}, name="mean")
    normed = P(
        MUL,
        {"self": V("x"), "other": P(RSQRT, {"self": P(ADD, {"self": mean, "other": L("eps")})})},
    )
    args = {"self": V("w"), "other": normed} if weight_first else {"self": normed, "other": V("w")}
    return P(MUL, args)


def is_rms_norm(match: Match) -> bool:
    rank = match.program.graph.type_of(match.values["x"]).rank
    return (
        _reduces_last_dim(match.node("mean"), rank)
        and _is_const_vector(match, "w")
        and isinstance(match.literals.get("eps"), float)
    )


def fuse_rms_norm(match: Match, rewriter: Rewriter) -> list[Node]:
    args = (
        ("input", match.values["x"]),
        ("weight", match.values["w"]),
        ("eps", float(match.literals["eps"])),
    )
    return [_new(match, rewriter, "rms_norm", RMS_NORM, args)]


rules_rms_norm = tuple(
    Rule("rms_norm", _rms_norm(first), fuse_rms_norm, is_rms_norm) for first in (True, False)
)

# ---------------------------------------------------------------- SwiGLU


def _swiglu(gate_first: bool) -> P:
    gate = P(SILU, {"self": P(LINEAR, {"input": V("x"), "weight": V("wg")}, name="gate")})
    up = P(LINEAR, {"input": V("x"), "weight": V("wu")}, name="up")
    return P(MUL, {"self": gate, "other": up} if gate_first else {"self": up, "other": gate})


def is_swiglu(match: Match) -> bool:
    gate, up = match.const("wg"), match.const("wu")
    no_bias = match.node("gate").arg("bias") is None and match.node("up").arg("bias") is None
    return (
        gate is not None
        and up is not None
        and gate.shape == up.shape
        and gate.dim() == 2
        and no_bias
    )


def fuse_swiglu(match: Match, rewriter: Rewriter) -> list[Node]:
    gate, up = match.const("wg"), match.const("wu")
    assert gate is not None and up is not None
    packed = torch.cat([gate, up], dim=0)
    key = rewriter.weight(f"{match.node('gate').name}_gate_up", packed)
    weight = const_node(rewriter.names.fresh(key), key, packed, match.root.origin)
    args = (
        ("input", match.values["x"]),
        ("gate_up_weight", weight.value()),
        ("hidden", int(gate.shape[0])),
    )
    return [weight, _new(match, rewriter, "swiglu", SWIGLU, args)]


rules_swiglu = tuple(
    Rule("swiglu", _swiglu(first), fuse_swiglu, is_swiglu) for first in (True, False)
)

# ---------------------------------------------------------------- RoPE


def _rope() -> P:
    upper = P("aten.slice.Tensor", {"self": V("x")}, name="upper")
    lower = P("aten.slice.Tensor", {"self": V("x")}, name="lower")
    rotated = P(
        "aten.cat.default", {"tensors": (P("aten.neg.default", {"self": upper}), lower)}, name="cat"
    )
    return P(
        ADD,
        {
            "self": P(MUL, {"self": V("x"), "other": V("cos")}),
            "other": P(MUL, {"self": rotated, "other": V("sin")}),
        },
    )


def is_rope(match: Match) -> bool:
    x_type = match.program.graph.type_of(match.values["x"])
    last = x_type.shape[-1]
    if not last.is_Integer or int(last) % 2:
        return False
    half, rank = int(last) // 2, x_type.rank
    upper, lower, cat = match.node("upper"), match.node("lower"), match.node("cat")

    def spans(node: Node, start: int, end: int) -> bool:
        dim = node.int_arg("dim", 0) % rank
        stop = node.arg("end")
        stop_ok = stop is not None and isinstance(stop, int) and (stop == end or stop >= 2**62)
        return (
            dim == rank - 1
            and node.arg("start", 0) in (start, None if start == 0 else start)
            and stop_ok
            and node.arg("step", 1) == 1
        )

    return (
        spans(upper, half, 2 * half)
        and spans(lower, 0, half)
        and cat.int_arg("dim", 0) % rank == rank - 1
    )


def fuse_rope(match: Match, rewriter: Rewriter) -> list[Node]:
    args = (
        ("input", match.values["x"]),
        ("cos", match.values["cos"]),
        ("sin", match.values["sin"]),
    )
    return [_new(match, rewriter, "rope", ROPE, args)]


rules_rope = (Rule("rope", _rope(), fuse_rope, is_rope),)

__all__ = ["Value", "rules_layer_norm", "rules_rms_norm", "rules_rope", "rules_swiglu"]
