"""Epilogue fusion: a convolution or linear layer absorbs its bias, its activation and a residual
add, becoming one ``cuvil.conv2d`` / ``cuvil.linear`` that the backend runs as one primitive.

    # act(conv(x) + r) -> cuvil.conv2d(x, activation=act, residual=r)
    # act(conv(x))     -> cuvil.conv2d(x, activation=act)
    # conv(x) + r      -> cuvil.conv2d(x, residual=r)
    # act(linear(x))   -> cuvil.linear(x, activation=act)
    # linear(x) + r    -> cuvil.linear(x, residual=r)
    # act(view(linear(x))) -> view(act(linear(x)))   (then fused as above; GPT-2's Conv1D
                                                     # reshapes its rows back before the GELU)
    # view(linear(x)) + r  -> view(linear(x) + view(r, rows))   (likewise, its residual adds)
Unfused layers are lowered to the same ops, so the backend has one path for each.
"""

from __future__ import annotations

from cuvil.fused_ops import CONV2D, fused_node
from cuvil.fused_ops import LINEAR as FUSED_LINEAR
from cuvil.ir import Arg, Node, Value
from cuvil.passes.rewrite import Condition, Match, P, Rewriter, Rule, V

CONV = "aten.conv2d.default"
LINEAR = "aten.linear.default"
ADD = "aten.add.Tensor"

# aten op -> activation name understood by the backend (hardtanh only as relu6, see below)
ACTIVATION_OPS = {
    "aten.relu.default": "relu",
    "aten.gelu.default": "gelu",
    "aten.silu.default": "silu",
    "aten.hardswish.default": "hardswish",
    "aten.hardtanh.default": "relu6",
    "aten.relu6.default": "relu6",
    "aten.tanh.default": "tanh",
    "aten.sigmoid.default": "sigmoid",
}
ACTIVATIONS = tuple(ACTIVATION_OPS)


def activation_of(node: Node) -> str | None:
    name = ACTIVATION_OPS.get(node.op)
    if name == "gelu" and node.arg("approximate", "none") == "tanh":
        return "gelu_tanh"
    if node.op == "aten.hardtanh.default" and (
        node.arg("min_val", -1.0),
        node.arg("max_val", 1.0),
    ) != (0.0, 6.0):
        return None
    return name


def _layer(op: str) -> P:
    return P(op, {"input": V("x")}, name="layer")


def _shapes(layer: str) -> dict[str, P]:
    """The five epilogue shapes over one layer op, largest first."""
    add = {"self": _layer(layer), "other": V("residual")}
    add_swapped = {"self": V("residual"), "other": _layer(layer)}
    return {
        "add_act": P(ACTIVATIONS, {"self": P(ADD, add, name="add")}, name="act"),
        "add_act_swapped": P(ACTIVATIONS, {"self": P(ADD, add_swapped, name="add")}, name="act"),
        "act": P(ACTIVATIONS, {"self": _layer(layer)}, name="act"),
        "add": P(ADD, add, name="add"),
        "add_swapped": P(ADD, add_swapped, name="add"),
        "plain": _layer(layer),
    }


def is_fusable(match: Match) -> bool:
    """Constant weights of the right rank; a known activation; an add without alpha whose
    residual has exactly the layer's output type (no broadcasting)."""
    layer = match.node("layer")
    weight = layer.arg("weight")
    tensor = match.program.const_tensor(weight) if isinstance(weight, Value) else None
    rank = 4 if layer.op == CONV else 2
    if tensor is None or tensor.dim() != rank:
        return False
    bias = layer.arg("bias")
    if bias is not None and (
        not isinstance(bias, Value) or match.program.const_tensor(bias) is None
    ):
        return False
    if layer.op == CONV and (
        layer.type.rank != 4 or match.program.graph.type_of(match.values["x"]).rank != 4
    ):
        return False
    if "act" in match.nodes and activation_of(match.node("act")) is None:
        return False
    if "add" in match.nodes:
        add = match.node("add")
        residual_type = match.program.graph.type_of(match.values["residual"])
        if add.arg("alpha", 1) != 1 or residual_type != layer.type:
            return False
    return True


def fuse(match: Match, rewriter: Rewriter) -> list[Node]:
    layer = match.node("layer")
    activation = activation_of(match.node("act")) if "act" in match.nodes else "none"
    residual = match.values.get("residual")
    root = match.root
    args: dict[str, Arg] = {
        "input": match.values["x"],
        "weight": layer.arg("weight"),
        "bias": layer.arg("bias"),
        "activation": activation,
        "residual": residual,
    }
    if layer.op == CONV:
        args |= {
            "stride": _pair(layer.arg("stride", (1, 1))),
            "padding": _pair(layer.arg("padding", (0, 0))),
            "dilation": _pair(layer.arg("dilation", (1, 1))),
            "groups": layer.arg("groups", 1),
        }
    name = rewriter.names.fresh(
        f"{layer.name}_fused" if root is not layer else f"{layer.name}_lowered"
    )
    op = CONV2D if layer.op == CONV else FUSED_LINEAR
    return [fused_node(op, name, args, root.types, layer.origin)]


