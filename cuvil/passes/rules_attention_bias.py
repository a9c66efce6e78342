"""Attention whose scores carry an additive bias before the softmax, written out by hand:
ALiBi over ``[batch*heads]`` rows with ``baddbmm`` (Bloom), and a bias added to the scaled
scores with a boolean mask filled in after (MPT's ALiBi; DistilBERT-style masked scores).

    # bmm(view(softmax(view(baddbmm(b, q, k^T, alpha=s)) + m)), v)
    #     -> reshape(cuvil.attention(q4, k4, v4, reshape(b, [B, H, ...]) + m, scale=s))
    # softmax(masked_fill(q @ k^T * s + b, keep, fill)) @ v
    #     -> cuvil.attention(q, k, v, where(keep, fill, b), scale=s)
    # softmax(masked_fill(q @ k^T * s, keep, fill)) @ v
    #     -> cuvil.attention(q, k, v, where(keep, fill, 0), scale=s)

``q4``, ``k4``, ``v4`` are the ``[B, H, S, D]`` tensors the ``[B*H, S, D]`` operands were
reshaped from (the copy that reshape needed becomes dead), or a reshape of the operands where no
such tensor is at hand. Filling with a very negative value and adding it are the same logits:
for ``|fill| >= 1e30`` a float32 score smaller than ``1e24`` in magnitude is below half an ulp
of the fill, so ``score + fill`` rounds to ``fill`` exactly, and ``-inf`` stays ``-inf``.
"""

from __future__ import annotations

import sympy

from cuvil.fused_ops import ATTENTION, fused_node
from cuvil.ir import Arg, Enum, Node, TensorType, Value
from cuvil.passes.rewrite import L, Match, P, Rewriter, Rule, V
from cuvil.passes.rules_transformer import ADD, MATMUL, RESHAPE, SOFTMAX, TRANSPOSE, _scores
from cuvil.passes.rules_transformer import is_attention as _is_plain_attention

BADDBMM = "aten.baddbmm.default"
BMM = "aten.bmm.default"
CLONE = "aten.clone.default"
# operands and results are reshaped, not viewed: SDPA may return a transposed layout
RESHAPE_OP = "aten.reshape.default"
MASKED_FILL = "aten.masked_fill.Scalar"
WHERE_SCALAR_SELF = "aten.where.ScalarSelf"
WHERE_SCALAR = "aten.where.Scalar"
SMALLEST_FILL = -1e30  # see the module docstring


def _sizes(shape: tuple[sympy.Expr, ...]) -> tuple[Arg, ...]:
    return tuple(int(dim) if dim.is_Integer else dim for dim in shape)


def _view(rewriter: Rewriter, base: str, value: Value, type_: TensorType, origin: str) -> Node:
    args = (("self", value), ("shape", _sizes(type_.shape)))
    return Node(rewriter.names.fresh(base), RESHAPE_OP, args, (type_,), origin)


def broadcast_shape(
    left: tuple[sympy.Expr, ...], right: tuple[sympy.Expr, ...]
) -> tuple[sympy.Expr, ...] | None:
    """The broadcast of two shapes, or None where two dims differ and neither is 1."""
    rank = max(len(left), len(right))
    padded = [(sympy.Integer(1),) * (rank - len(s)) + tuple(s) for s in (left, right)]
    out = []
    for a, b in zip(*padded, strict=True):
        if a == 1 or a == b:
            out.append(b)
        elif b == 1:
            out.append(a)
        else:
            return None
    return tuple(out)


def as_broadcast_into(
    shape: tuple[sympy.Expr, ...], result: tuple[sympy.Expr, ...]
) -> tuple[sympy.Expr, ...]:
    """``shape``, known to broadcast into ``result``, with each dim that is not 1 written as
    ``result``'s (a sliced table's ``2048 - Max(0, 2048 - seq)`` becomes ``seq``)."""
    offset = len(result) - len(shape)
    return tuple(dim if dim == 1 else result[offset + i] for i, dim in enumerate(shape))


# ---------------------------------------------------------------- ALiBi with baddbmm


def _alibi_bmm(masked: bool) -> P:
    scores = P(
        BADDBMM,
        {"self": V("bias"), "batch1": V("q"), "batch2": P(TRANSPOSE, {"self": V("k")}, name="kt")},
        name="scores",
    )
    logits: P = P(RESHAPE, {"self": scores}, name="heads")
    if masked:
        logits = P(ADD, {"self": logits, "other": V("mask")}, name="add")
    probs = P(SOFTMAX, {"self": logits}, name="softmax")
    return P(BMM, {"self": P(RESHAPE, {"self": probs}, name="rows"), "mat2": V("v")}, name="bmm")


