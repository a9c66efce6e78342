"""Low activations: bf16 values between the GEMM-like ops, fp32 only where an op needs it.

After the precision pass the convolutions and linears have bf16 (or int8) weights; this pass lets
them also take and produce bf16, so a chain of them passes bf16 from one to the next instead of
each casting its input in and its result out:

    # linear(x: f32, W: bf16) -> linear(to_bf16(x), W) : bf16     (casts where values enter)
    # view(y: bf16)           -> view(y) : bf16                   (ops that move data, not math)
    # softmax(y: bf16)        -> softmax(to_f32(y))               (any op not known to be safe)

A GEMM-like op answers in bf16 only where every reader takes bf16 (another GEMM-like op,
attention, or a follower whose result every reader takes in bf16): where one reader needs fp32,
the op writes fp32 itself rather than leave a cast to a separate pass over its result.
bf16 flows through the ops in ``FOLLOWERS`` (views, slices, pooling, ReLU: they move or
select values, so bf16 loses nothing more there; and ``cuvil.layer_norm``, whose statistics ATen
computes in fp32 for a bf16 input). ``cuvil.attention`` always runs in bf16 (ATen's CPU kernel
keeps its softmax and accumulators in fp32). Every other op gets fp32 operands, graph outputs
are fp32, and a value that several ops need converted is converted once. A graph without bf16
weights is left as it is, and so are a generation graph's KV cache operands (``CACHE_OPERANDS``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from cuvil.fused_ops import (
    ATTENTION,
    CACHED_ATTENTION,
    CONV2D,
    KV_CACHE_WRITE,
    LAYER_NORM,
    LINEAR,
    SWIGLU,
)
from cuvil.ir import Enum, Node, TensorType, Value, iter_values, map_values
from cuvil.passes.program import NameSource, Program

LOW = "bf16"
FULL = "f32"
# GEMM-like op -> its weight argument; it takes its input in bf16 when that weight is bf16
GEMMS = {CONV2D, LINEAR, SWIGLU}
WEIGHTS = {CONV2D: "weight", LINEAR: "weight", SWIGLU: "gate_up_weight"}
LOW_WEIGHTS = (torch.bfloat16, torch.int8)  # weights whose GEMM takes bf16 (int8: bf16 compute)
FULL_RESULT = {SWIGLU}  # its gate (silu(gate) * up) is an fp32 kernel: it answers in fp32
# ops whose result has their first operand's dtype and loses nothing more in bf16
FOLLOWERS = {
    "aten.view.default",
    "aten.reshape.default",
    "aten._unsafe_view.default",
    "aten.slice.Tensor",
    "aten.select.int",
    "aten.transpose.int",
    "aten.permute.default",
    "aten.unsqueeze.default",
    "aten.squeeze.dim",
    "aten.expand.default",
    "aten.clone.default",
    "aten.contiguous.default",
    "aten.flatten.using_ints",
    "aten.relu.default",
    "aten.max_pool2d.default",
    "aten.adaptive_avg_pool2d.default",
    LAYER_NORM,
}
# fused ops that take bf16 data arguments and answer in bf16 (cast in where they are fp32)
LOW_DATA = {ATTENTION: ("query", "key", "value", "mask")}
# a generation graph's KV cache operands, taken in the cache's own dtype (a bf16 model's cache
# is bf16, written and read in place: a cast would be a copy that the write never reaches)
CACHE_OPERANDS = {KV_CACHE_WRITE: ("cache",), CACHED_ATTENTION: ("key_cache", "value_cache")}


def _to(name: str, source: Value, source_type: TensorType, dtype: str) -> Node:
    args = (("self", source), ("dtype", Enum("dtype", dtype)))
    return Node(name, "aten._to_copy.default", args, (replace(source_type, dtype=dtype),))


def _as(types: tuple[TensorType, ...], dtype: str) -> tuple[TensorType, ...]:
    return tuple(replace(t, dtype=dtype) if t.dtype in (LOW, FULL) else t for t in types)


def keep_low_activations(program: Program) -> Program:
    graph = program.graph
    if not any(_is_low_gemm(node, program) for node in graph.nodes):
        return program  # no bf16 weights (precision left out): nothing to keep in bf16
    types: dict[Value, TensorType] = {}
    converted: dict[tuple[Value, str], Value] = {}
    names = NameSource(graph, program.weights)
    nodes: list[Node] = []
    low_nodes = 0

    def convert(value: Value, dtype: str) -> Value:
        source = types[value]
        if source.dtype == dtype or source.dtype not in (LOW, FULL):
            return value
        if (value, dtype) not in converted:
            cast = _to(names.fresh(f"{value.node}_{dtype}"), value, source, dtype)
            nodes.append(cast)
            types[cast.value()] = cast.type
            converted[(value, dtype)] = cast.value()
        return converted[(value, dtype)]

    def is_low(value: object) -> bool:  # a bf16 activation (bf16 weights are no concern here)
        return isinstance(value, Value) and types[value].dtype == LOW and value not in weights

    weights = {node.value() for node in graph.nodes if node.op == "const"}

    readers_take_low = _readers_take_low(program)
    for node in graph.nodes:
        wanted, out = _wanted(node, program, is_low, readers_take_low)
        mapping = {v: convert(v, dtype) for v, dtype in wanted.items()}
        if mapping:
            node = replace(node, args=tuple((k, map_values(a, mapping)) for k, a in node.args))
        if out == LOW:
            node = replace(node, types=_as(node.types, LOW))
            low_nodes += 1
        nodes.append(node)
        for index, tensor_type in enumerate(node.types):
            types[Value(node.name, index)] = tensor_type
    outputs = tuple((name, convert(value, FULL)) for name, value in graph.outputs)
    casts = len(converted)
    if not low_nodes and not casts:
        return program
    new_graph = replace(graph, nodes=tuple(nodes), outputs=outputs)
    hits = {"bf16_activations": low_nodes, "bf16_casts": casts}
    return replace(program, graph=new_graph).with_hits(hits)


def _is_low_gemm(node: Node, program: Program) -> bool:
    if node.op not in GEMMS:
        return False
    weight = node.arg(WEIGHTS[node.op])
    tensor = program.const_tensor(weight) if isinstance(weight, Value) else None
    return tensor is not None and tensor.dtype in LOW_WEIGHTS


def _readers_take_low(program: Program) -> set[Value]:
    """The values whose every reader takes them in bf16 (graph outputs take fp32)."""
    graph = program.graph
    every: dict[Value, bool] = {value: False for _, value in graph.outputs}
    for node in reversed(graph.nodes):  # a node's readers come after it: already seen
        for key, arg in node.args:
            if not isinstance(arg, Value):  # values in a list (a concat's): read in fp32
                for value in iter_values(arg):
                    every[value] = False
                continue
            if _is_low_gemm(node, program):
                takes = key == "input" or (key == "residual" and every.get(node.value(), False))
            elif node.op in LOW_DATA:
                takes = key in LOW_DATA[node.op]
            elif node.op in FOLLOWERS:
                takes = arg == node.inputs[0] and every.get(node.value(), False)
            else:
                takes = False
            every[arg] = every.get(arg, True) and takes
    return {value for value, takes in every.items() if takes}


def _wanted(
    node: Node,
    program: Program,
    is_low: Callable[[object], bool],
    readers_take_low: set[Value],
) -> tuple[dict[Value, str], str]:
    """The dtype each tensor operand must have, and the dtype of the node's result."""
    if _is_low_gemm(node, program):
        takes = node.value() in readers_take_low and node.op not in FULL_RESULT
        out = LOW if takes else FULL
        wanted = {node.arg("input"): LOW, node.arg("residual"): out}
        return {v: dtype for v, dtype in wanted.items() if isinstance(v, Value)}, out
    if node.op in LOW_DATA:
        data = [node.arg(key) for key in LOW_DATA[node.op]]
        return {v: LOW for v in data if isinstance(v, Value) and not _is_const(v, program)}, LOW
    if node.op in FOLLOWERS and node.inputs and is_low(node.inputs[0]):
        return {}, LOW
    if node.op in CACHE_OPERANDS:
        kept = {node.arg(key) for key in CACHE_OPERANDS[node.op]}
        return {v: FULL for v in node.inputs if is_low(v) and v not in kept}, FULL
    if node.op == "const":
        return {}, FULL
    return {v: FULL for v in node.inputs if is_low(v)}, FULL


def _is_const(value: Value, program: Program) -> bool:
    return program.const_tensor(value) is not None
