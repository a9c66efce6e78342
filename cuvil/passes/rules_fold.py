"""Constants folded into layers. BatchNorm folding: inference-mode BatchNorm after a convolution
or a linear layer becomes part of that layer's weights and bias (scale = gamma / sqrt(var + eps)).
And an ``addmm`` on a constant weight (GPT-2's ``Conv1D``, which stores the weight as [in, out])
becomes a linear on the transposed constant, so the linear rules, tactics and bf16 apply to it.

    # bn(conv(x, w, b)) -> conv(x, w * scale, (b - mean) * scale + beta)
    # bn(linear(x, w, b)) -> linear(x, w * scale, (b - mean) * scale + beta)
    # bn(cat(conv_1(x), …, conv_n(x))) -> cat(conv_1'(x), …, conv_n'(x))
    #     (each convolution folded with its channels' share of the statistics; MixConv)
    # act(cat(conv_1(x), …, conv_n(x))) -> cat(act(conv_1(x)), …, act(conv_n(x)))
    #     (then each convolution takes the activation as its epilogue)
    # addmm(b, x, w) -> linear(x, w^T, b)            (b, w constants; beta = alpha = 1)
"""

from __future__ import annotations

from dataclasses import replace

import torch

from cuvil.ir import Node, Value
from cuvil.passes.program import const_node
from cuvil.passes.rewrite import Match, P, Rewriter, Rule, V
from cuvil.passes.rules_epilogue import ACTIVATIONS, activation_of

BATCH_NORM = "aten._native_batch_norm_legit_no_training.default"
CONV = "aten.conv2d.default"
LINEAR = "aten.linear.default"


def _batch_norm_of(layer: str) -> P:
    return P(
        BATCH_NORM,
        {"input": P(layer, {"input": V("x"), "weight": V("w")}, name="layer")},
        name="bn",
    )


def is_foldable(match: Match) -> bool:
    """Weights and statistics are constants, and only the normalised output is used."""
    bn, layer = match.node("bn"), match.node("layer")
    needed = [layer.arg("weight"), bn.arg("running_mean"), bn.arg("running_var")]
    optional = [layer.arg("bias"), bn.arg("weight"), bn.arg("bias")]
    if not all(isinstance(v, Value) and match.program.const_tensor(v) is not None for v in needed):
        return False
    if not all(
        v is None or (isinstance(v, Value) and match.program.const_tensor(v) is not None)
        for v in optional
    ):
        return False
    users = match.users[bn.name]
    return all(value.index == 0 for user in users for value in user.inputs if value.node == bn.name)


def _const(match: Match, value: object) -> torch.Tensor | None:
    return match.program.const_tensor(value) if isinstance(value, Value) else None