def _softmax_keeps_dtype(softmax: Node) -> bool:
    dtype = softmax.arg("dtype")
    return dtype is None or (isinstance(dtype, Enum) and dtype.name == softmax.type.dtype)


def _same(a: sympy.Expr, b: sympy.Expr) -> bool:
    return bool(sympy.simplify(a - b) == 0)


def is_alibi_attention(match: Match) -> bool:
    """Three-dim ``[B*H, S, D]`` operands, the scores viewed as ``[B, H, S, S]`` and back, a
    bias of ``B*H`` rows added unscaled (``beta`` 1), and a softmax over keys in fp32."""
    graph = match.program.graph
    scores, heads, rows = match.node("scores"), match.node("heads"), match.node("rows")
    kt, softmax, bmm = match.node("kt"), match.node("softmax"), match.node("bmm")
    q, k, v, bias = (graph.type_of(match.values[n]) for n in ("q", "k", "v", "bias"))
    if any(t.rank != 3 or t.dtype != "f32" for t in (q, k, v, bias)):
        return False
    if {kt.int_arg("dim0") % 3, kt.int_arg("dim1") % 3} != {1, 2}:
        return False
    if heads.type.rank != 4 or rows.type != scores.type or softmax.int_arg("dim") % 4 != 3:
        return False
    b, h, s, t = heads.type.shape
    if not _same(b * h, scores.type.shape[0]) or (s, t) != tuple(scores.type.shape[1:]):
        return False
    if not _same(bias.shape[0], b * h) or not _softmax_keeps_dtype(softmax):
        return False
    if not isinstance(scores.arg("alpha", 1), int | float) or scores.arg("beta", 1) != 1:
        return False
    if "add" in match.nodes:
        mask = graph.type_of(match.values["mask"])
        add = match.node("add")
        if add.arg("alpha", 1) != 1 or broadcast_shape(mask.shape, heads.type.shape) is None:
            return False
        if add.type != heads.type or mask.dtype != "f32":
            return False
    return bmm.type == TensorType(v.dtype, (scores.type.shape[0], s, v.shape[2]))


def _heads_of(match: Match, value: Value, heads: TensorType) -> Value | None:
    """The ``[B, H, S, D]`` tensor a ``[B*H, S, D]`` operand was reshaped from, if any."""
    graph = match.program.graph
    node = graph.by_name[value.node]
    if value.index != 0 or node.op not in RESHAPE:
        return None
    source = node.arg("self")
    if not isinstance(source, Value):
        return None
    producer = graph.by_name[source.node]
    if producer.op == CLONE and source.index == 0:
        inner = producer.arg("self")
        source = inner if isinstance(inner, Value) else source
    shape = graph.type_of(source).shape
    wanted = (*heads.shape[:2], *graph.type_of(value).shape[1:])
    return source if len(shape) == 4 and tuple(shape) == wanted else None


def fuse_alibi_attention(match: Match, rewriter: Rewriter) -> list[Node]:
    graph = match.program.graph
    heads, bmm = match.node("heads").type, match.node("bmm")
    origin = bmm.origin
    b, h = heads.shape[:2]
    nodes: list[Node] = []
    operands: dict[str, Value] = {}
    for name in ("q", "k", "v"):
        value = match.values[name]
        found = _heads_of(match, value, heads)
        if found is None:
            t = graph.type_of(value)
            view = _view(
                rewriter, f"{name}_heads", value, TensorType(t.dtype, (b, h, *t.shape[1:])), origin
            )
            nodes.append(view)
            found = view.value()
        operands[name] = found
    bias = graph.type_of(match.values["bias"])
    bias_heads = _view(
        rewriter,
        "alibi_heads",
        match.values["bias"],
        TensorType(bias.dtype, (b, h, *bias.shape[1:])),
        origin,
    )
    nodes.append(bias_heads)
    mask: Value = bias_heads.value()
    if "add" in match.nodes:
        mask_type = graph.type_of(match.values["mask"])
        shape = broadcast_shape(bias_heads.type.shape, mask_type.shape)
        assert shape is not None
        combined = Node(
            rewriter.names.fresh("alibi_mask"),
            ADD,
            (("self", mask), ("other", match.values["mask"])),
            (TensorType("f32", shape),),
            origin,
        )
        nodes.append(combined)
        mask = combined.value()
    q = graph.type_of(operands["q"])
    v = graph.type_of(operands["v"])
    out_type = TensorType(v.dtype, (*q.shape[:3], v.shape[3]))
    args = {
        "query": operands["q"],
        "key": operands["k"],
        "value": operands["v"],
        "mask": mask,
        "scale": match.node("scores").float_arg("alpha", 1.0),
        "causal": False,
        "gqa": False,
    }
    attention = fused_node(ATTENTION, rewriter.names.fresh("attention"), args, (out_type,), origin)
    nodes.append(attention)
    if match.root is not bmm and match.root.type == out_type:
        return nodes  # the view back to heads was the root: the attention's output is it
    nodes.append(_view(rewriter, "attention_rows", attention.value(), match.root.type, origin))
    return nodes