def _pair(value: object) -> tuple[int, int]:
    if isinstance(value, int):
        return (value, value)
    assert isinstance(value, tuple)
    return (
        (int(value[0]), int(value[-1])) if len(value) in (1, 2) else (int(value[0]), int(value[1]))
    )


def _rules(prefix: str, layer: str, condition: Condition, shapes: set[str]) -> tuple[Rule, ...]:
    return tuple(
        Rule(f"{prefix}_{shape}".removesuffix("_swapped"), pattern, fuse, condition)
        for shape, pattern in _shapes(layer).items()
        if shape.removesuffix("_swapped") in shapes
    )


VIEW = "aten.view.default"


def is_view_of_single_use_layer(match: Match) -> bool:
    """The activation reads a view that only it reads, of a linear that only the view reads:
    an elementwise op commutes with the view, so it can move next to the layer."""
    act, view, layer = match.node("act"), match.node("view"), match.node("layer")
    single = all(len(match.users[node.name]) == 1 for node in (view, layer))
    return single and activation_of(act) is not None


def activation_before_view(match: Match, rewriter: Rewriter) -> list[Node]:
    act, view, layer = match.node("act"), match.node("view"), match.node("layer")
    moved_args = tuple((k, layer.value() if k == "self" else a) for k, a in act.args)
    moved = Node(rewriter.names.fresh(act.name), act.op, moved_args, layer.types, act.origin)
    view_args = tuple((k, moved.value() if k == "self" else a) for k, a in view.args)
    return [moved, Node(rewriter.names.fresh(view.name), VIEW, view_args, act.types, view.origin)]


rule_activation_before_view = Rule(
    "linear_act_through_view",
    P(ACTIVATIONS, {"self": P(VIEW, {"self": _layer(LINEAR)}, name="view")}, name="act"),
    activation_before_view,
    is_view_of_single_use_layer,
)


def is_same_shape_add_of_view(match: Match) -> bool:
    """A plain ``view(linear) + r`` with r of the sum's own shape (no broadcast), a single-use
    view of a single-use linear, and a static feature count to view r's rows by."""
    add, view, layer = match.node("add"), match.node("view"), match.node("layer")
    residual = match.values["residual"]
    single = all(len(match.users[node.name]) == 1 for node in (view, layer))
    same = match.program.graph.type_of(residual) == add.types[0] == view.types[0]
    features = layer.types[0].shape[-1]
    return single and same and features.is_Integer and add.arg("alpha", 1) == 1


def residual_before_view(match: Match, rewriter: Rewriter) -> list[Node]:
    add, view, layer = match.node("add"), match.node("view"), match.node("layer")
    rows_type = layer.types[0]
    size = [-1, int(rows_type.shape[-1])]
    residual = match.values["residual"]
    rows = Node(
        rewriter.names.fresh(f"{add.name}_rows"),
        VIEW,
        (("self", residual), ("size", size)),
        (rows_type,),
        add.origin,
    )
    summed = Node(
        rewriter.names.fresh(add.name),
        ADD,
        (("self", layer.value()), ("other", rows.value())),
        (rows_type,),
        add.origin,
    )
    back = Node(
        rewriter.names.fresh(view.name),
        VIEW,
        (("self", summed.value()), ("size", view.arg("size"))),
        add.types,
        view.origin,
    )
    return [rows, summed, back]


_VIEWED_LAYER = P(VIEW, {"self": _layer(LINEAR)}, name="view")
rules_residual_before_view = tuple(
    Rule(
        "linear_add_through_view",
        P(ADD, operands, name="add"),
        residual_before_view,
        is_same_shape_add_of_view,
    )
    for operands in (
        {"self": _VIEWED_LAYER, "other": V("residual")},
        {"self": V("residual"), "other": _VIEWED_LAYER},
    )
)


def epilogue_rules(conv: frozenset[str], linear: frozenset[str]) -> tuple[Rule, ...]:
    """The rules for the epilogue shapes a backend's convolutions and linears fuse (``add_act``,
    ``act``, ``add``, ``plain``; see ``_shapes``); a linear's activation and residual move
    through the view between them first where its kernels take them."""
    through_view: tuple[Rule, ...] = (rule_activation_before_view,) if "act" in linear else ()
    through_view += rules_residual_before_view if "add" in linear else ()
    return (
        *_rules("conv", CONV, is_fusable, set(conv)),
        *through_view,
        *_rules("linear", LINEAR, is_fusable, set(linear)),
    )
