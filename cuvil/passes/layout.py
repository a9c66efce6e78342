"""Layout: channels-last through convolution chains, conversions only at the borders.

The CPU backend runs convolutions channels-last (NHWC in memory). This pass marks every value
inside a chain of layout-preserving ops as ``channels_last`` and inserts one explicit ``clone``
at each border: into the chain before the first convolution, out of it before an op that needs
the default layout (a view, anything not known to preserve the layout) and before graph outputs.

    # conv(x)            -> conv(to_channels_last(x))      (x contiguous)
    # view(y)            -> view(to_contiguous(y))         (y channels_last)

Concats and channel splits keep channels-last, so a dense-connected or mixed-kernel network
converts once on the way in and once on the way out, not around every join.
"""

from __future__ import annotations

from dataclasses import replace

from cuvil.fused_ops import CONV2D
from cuvil.ir import Enum, Node, TensorType, Value, map_values
from cuvil.passes.program import NameSource, Program

CHANNELS_LAST = "channels_last"
PRODUCERS = {CONV2D}
PRESERVING = {
    "aten.relu.default",
    "aten.hardtanh.default",
    "aten.silu.default",
    "aten.gelu.default",
    "aten.sigmoid.default",
    "aten.hardswish.default",
    "aten.add.Tensor",
    "aten.mul.Tensor",
    "aten.max_pool2d.default",
    "aten.avg_pool2d.default",
    "aten.adaptive_avg_pool2d.default",
    "aten.constant_pad_nd.default",
    # joins and slices: ATen's cat keeps the layout its inputs share, and a slice of a
    # channels-last tensor keeps its stride order (DenseNet's concats, MixConv's splits)
    "aten.cat.default",
    # a BatchNorm no layer absorbed (DenseNet's, after a concat): ATen's CPU kernel keeps NHWC
    "aten._native_batch_norm_legit_no_training.default",
    "aten.split.Tensor",
    "aten.split_with_sizes.default",
    "aten.slice.Tensor",
    "aten.narrow.default",
}
# Padding keeps channels-last in ATen for these modes (circular returns a contiguous tensor).
PRESERVING_PAD_MODES = {"constant", "reflect", "replicate"}


def _preserves(node: Node) -> bool:
    if node.op == "aten.pad.default":
        return node.arg("mode", "constant") in PRESERVING_PAD_MODES
    return node.op in PRESERVING


def _layout_swap(node: Node, layout: dict[Value, str]) -> str | None:
    """The result's layout for ops that take a channels-last operand as it is and whose result
    needs no conversion either; None for any other op.

    - a permute that only relabels memory: NCHW channels-last permuted to NHWC is a contiguous
      tensor, and contiguous NHWC permuted to NCHW is a channels-last one (ConvNeXt's LayerNorm
      sits between the two);
    - ``mean`` over dims (global pooling, squeeze-excite): ATen reduces any layout, and what is
      left of the spatial dims is reduced away or of size 1.
    """
    if len(node.inputs) != 1:
        return None
    source = layout.get(node.inputs[0], "contiguous")
    if node.op == "aten.mean.dim" and source == CHANNELS_LAST:
        return "contiguous" if _spatial_reduced(node.arg("dim")) else None
    if node.op != "aten.permute.default":
        return None
    dims = node.arg("dims")
    dims = tuple(dims) if isinstance(dims, list | tuple) else ()
    if dims == (0, 2, 3, 1) and source == CHANNELS_LAST:
        return "contiguous"
    if dims == (0, 3, 1, 2) and source == "contiguous":
        return CHANNELS_LAST
    return None


def _spatial_reduced(dims: object) -> bool:
    return isinstance(dims, list | tuple) and {int(d) % 4 for d in dims} >= {2, 3}


def _clone(name: str, source: Value, source_type: TensorType, layout: str) -> Node:
    memory_format = "channels_last" if layout == CHANNELS_LAST else "contiguous_format"
    args = (("self", source), ("memory_format", Enum("memory_format", memory_format)))
    return Node(name, "aten.clone.default", args, (replace(source_type, layout=layout),))


def to_channels_last(program: Program) -> Program:
    graph = program.graph
    if not any(node.op in PRODUCERS for node in graph.nodes):
        return program
    names = NameSource(graph, program.weights)
    layout: dict[Value, str] = {}
    types: dict[Value, TensorType] = {}
    converted: dict[tuple[Value, str], Value] = {}
    nodes: list[Node] = []
    borders = 0

    def convert(value: Value, wanted: str) -> Value:
        nonlocal borders
        if layout.get(value, "contiguous") == wanted:
            return value
        if (value, wanted) not in converted:
            clone = _clone(names.fresh(f"{value.node}_{wanted}"), value, types[value], wanted)
            nodes.append(clone)
            layout[clone.value()], types[clone.value()] = wanted, clone.type
            converted[(value, wanted)] = clone.value()
            borders += 1
        return converted[(value, wanted)]

    for node in graph.nodes:
        rank4 = [v for v in node.inputs if types[v].rank == 4]
        if node.op in PRODUCERS:  # the data operands, not the weights
            data = [node.arg("input"), node.arg("residual")]
            wanted = {v: CHANNELS_LAST for v in rank4 if v in data}
            out_layout = CHANNELS_LAST
        elif _preserves(node) and any(layout.get(v) == CHANNELS_LAST for v in rank4):
            wanted = {v: CHANNELS_LAST for v in rank4}
            out_layout = CHANNELS_LAST
        elif (swap := _layout_swap(node, layout)) is not None:
            wanted, out_layout = {}, swap
        else:
            wanted = {v: "contiguous" for v in node.inputs if layout.get(v) == CHANNELS_LAST}
            out_layout = "contiguous"
        mapping = {v: convert(v, w) for v, w in wanted.items()}
        if mapping:
            node = replace(node, args=tuple((k, map_values(a, mapping)) for k, a in node.args))
        if out_layout == CHANNELS_LAST:
            node = replace(
                node,
                types=tuple(
                    replace(t, layout=CHANNELS_LAST) if t.rank == 4 else t for t in node.types
                ),
            )
        nodes.append(node)
        for index, tensor_type in enumerate(node.types):
            types[Value(node.name, index)] = tensor_type
            layout[Value(node.name, index)] = tensor_type.layout
    outputs = tuple((name, convert(value, "contiguous")) for name, value in graph.outputs)
    new_graph = replace(graph, nodes=tuple(nodes), outputs=outputs)
    return replace(program, graph=new_graph).with_hits({"layout_borders": borders})