# ---------------------------------------------------------------- filled scores


def _filled_patterns(biased: bool) -> list[P]:
    patterns = []
    for scale_op in ("aten.div.Tensor", "aten.mul.Tensor", None):
        logits = _scores(scale_op)
        if biased:
            logits = P(ADD, {"self": logits, "other": V("bias")}, name="add")
        filled = P(
            MASKED_FILL, {"self": logits, "mask": V("keep"), "value": L("fill")}, name="fill"
        )
        probs = P(SOFTMAX, {"self": filled}, name="softmax")
        patterns.append(P(MATMUL, {"self": probs, "other": V("v")}))
    return patterns


def is_filled_attention(match: Match) -> bool:
    """Plain attention scores (see ``rules_transformer.is_attention``), a float bias of a
    broadcastable shape, a boolean mask, and a fill too negative for a score to show through."""
    if not _is_plain_attention(match):
        return False
    graph = match.program.graph
    fill = match.literals.get("fill")
    keep = graph.type_of(match.values["keep"])
    if not isinstance(fill, int | float) or fill > SMALLEST_FILL or keep.dtype != "bool":
        return False
    logits = match.node("fill").type
    if logits.dtype != "f32" or broadcast_shape(keep.shape, logits.shape) != logits.shape:
        return False
    if "add" in match.nodes:
        bias = graph.type_of(match.values["bias"])
        add = match.node("add")
        # the add's own type is the broadcast it computed: the bias fits into the logits
        return add.arg("alpha", 1) == 1 and bias.dtype == "f32" and add.type == logits
    return True


def fuse_filled_attention(match: Match, rewriter: Rewriter) -> list[Node]:
    graph = match.program.graph
    keep, fill = match.values["keep"], float(match.literals["fill"])
    root = match.root
    if "add" in match.nodes:
        bias = match.values["bias"]
        logits = match.node("fill").type.shape
        bias_shape = as_broadcast_into(graph.type_of(bias).shape, logits)
        shape = broadcast_shape(graph.type_of(keep).shape, bias_shape)
        args: tuple = (("condition", keep), ("self", fill), ("other", bias))
        op = WHERE_SCALAR_SELF
    else:
        shape = graph.type_of(keep).shape
        args, op = (("condition", keep), ("self", fill), ("other", 0.0)), WHERE_SCALAR
    assert shape is not None
    mask = Node(
        rewriter.names.fresh("filled_mask"), op, args, (TensorType("f32", shape),), root.origin
    )
    scale = float(match.literals.get("scale", 1.0))
    if "scaled" in match.nodes and match.node("scaled").op == "aten.div.Tensor":
        scale = 1.0 / scale
    attention_args = {
        "query": match.values["q"],
        "key": match.values["k"],
        "value": match.values["v"],
        "mask": mask.value(),
        "scale": scale,
        "causal": False,
        "gqa": False,
    }
    name = rewriter.names.fresh("attention")
    return [mask, fused_node(ATTENTION, name, attention_args, root.types, root.origin)]


rules_attention_bias = (
    *(
        Rule(
            "attention_alibi",
            P(RESHAPE, {"self": _alibi_bmm(masked)}),
            fuse_alibi_attention,
            is_alibi_attention,
        )
        for masked in (True, False)
    ),
    *(
        Rule("attention_alibi", _alibi_bmm(masked), fuse_alibi_attention, is_alibi_attention)
        for masked in (True, False)
    ),
    *(
        Rule("attention_filled", pattern, fuse_filled_attention, is_filled_attention)
        for biased in (True, False)
        for pattern in _filled_patterns(biased)
    ),
)