def _folded(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    bn: Node,
    stats: tuple[torch.Tensor | None, ...],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's weight and bias with the BatchNorm applied (``stats``: mean, var, gamma,
    beta, each over the layer's output channels)."""
    mean, var, gamma, beta = stats
    assert mean is not None and var is not None
    eps = bn.float_arg("eps", 1e-5)
    compute = torch.float32  # fold in fp32 (double costs seconds on ResNet-50 for ~1e-7)
    scale = torch.rsqrt(var.to(compute) + eps) * (gamma.to(compute) if gamma is not None else 1.0)
    shape = (-1,) + (1,) * (weight.dim() - 1)
    new_weight = (weight.to(compute) * scale.reshape(shape)).to(weight.dtype)
    base = bias.to(compute) if bias is not None else torch.zeros_like(scale)
    new_bias = (
        (base - mean.to(compute)) * scale + (beta.to(compute) if beta is not None else 0.0)
    ).to(weight.dtype)
    return new_weight, new_bias


def _statistics(match: Match) -> tuple[torch.Tensor | None, ...]:
    bn = match.node("bn")
    return tuple(
        _const(match, bn.arg(k)) for k in ("running_mean", "running_var", "weight", "bias")
    )


def _refolded_layer(
    layer: Node, weight: torch.Tensor, bias: torch.Tensor, types: tuple, rewriter: Rewriter
) -> list[Node]:
    """Const nodes for ``weight`` and ``bias`` and a copy of ``layer`` that reads them."""
    w_key = rewriter.weight(f"{layer.name}_folded_weight", weight)
    b_key = rewriter.weight(f"{layer.name}_folded_bias", bias)
    w_node = const_node(rewriter.names.fresh(w_key), w_key, weight, layer.origin)
    b_node = const_node(rewriter.names.fresh(b_key), b_key, bias, layer.origin)
    args = dict(layer.args) | {"weight": w_node.value(), "bias": b_node.value()}
    order = [k for k, _ in layer.args] + [k for k in ("bias",) if k not in dict(layer.args)]
    folded = replace(
        layer,
        name=rewriter.names.fresh(f"{layer.name}_bn"),
        args=tuple((k, args[k]) for k in order),
        types=types,
    )
    return [w_node, b_node, folded]


def fold_into_layer(match: Match, rewriter: Rewriter) -> tuple[list[Node], dict[Value, Value]]:
    bn, layer = match.node("bn"), match.node("layer")
    weight = _const(match, layer.arg("weight"))
    assert weight is not None
    new_weight, new_bias = _folded(weight, _const(match, layer.arg("bias")), bn, _statistics(match))
    nodes = _refolded_layer(layer, new_weight, new_bias, bn.types[:1], rewriter)
    return nodes, {bn.value(0): nodes[-1].value()}


CAT = "aten.cat.default"


def _branches(match: Match) -> list[Node] | None:
    """The convolutions a channel concat joins, each read only by it, or None."""
    cat = match.node("cat")
    graph = match.program.graph
    tensors = cat.arg("tensors")
    if not isinstance(tensors, tuple) or not all(isinstance(t, Value) for t in tensors):
        return None
    branches = []
    for value in tensors:
        assert isinstance(value, Value)
        node = graph.by_name[value.node]
        if node.op != CONV or value.index != 0 or len(match.users[node.name]) != 1:
            return None
        weight, bias = _const(match, node.arg("weight")), node.arg("bias")
        if weight is None or (bias is not None and _const(match, bias) is None):
            return None
        branches.append(node)
    return branches


def is_foldable_per_branch(match: Match) -> bool:
    """A BatchNorm over the channel concat of convolutions: each takes its channels' share."""
    cat = match.node("cat")
    if cat.type.rank != 4 or cat.int_arg("dim") % 4 != 1:
        return False
    bn = match.node("bn")
    stats = (bn.arg("running_mean"), bn.arg("running_var"), bn.arg("weight"), bn.arg("bias"))
    if not all(v is None or (isinstance(v, Value) and _const(match, v) is not None) for v in stats):
        return False
    if _branches(match) is None or not all(isinstance(v, Value) for v in stats[:2]):
        return False
    users = match.users[bn.name]
    return all(value.index == 0 for user in users for value in user.inputs if value.node == bn.name)


def fold_per_branch(match: Match, rewriter: Rewriter) -> tuple[list[Node], dict[Value, Value]]:
    bn, cat = match.node("bn"), match.node("cat")
    branches = _branches(match)
    assert branches is not None
    stats = _statistics(match)
    nodes: list[Node] = []
    start = 0
    for layer in branches:
        weight = _const(match, layer.arg("weight"))
        assert weight is not None
        share = tuple(None if t is None else t[start : start + weight.shape[0]] for t in stats)
        start += weight.shape[0]
        new_weight, new_bias = _folded(weight, _const(match, layer.arg("bias")), bn, share)
        nodes += _refolded_layer(layer, new_weight, new_bias, layer.types, rewriter)
    folded = tuple(node.value() for node in nodes[2::3])
    args = tuple((k, folded if k == "tensors" else a) for k, a in cat.args)
    joined = replace(
        cat, name=rewriter.names.fresh(f"{cat.name}_bn"), args=args, types=bn.types[:1]
    )
    return [*nodes, joined], {bn.value(0): joined.value()}


def is_activation_of_conv_branches(match: Match) -> bool:
    """A known activation of a concat whose every input is a convolution only it reads: the
    activation commutes with the concat, and each convolution takes it as its epilogue."""
    return activation_of(match.node("act")) is not None and _branches(match) is not None


def activation_into_branches(match: Match, rewriter: Rewriter) -> list[Node]:
    act, cat = match.node("act"), match.node("cat")
    branches = _branches(match)
    assert branches is not None
    moved = [
        replace(
            act,
            name=rewriter.names.fresh(f"{act.name}_{layer.name}"),
            args=tuple((k, layer.value() if k == "self" else a) for k, a in act.args),
            types=layer.types[:1],
        )
        for layer in branches
    ]
    args = tuple((k, tuple(m.value() for m in moved) if k == "tensors" else a) for k, a in cat.args)
    return [*moved, replace(cat, name=rewriter.names.fresh(cat.name), args=args)]


ADDMM = "aten.addmm.default"


def is_constant_gemm(match: Match) -> bool:
    """A plain ``b + x @ w``: constant 2-D weight, constant 1-D bias of its width, no scaling."""
    root = match.node("addmm")
    weight, bias = _const(match, root.arg("mat2")), _const(match, root.arg("self"))
    if weight is None or bias is None or weight.dim() != 2 or not weight.is_floating_point():
        return False
    scaled = any(root.arg(name, 1) != 1 for name in ("beta", "alpha"))
    return not scaled and tuple(bias.shape) == (weight.shape[1],) and bias.dtype == weight.dtype


def addmm_as_linear(match: Match, rewriter: Rewriter) -> list[Node]:
    root = match.node("addmm")
    weight = _const(match, root.arg("mat2"))
    assert weight is not None
    transposed = weight.t().contiguous()
    key = rewriter.weight(f"{root.name}_weight", transposed)
    w_node = const_node(rewriter.names.fresh(key), key, transposed, root.origin)
    args = (("input", match.values["x"]), ("weight", w_node.value()), ("bias", root.arg("self")))
    name = rewriter.names.fresh(f"{root.name}_linear")
    return [w_node, Node(name, LINEAR, args, root.types, root.origin)]


rules_addmm = (
    Rule(
        "addmm_as_linear",
        P(ADDMM, {"mat1": V("x")}, name="addmm"),
        addmm_as_linear,
        is_constant_gemm,
    ),
)

rules_fold_batch_norm = (
    Rule("conv_bn_fold", _batch_norm_of(CONV), fold_into_layer, is_foldable),
    Rule("linear_bn_fold", _batch_norm_of(LINEAR), fold_into_layer, is_foldable),
    Rule(
        "activation_into_branches",
        P(ACTIVATIONS, {"self": P(CAT, {}, name="cat")}, name="act"),
        activation_into_branches,
        is_activation_of_conv_branches,
    ),
    Rule(
        "concat_bn_fold",
        P(BATCH_NORM, {"input": P(CAT, {}, name="cat")}, name="bn"),
        fold_per_branch,
        is_foldable_per_branch,
    ),
)
