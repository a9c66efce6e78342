"""generate_stream's per-token events: written from a header encoded once, byte for byte what
encoding the whole event object gives, and parsed back to the same fields."""

from __future__ import annotations

import json

import pytest
from cuvil_sidecar.generation.rest_generate import sse_event, token_event_writer
from cuvil_sidecar.generation.servable import GeneratedToken
from cuvil_sidecar.metrics import Metrics

HEADERS = [
    {"model_name": "tiny", "model_version": "1"},
    {"model_name": 'a "quoted" model', "model_version": "7", "id": "réquête-1"},
]
TOKENS = [
    GeneratedToken(5, 0, "", None),
    GeneratedToken(31999, 12, 'héllo "world"\n\t\u2028', None),
    GeneratedToken(7, 63, "end", "length"),
    GeneratedToken(None, 3, "", "stop"),
]


@pytest.mark.parametrize("header", HEADERS)
@pytest.mark.parametrize("with_text", [False, True])
def test_a_token_event_is_what_encoding_the_whole_object_gives(
    header: dict[str, str], with_text: bool
) -> None:
    write = token_event_writer(header, with_text)
    for token in TOKENS:
        whole = header | {
            "output_ids": [] if token.token is None else [token.token],
            "index": token.index,
            "finish_reason": token.finish,
        }
        if with_text:
            whole["text_output"] = token.text
        event = write(token)
        assert event == sse_event(whole)
        assert event.startswith(b"data: ") and event.endswith(b"\n\n")
        assert json.loads(event[6:]) == whole


def test_a_streamed_token_counts_and_its_gap_lands_in_the_histogram() -> None:
    metrics = Metrics()
    metrics.token_generated("tiny", "1", None)  # a stream's first token: no gap
    metrics.token_generated("tiny", "1", 0.004)
    text = metrics.render().decode()
    labels = 'model="tiny",version="1"'
    assert f"cuvil_generation_tokens{{{labels}}} 2\n" in text
    assert f"cuvil_inter_token_latency_seconds_count{{{labels}}} 1" in text
    assert f"cuvil_inter_token_latency_seconds_sum{{{labels}}} 0.004" in text
