"""Transformer-block rules: attention, GELU, LayerNorm, RMSNorm, SwiGLU, RoPE.

# softmax(q @ k^T * s + m) @ v           -> cuvil.attention(q, k, v, m, scale=s)
# sdpa(q, repeat_kv(k), repeat_kv(v))    -> cuvil.attention(q, k, v, gqa=True)
# sdpa(q, k, v, m)                       -> cuvil.attention(q, k, v, m)
# x*0.5 * (1 + erf(x/sqrt2))             -> gelu(x)
# x*0.5 * (1 + tanh(c*(x + a*x^3)))       -> gelu(x, tanh)
# x*0.5 * (1 + tanh(c*x * (1 + a*x*x)))   -> gelu(x, tanh)   (Bloom's and FastGELU's form)
# layer_norm(x, w, b) / its decomposition -> cuvil.layer_norm(x, w, b)
# w * (x * rsqrt(mean(x^2) + eps))       -> cuvil.rms_norm(x, w)
# silu(x @ Wg^T) * (x @ Wu^T)            -> cuvil.swiglu(x, [Wg; Wu])
# x*cos + cat(-x2, x1)*sin               -> cuvil.rope(x, cos, sin)
"""

from __future__ import annotations

import math

from cuvil.fused_ops import ATTENTION, fused_node
from cuvil.ir import Node
from cuvil.passes.rewrite import L, Match, P, Replacement, Rewriter, Rule, V

ADD, MUL, DIV = "aten.add.Tensor", "aten.mul.Tensor", "aten.div.Tensor"
MATMUL = "aten.matmul.default"
SOFTMAX = ("aten.softmax.int", "aten._softmax.default")
TRANSPOSE = "aten.transpose.int"
SDPA = "aten.scaled_dot_product_attention.default"
RESHAPE = ("aten._unsafe_view.default", "aten.view.default", "aten.reshape.default")


def _node(match: Match, rewriter: Rewriter, base: str, op: str, args: tuple) -> Node:
    """The fused node replacing the match's root, its arguments checked against the table."""
    name = rewriter.names.fresh(base)
    return fused_node(op, name, dict(args), match.root.types, match.root.origin)


# ---------------------------------------------------------------- attention


def _scores(scale_op: str | None) -> P:
    scores = P(MATMUL, {"self": V("q"), "other": P(TRANSPOSE, {"self": V("k")}, name="kt")})
    return (
        scores
        if scale_op is None
        else P(scale_op, {"self": scores, "other": L("scale")}, name="scaled")
    )


def _attention_patterns() -> list[P]:
    patterns = []
    for scale_op in (DIV, MUL, None):
        for masked in (True, False):
            logits = _scores(scale_op)
            if masked:
                logits = P(ADD, {"self": logits, "other": V("mask")})
            probs = P(SOFTMAX, {"self": logits}, name="softmax")
            patterns.append(P(MATMUL, {"self": probs, "other": V("v")}))
    return patterns


def is_attention(match: Match) -> bool:
    kt, softmax = match.node("kt"), match.node("softmax")
    rank = match.program.graph.type_of(match.values["k"]).rank
    swaps_last_two = {kt.int_arg("dim0") % rank, kt.int_arg("dim1") % rank} == {
        rank - 1,
        rank - 2,
    }
    last_dim = softmax.int_arg("dim") % rank in (rank - 1,)
    scale = match.literals.get("scale", 1.0)
    return swaps_last_two and last_dim and isinstance(scale, int | float) and rank == 4


def fuse_attention(match: Match, rewriter: Rewriter) -> list[Node]:
    scale = float(match.literals.get("scale", 1.0))
    if "scaled" in match.nodes and match.node("scaled").op == DIV:
        scale = 1.0 / scale
    args = (
        ("query", match.values["q"]),
        ("key", match.values["k"]),
        ("value", match.values["v"]),
        ("mask", match.values.get("mask")),
        ("scale", scale),
        ("causal", False),
        ("gqa", False),
    )
    return [_node(match, rewriter, "attention", ATTENTION, args)]


def _repeat_kv(name: str) -> P:
    expanded = P("aten.expand.default", {"self": P("aten.unsqueeze.default", {"self": V(name)})})
    return P(RESHAPE, {"self": P("aten.clone.default", {"self": expanded})})


def is_plain_sdpa(match: Match) -> bool:
    root = match.root
    return root.arg("dropout_p") in (None, 0, 0.0)


def fuse_sdpa(match: Match, rewriter: Rewriter) -> list[Node]:
    root = match.root
    gqa = "kv_k" in match.values or bool(root.arg("enable_gqa", False))
    args = (
        ("query", match.values["q"]),
        ("key", match.values.get("kv_k", match.values.get("k"))),
        ("value", match.values.get("kv_v", match.values.get("v"))),
        ("mask", root.arg("attn_mask")),
        ("scale", root.arg("scale")),
        ("causal", bool(root.arg("is_causal", False))),
        ("gqa", gqa),
    )
    return [_node(match, rewriter, "attention", ATTENTION, args)]


