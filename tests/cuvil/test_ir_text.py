"""The IR text form: exact round trips, golden text, and parse errors that name the line."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from cuvil.ir_text import IRParseError, parse_graph, print_graph
from cuvil.ir_verify import verify_graph
from tests.cuvil.graphs import every_argument_kind

GOLDEN = Path(__file__).parent / "golden"


def test_round_trip_keeps_every_argument_kind() -> None:
    graph = verify_graph(every_argument_kind())
    text = print_graph(graph)
    parsed = parse_graph(text)
    assert parsed == graph
    assert [n.origin for n in parsed.nodes] == [n.origin for n in graph.nodes]
    assert print_graph(parsed) == text


def test_printed_text_matches_golden() -> None:
    assert print_graph(every_argument_kind()) == (GOLDEN / "kinds.ir").read_text()


def test_changed_graph_prints_differently() -> None:
    graph = every_argument_kind()
    changed = replace(
        graph, nodes=(*graph.nodes[:-1], replace(graph.nodes[-1], op="aten.add.Tensor"))
    )
    assert print_graph(changed) != print_graph(graph)
    assert parse_graph(print_graph(changed)) != graph


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("  %y = aten.relu.default(self=%x) : f32[batch, nope]", "unknown name"),
        ("  %y = aten.relu.default(self=%x : f32[batch]", "expected"),
        ("  %y = aten.relu.default(self=__import__) : f32[batch]", "cannot read an argument"),
        (
            "  %y = aten.relu.default(self=%x) : f32[batch.__class__]",
            "shape expression .batch.__class__. refused",
        ),
    ],
)
def test_parse_errors_name_the_line(line: str, message: str) -> None:
    text = (
        "graph @g {\n  symbol batch in [1, 4]\n  %x = input() : f32[batch]\n"
        + line
        + "\n  return (y=%y)\n}\n"
    )
    with pytest.raises(IRParseError, match=message) as raised:
        parse_graph(text)
    assert "line 4" in str(raised.value)


def test_missing_return_is_an_error() -> None:
    with pytest.raises(IRParseError, match="return"):
        parse_graph("graph @g {\n  %x = input() : f32[2]\n}\n")
