"""The IR JSON form (an artifact's graph layer) round-trips and refuses malformed data."""

from __future__ import annotations

import json

import pytest

from cuvil.ir_json import GraphFormatError, graph_from_json, graph_to_json
from tests.cuvil.graphs import every_argument_kind


def test_json_round_trip() -> None:
    graph = every_argument_kind()
    data = json.loads(json.dumps(graph_to_json(graph)))
    assert graph_from_json(data) == graph


def test_unknown_format_is_refused() -> None:
    data = graph_to_json(every_argument_kind()) | {"format": "cuvil.graph.v0"}
    with pytest.raises(GraphFormatError, match="format"):
        graph_from_json(data)


def test_code_in_a_shape_expression_is_refused() -> None:
    data = graph_to_json(every_argument_kind())
    data["nodes"][0]["types"][0]["shape"][0] = "__import__('os').system('true')"
    with pytest.raises(GraphFormatError, match="shape expression"):
        graph_from_json(data)


def test_unknown_argument_tag_is_refused() -> None:
    data = graph_to_json(every_argument_kind())
    data["nodes"][2]["args"][0][1] = {"pickle": "gASV"}
    with pytest.raises(GraphFormatError, match="unknown argument tag"):
        graph_from_json(data)