rules_attention = (
    *(
        Rule("attention", pattern, fuse_attention, is_attention)
        for pattern in _attention_patterns()
    ),
    Rule(
        "attention_gqa",
        P(SDPA, {"query": V("q"), "key": _repeat_kv("kv_k"), "value": _repeat_kv("kv_v")}),
        fuse_sdpa,
        is_plain_sdpa,
    ),
    Rule(
        "attention",
        P(SDPA, {"query": V("q"), "key": V("k"), "value": V("v")}),
        fuse_sdpa,
        is_plain_sdpa,
    ),
)

# ---------------------------------------------------------------- GELU

_HALF_X = (P(MUL, {"self": V("x"), "other": 0.5}), P(MUL, {"self": 0.5, "other": V("x")}))


def _gelu_erf() -> list[P]:
    inner = [
        P(MUL, {"self": V("x"), "other": L("c")}, name="inner"),
        P(DIV, {"self": V("x"), "other": L("c")}, name="inner"),
    ]
    out = []
    for half in _HALF_X:
        for scaled in inner:
            one_plus = P(ADD, {"self": P("aten.erf.default", {"self": scaled}), "other": L("one")})
            out.append(P(MUL, {"self": half, "other": one_plus}))
    return out


def _gelu_tanh() -> list[P]:
    cube = P(
        MUL,
        {
            "self": P("aten.pow.Tensor_Scalar", {"self": V("x"), "exponent": L("three")}),
            "other": L("a"),
        },
    )
    poly = P(ADD, {"self": V("x"), "other": cube})
    tanh = P("aten.tanh.default", {"self": P(MUL, {"self": poly, "other": L("c")})})
    return [
        P(MUL, {"self": half, "other": P(ADD, {"self": tanh, "other": L("one")})})
        for half in _HALF_X
    ]


def _gelu_tanh_factored() -> list[P]:
    """``tanh(c*x * (1 + a*x*x))``: the same polynomial with ``x`` factored out."""
    out = []
    for ax in (
        P(MUL, {"self": V("x"), "other": L("a")}),
        P(MUL, {"self": L("a"), "other": V("x")}),
    ):
        for square in (
            P(MUL, {"self": ax, "other": V("x")}),
            P(MUL, {"self": V("x"), "other": ax}),
        ):
            poly = P(ADD, {"self": square, "other": L("one_inner")})
            cx = P(MUL, {"self": V("x"), "other": L("c")})
            tanh = P("aten.tanh.default", {"self": P(MUL, {"self": cx, "other": poly})})
            out += [
                P(MUL, {"self": half, "other": P(ADD, {"self": tanh, "other": L("one")})})
                for half in _HALF_X
            ]
    return out


def is_gelu_tanh_factored(match: Match) -> bool:
    lit = match.literals
    return (
        lit.get("one") == 1
        and lit.get("one_inner") == 1
        and isinstance(lit.get("a"), float)
        and math.isclose(lit["a"], 0.044715, rel_tol=1e-4)
        and isinstance(lit.get("c"), float)
        and math.isclose(lit["c"], math.sqrt(2 / math.pi), rel_tol=1e-6)
    )


def is_gelu_erf(match: Match) -> bool:
    c, one = match.literals.get("c"), match.literals.get("one")
    if not isinstance(c, int | float) or one != 1:
        return False
    factor = c if match.node("inner").op == MUL else 1.0 / c
    return math.isclose(factor, 1 / math.sqrt(2), rel_tol=1e-6)


def is_gelu_tanh(match: Match) -> bool:
    lit = match.literals
    return (
        lit.get("three") == 3
        and lit.get("one") == 1
        and isinstance(lit.get("a"), float)
        and math.isclose(lit["a"], 0.044715, rel_tol=1e-4)
        and math.isclose(float(lit.get("c", 0.0)), math.sqrt(2 / math.pi), rel_tol=1e-6)
    )


def to_gelu(approximate: str) -> Replacement:
    def build(match: Match, rewriter: Rewriter) -> list[Node]:
        args = (("self", match.values["x"]), ("approximate", approximate))
        name = rewriter.names.fresh("gelu")
        return [Node(name, "aten.gelu.default", args, match.root.types, match.root.origin)]

    return build


rules_gelu = (
    *(Rule("gelu_erf", p, to_gelu("none"), is_gelu_erf) for p in _gelu_erf()),
    *(Rule("gelu_tanh", p, to_gelu("tanh"), is_gelu_tanh) for p in _gelu_tanh()),
    *(Rule("gelu_tanh", p, to_gelu("tanh"), is_gelu_tanh_factored) for p in _gelu_tanh_factored()),
)
