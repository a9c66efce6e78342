"""Bias-free linears written as a matmul on a constant weight become linears, so the linear
rules (bias, activation and residual epilogues, sibling GEMMs, tactics, bf16) apply to them.
Falcon's ``FalconLinear`` computes ``x @ W.T + b``; other models keep a weight as
``[in, out]`` and multiply by it directly.

    # matmul(x, transpose(W))  -> linear(x, W)          (W a constant [out, in])
    # matmul(x, W)             -> linear(x, W^T)        (W a constant [in, out])
    # linear(x, W) + b         -> linear(x, W, b)       (b a constant of the output width)

Runs with the other constant folds, before the epilogue fusion takes the layers.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from cuvil.ir import Node, Value
from cuvil.passes.program import const_node
from cuvil.passes.rewrite import Match, P, Rewriter, Rule, V

MATMUL = "aten.matmul.default"
LINEAR = "aten.linear.default"
ADD = "aten.add.Tensor"
TRANSPOSES = ("aten.permute.default", "aten.transpose.int", "aten.t.default")


def _const(match: Match, value: object) -> torch.Tensor | None:
    return match.program.const_tensor(value) if isinstance(value, Value) else None


def _is_floating_matrix(tensor: torch.Tensor | None) -> bool:
    return tensor is not None and tensor.dim() == 2 and tensor.is_floating_point()


def _swaps_two_dims(node: Node) -> bool:
    if node.op == "aten.t.default":
        return True
    if node.op == "aten.permute.default":
        dims = node.arg("dims")
        return isinstance(dims, tuple) and dims in ((1, 0), (-1, -2), (1, -2), (-1, 0))
    return {node.int_arg("dim0") % 2, node.int_arg("dim1") % 2} == {0, 1}


def _rows_operand(match: Match) -> bool:
    x = match.program.graph.type_of(match.values["x"])
    return x.rank >= 2 and x.dtype == match.root.type.dtype


def is_matmul_by_transposed_weight(match: Match) -> bool:
    """``x @ W.T`` for a constant 2-D ``W`` of ``x``'s dtype, ``x`` of rank two or more."""
    weight = _const(match, match.values["w"])
    return (
        _is_floating_matrix(weight) and _swaps_two_dims(match.node("wt")) and _rows_operand(match)
    )


def matmul_as_linear(match: Match, rewriter: Rewriter) -> list[Node]:
    root = match.root
    args = (("input", match.values["x"]), ("weight", match.values["w"]), ("bias", None))
    return [
        Node(rewriter.names.fresh(f"{root.name}_linear"), LINEAR, args, root.types, root.origin)
    ]


def is_matmul_by_weight(match: Match) -> bool:
    """``x @ W`` for a constant 2-D ``W`` (stored ``[in, out]``)."""
    return _is_floating_matrix(_const(match, match.values["w"])) and _rows_operand(match)


def matmul_by_weight_as_linear(match: Match, rewriter: Rewriter) -> list[Node]:
    root = match.root
    weight = _const(match, match.values["w"])
    assert weight is not None
    transposed = weight.t().contiguous()
    key = rewriter.weight(f"{root.name}_weight", transposed)
    w_node = const_node(rewriter.names.fresh(key), key, transposed, root.origin)
    args = (("input", match.values["x"]), ("weight", w_node.value()), ("bias", None))
    name = rewriter.names.fresh(f"{root.name}_linear")
    return [w_node, Node(name, LINEAR, args, root.types, root.origin)]


def is_bias_add(match: Match) -> bool:
    """A plain add of a constant 1-D bias of the output width to a bias-free linear."""
    layer, add = match.node("layer"), match.root
    bias = _const(match, match.values["b"])
    width = layer.type.shape[-1]
    return (
        layer.arg("bias") is None
        and add.arg("alpha", 1) == 1
        and bias is not None
        and bias.dim() == 1
        and width.is_Integer
        and bias.shape[0] == int(width)
        and add.type == layer.type
        and match.program.graph.type_of(match.values["b"]).dtype == layer.type.dtype
    )


def bias_into_linear(match: Match, rewriter: Rewriter) -> list[Node]:
    layer = match.node("layer")
    args = dict(layer.args) | {"bias": match.values["b"]}
    order = [k for k, _ in layer.args] + [k for k in ("bias",) if k not in dict(layer.args)]
    name = rewriter.names.fresh(f"{layer.name}_bias")
    return [replace(layer, name=name, args=tuple((k, args[k]) for k in order))]


_BIAS_FREE = P(LINEAR, {"input": V("x")}, name="layer")

rules_matmul = (
    Rule(
        "matmul_as_linear",
        P(MATMUL, {"self": V("x"), "other": P(TRANSPOSES, {"self": V("w")}, name="wt")}),
        matmul_as_linear,
        is_matmul_by_transposed_weight,
    ),
    Rule(
        "matmul_as_linear",
        P(MATMUL, {"self": V("x"), "other": V("w")}),
        matmul_by_weight_as_linear,
        is_matmul_by_weight,
    ),
    Rule(
        "linear_bias_add",
        P(ADD, {"self": _BIAS_FREE, "other": V("b")}),
        bias_into_linear,
        is_bias_add,
    ),
    Rule(
        "linear_bias_add",
        P(ADD, {"self": V("b"), "other": _BIAS_FREE}),
        bias_into_linear,
        is_bias_add,
    ),
)
