"""Which convolutions may write their output over their residual input (a "donated" residual).

ResNets add each block's input back after its last convolution; that input is dead from then
on. oneDNN can then accumulate into the residual's own buffer (its sum post-op) instead of
reading it as a second input (a binary post-op) into a fresh one: the sum post-op reads and
writes one buffer, where the binary post-op reads the residual and writes a fresh output, one
more tensor's worth of memory traffic and an allocation. The saving is largest on the layers
with the biggest outputs (the early, high-resolution ones).

Writing over a tensor is safe only when nothing can read it afterwards, through any name. So
this is decided on the graph, conservatively: the residual was made by a ``cuvil.conv2d`` (a
fresh buffer, never an input, a constant or a view of another value), it is not a graph output,
every node that reads it is a ``cuvil.conv2d`` (none makes a view of it that could outlive it),
this node is the last of them in graph order (the order the plan runs data steps in), and it
reads the value once (not as its input too).
"""

from __future__ import annotations

from cuvil.fused_ops import CONV2D
from cuvil.ir import Graph, Value

CONV = CONV2D


def donated_residuals(graph: Graph) -> frozenset[str]:
    """Names of the ``cuvil.conv2d`` nodes that may overwrite their residual."""
    outputs = {value for _, value in graph.outputs}
    readers: dict[Value, list[str]] = {}
    ops = {node.name: node.op for node in graph.nodes}
    for node in graph.nodes:
        for value in node.inputs:
            readers.setdefault(value, []).append(node.name)
    donated = set()
    for node in graph.nodes:
        residual = dict(node.args).get("residual") if node.op == CONV else None
        if not isinstance(residual, Value) or residual in outputs:
            continue
        names = readers.get(residual, [])
        if (
            ops.get(residual.node) == CONV
            and all(ops[name] == CONV for name in names)
            and names[-1] == node.name
            and names.count(node.name) == 1
        ):
            donated.add(node.name)
    return frozenset(donated)
