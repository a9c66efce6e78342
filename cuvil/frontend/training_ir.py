"""torch.export's training IR taken as the inference IR, when a few local rewrites make it so.

``ExportedProgram.run_decompositions({})`` retraces the whole program to reach the inference IR
(functional, CompositeImplicit ops lowered). For a ResNet-50 with a dynamic batch that retrace
took 3.4-4.0 s here, against 1.5-2.4 s for the export itself. For graphs made only of the ops
below, the difference between the two IRs is local and known, so it is applied node by node:

    batch_norm (eval)         -> _native_batch_norm_legit_no_training, item 0
    dropout (eval)            -> clone (what the retrace gives; the cleanup pass drops it)
    flatten                   -> view to the flattened shape
    relu_, add_, ... (in place) -> relu, add, ... when nothing reads the overwritten value later,
                                  it has no views and it is no view of (or input to) anything

Every other op must be one ``run_decompositions({})`` keeps as it is (``DIRECT_OPS``). Any op
outside both lists, a mutated buffer or an in-place op that is not provably safe, and the
program takes the full retrace instead. ``tests/cuvil/test_training_ir.py`` checks that both
routes give the same Cuvil IR, node for node.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
import torch.fx

from cuvil.frontend.convert import DROPPED_TARGETS, op_name_of

aten = torch.ops.aten

# Ops that appear unchanged in the inference IR (checked per model family in the tests).
DIRECT_OPS = frozenset(
    {
        "aten.conv2d.default",
        "aten.linear.default",
        "aten.relu.default",
        "aten.hardtanh.default",
        "aten.silu.default",
        "aten.hardswish.default",
        "aten.hardsigmoid.default",
        "aten.sigmoid.default",
        "aten.gelu.default",
        "aten.add.Tensor",
        "aten.mul.Tensor",
        "aten.max_pool2d.default",
        "aten.avg_pool2d.default",
        "aten.adaptive_avg_pool2d.default",
        "aten.mean.dim",
        "aten.cat.default",
        "aten.view.default",
        "aten.sym_size.int",
    }
)

# In-place op -> its functional twin.
FUNCTIONAL_TWIN: dict[str, torch._ops.OpOverload] = {
    "aten.relu_.default": aten.relu.default,
    "aten.hardtanh_.default": aten.hardtanh.default,
    "aten.silu_.default": aten.silu.default,
    "aten.hardswish_.default": aten.hardswish.default,
    "aten.hardsigmoid_.default": aten.hardsigmoid.default,
    "aten.sigmoid_.default": aten.sigmoid.default,
    "aten.add_.Tensor": aten.add.Tensor,
    "aten.mul_.Tensor": aten.mul.Tensor,
}

# Non-tensor plumbing the converter folds away: getitem, and SymInt arithmetic on sizes.
_PLUMBING = (operator.getitem, operator.add, operator.sub, operator.mul, operator.floordiv)


def as_inference_ir(program: torch.export.ExportedProgram) -> bool:
    """Rewrite ``program``'s training IR into the inference IR in place and return True, or
    leave it untouched and return False when it needs ``run_decompositions``."""
    signature = program.graph_signature
    if signature.buffers_to_mutate or signature.user_inputs_to_mutate:
        return False
    nodes = list(program.graph.nodes)
    positions = {node: index for index, node in enumerate(nodes)}
    if not all(_convertible(node, positions) for node in nodes):
        return False
    for node in nodes:
        rewrite = _REWRITES.get(op_name_of(node.target)) if node.op == "call_function" else None
        if rewrite is not None:
            rewrite(program.graph, node)
    program.graph.lint()
    program.graph_module.recompile()
    return True


def _convertible(node: torch.fx.Node, positions: dict[torch.fx.Node, int]) -> bool:
    if node.op != "call_function" or node.target in _PLUMBING:
        return True
    name = op_name_of(node.target)
    if name in DIRECT_OPS or name in DROPPED_TARGETS or name == "aten.flatten.using_ints":
        return True
    if name == "aten.batch_norm.default":
        return node.args[5] is False  # training=False: running statistics, nothing updated
    if name == "aten.dropout.default":
        return node.args[2] is False  # train=False: the identity
    if name in FUNCTIONAL_TWIN:
        return _overwrite_is_unobserved(node, positions)
    return False


def _overwrite_is_unobserved(node: torch.fx.Node, positions: dict[torch.fx.Node, int]) -> bool:
    """An in-place op may become functional when the tensor it overwrites is a fresh result
    (no input, weight or view of another tensor) that nothing reads after the overwrite."""
    target = node.args[0]
    if not isinstance(target, torch.fx.Node) or target.op != "call_function":
        return False
    producer = op_name_of(target.target)
    if producer not in FUNCTIONAL_TWIN and _returns_alias(target.target):
        return False  # a view: writing to it would write to its base
    if producer in FUNCTIONAL_TWIN and not _overwrite_is_unobserved(target, positions):
        return False
    others = [user for user in target.users if user is not node]
    if any(user.op == "call_function" and _returns_alias(user.target) for user in others):
        return False  # a view taken earlier would see the overwrite
    return all(positions[user] < positions[node] for user in others)


def _returns_alias(target: object) -> bool:
    if not isinstance(target, torch._ops.OpOverload):
        return True
    return any(ret.alias_info is not None for ret in target._schema.returns)


def _functional(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    node.target = FUNCTIONAL_TWIN[op_name_of(node.target)]


def _batch_norm(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    source, weight, bias, mean, var, _, momentum, eps, _ = node.args
    value = node.meta["val"]
    with graph.inserting_after(node):
        legit = graph.call_function(
            aten._native_batch_norm_legit_no_training.default,
            (source, weight, bias, mean, var, momentum, eps),
        )
    with graph.inserting_after(legit):
        item = graph.call_function(operator.getitem, (legit, 0))
    legit.meta = {**node.meta, "val": (value, value.new_empty((0,)), value.new_empty((0,)))}
    item.meta = dict(node.meta)
    node.replace_all_uses_with(item)
    graph.erase_node(node)


def _dropout(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    node.target = aten.clone.default
    node.args = (node.args[0],)
    node.kwargs = {}


def _flatten(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    node.target = aten.view.default
    node.args = (node.args[0], list(node.meta["val"].shape))
    node.kwargs = {}


_REWRITES: dict[str, Callable[[torch.fx.Graph, torch.fx.Node], None]] = {
    "aten.batch_norm.default": _batch_norm,
    "aten.dropout.default": _dropout,
    "aten.flatten.using_ints": _flatten,
    **{name: _functional for name in FUNCTIONAL_TWIN},
}
