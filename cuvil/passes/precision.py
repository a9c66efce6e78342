"""Precision: bf16 or fp16 where it pays, fp32 where accuracy needs it.

    # cuvil.linear / cuvil.conv2d / cuvil.swiglu with fp32 weights -> the same op with bf16
    # (or fp16) weights
    # int8: cuvil.linear / cuvil.swiglu -> int8 weights and weight_scale (one per output row)

The GEMM-like fused ops carry nearly all the FLOPs; their weights become the low precision and
the backend computes them in it (with fp32 accumulation) and fp32 at their borders. bf16 keeps
fp32's range; fp16 keeps three more mantissa bits but ends at 65504, so a GEMM whose outputs
pass that overflows (the verify stage sees it). Everything else — normalisations, softmax and
attention, residual sums, embeddings — stays fp32, so errors do not accumulate through the
network. This pass leaves the values between ops fp32; for bf16, a backend that declares
``Lowering.low_activations`` also gets passes/low_activations.py, which keeps them bf16
between the GEMM-like ops and attention.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import torch

from cuvil.fused_ops import CONV2D, LINEAR, SWIGLU
from cuvil.ir import Node, Value
from cuvil.passes.dead_code import eliminate_dead_code
from cuvil.passes.program import NameSource, Program, const_node

WEIGHT_ARGUMENTS = {
    LINEAR: "weight",
    CONV2D: "weight",
    SWIGLU: "gate_up_weight",
}


LOW_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# the low precisions the pass makes: bf16 and fp16 weights, or int8 (per-row scaled) linears
LOW_PRECISIONS = (*LOW_DTYPES, "int8")
INT8_OPS = {LINEAR, SWIGLU}  # the ops an int8 precision quantizes (convolutions get bf16)


def low_precision_pass(precision: str) -> Callable[[Program], Program]:
    """The pass that gives the GEMM-like ops' weights the dtype of ``precision``."""
    if precision == "int8":
        return to_int8
    return partial(to_low_precision, dtype=LOW_DTYPES[precision], suffix=precision)


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [out, ...] as int8 in [-127, 127] and one fp32 scale per output row
    (symmetric: the row's largest magnitude maps to 127; an all-zero row gets scale 1)."""
    rows = weight.float().reshape(weight.shape[0], -1)
    peak = rows.abs().amax(dim=1)
    scale = torch.where(peak > 0, peak / 127, torch.ones_like(peak))
    quantized = torch.round(rows / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return quantized.reshape(weight.shape), scale


def with_int8_linears(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose ``nn.Linear`` weights hold the values int8 precision gives them
    (``quantize_rows`` times the scales), in their own dtype: the eager peer an int8 artifact is
    compared against, its only other difference being how it computes."""
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for module in rounded.modules():
            if isinstance(module, torch.nn.Linear):
                quantized, scale = quantize_rows(module.weight)
                values = (quantized.float() * scale[:, None]).to(module.weight.dtype)
                module.weight = torch.nn.Parameter(values, requires_grad=False)
    return rounded


def to_int8(program: Program) -> Program:
    """int8 weights with per-row scales (``weight_scale``) for the linears and SwiGLUs, bf16
    weights for the convolutions."""
    program = _convert(program, INT8_OPS, quantize_rows, "int8")
    return to_low_precision(program, torch.bfloat16, "bf16")


def to_low_precision(program: Program, dtype: torch.dtype, suffix: str) -> Program:
    return _convert(program, set(WEIGHT_ARGUMENTS), lambda w: (w.to(dtype), None), suffix)


def _convert(
    program: Program,
    ops: set[str],
    convert: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]],
    suffix: str,
) -> Program:
    """Each fp32 weight of ``ops`` replaced by ``convert(weight)``: a new weight and, where it
    gives one, its scale as the op's ``weight_scale`` (a weight several ops share is converted
    once)."""
    graph = program.graph
    names = NameSource(graph, program.weights)
    weights = dict(program.weights)
    converted: dict[str, tuple[Value, Value | None]] = {}  # fp32 const node -> its twin(s)
    nodes: list[Node] = []
    count = 0
    for node in graph.nodes:
        key = WEIGHT_ARGUMENTS.get(node.op) if node.op in ops else None
        source = node.arg(key) if key else None
        tensor = program.const_tensor(source) if isinstance(source, Value) else None
        if key is None or tensor is None or tensor.dtype != torch.float32:
            nodes.append(node)
            continue
        assert isinstance(source, Value)
        if source.node not in converted:
            low, scale = convert(tensor)
            made = _Constants(names, weights, nodes, source.node, node.origin)
            twin = made.add(low, suffix)
            converted[source.node] = (twin, made.add(scale, "scale") if scale is not None else None)
        low_value, scale_value = converted[source.node]
        replaced = {key: low_value, "weight_scale": scale_value}
        args = tuple((k, replaced.get(k, a)) for k, a in node.args)
        nodes.append(replace(node, args=args))
        count += 1
    if not count:
        return program
    new_graph = eliminate_dead_code(replace(graph, nodes=tuple(nodes)))
    live = {str(n.arg("key")) for n in new_graph.nodes if n.op == "const"}
    kept = {k: v for k, v in weights.items() if k in live}
    return replace(program, graph=new_graph, weights=kept).with_hits({f"{suffix}_weights": count})


@dataclass(frozen=True)
class _Constants:
    """Adds a converted weight's parts as weights and const nodes named after ``source``."""

    names: NameSource
    weights: dict[str, torch.Tensor]
    nodes: list[Node]
    source: str
    origin: str

    def add(self, part: torch.Tensor, label: str) -> Value:
        key = self.names.fresh(f"{self.source}_{label}")
        self.weights[key] = part
        twin = const_node(self.names.fresh(key), key, part, self.origin)
        self.nodes.append(twin)
        return twin.value()
