"""Dead-code elimination: drop nodes whose values reach no output.

Inputs always stay (they are the signature), even when the model ignores one.
"""

from __future__ import annotations

from dataclasses import replace

from cuvil.ir import Graph


def eliminate_dead_code(graph: Graph) -> Graph:
    live = {value.node for _, value in graph.outputs} | set(graph.inputs)
    for node in reversed(graph.nodes):
        if node.name in live:
            live.update(value.node for value in node.inputs)
    kept = tuple(node for node in graph.nodes if node.name in live)
    return graph if len(kept) == len(graph.nodes) else replace(graph, nodes=kept)
