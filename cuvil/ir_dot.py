"""A picture of the IR: Graphviz DOT text, and SVG through the ``dot`` program when installed.

Constants are not drawn (they would drown the picture); fused Cuvil ops are filled, so that what
the passes did is visible at a glance.
"""

from __future__ import annotations

import html
import shutil
import subprocess

from cuvil.ir import Graph, Node

FUSED_COLOUR = "#ffd98e"
INPUT_COLOUR = "#c6e2ff"


def _label(node: Node) -> str:
    attributes = [
        f"{k}={v}" for k, v in node.attributes.items() if k not in ("key",) and v is not None
    ]
    detail = "<br/>".join(html.escape(a) for a in attributes[:3])
    types = " ".join(html.escape(str(t)) for t in node.types)
    body = f"<b>{html.escape(node.op)}</b><br/>{types}"
    return f"<{body}<br/><font point-size='9'>{detail}</font>>" if detail else f"<{body}>"


def graph_to_dot(graph: Graph) -> str:
    lines = [
        f'digraph "{graph.name}" {{',
        "  rankdir=TB;",
        '  node [shape=box, fontname="Helvetica"];',
    ]
    drawn = {node.name for node in graph.nodes if node.op != "const"}
    for node in graph.nodes:
        if node.name not in drawn:
            continue
        fill = (
            FUSED_COLOUR
            if node.op.startswith("cuvil.")
            else INPUT_COLOUR
            if node.op == "input"
            else "white"
        )
        lines.append(f'  "{node.name}" [label={_label(node)}, style=filled, fillcolor="{fill}"];')
        for value in node.inputs:
            if value.node in drawn:
                lines.append(f'  "{value.node}" -> "{node.name}";')
    for name, value in graph.outputs:
        lines.append(f'  "out:{name}" [label="{html.escape(name)}", shape=oval];')
        lines.append(f'  "{value.node}" -> "out:{name}";')
    lines.append("}")
    return "\n".join(lines) + "\n"


def render_svg(dot_text: str) -> bytes:
    dot = shutil.which("dot")
    if dot is None:
        raise OSError(
            "rendering SVG needs Graphviz's 'dot' (apt-get install graphviz); --dot writes the text"
        )
    result = subprocess.run(
        [dot, "-Tsvg"], input=dot_text.encode(), capture_output=True, timeout=120, check=False
    )
    if result.returncode != 0:
        raise OSError(f"dot failed: {result.stderr.decode(errors='replace')[:500]}")
    return result.stdout
