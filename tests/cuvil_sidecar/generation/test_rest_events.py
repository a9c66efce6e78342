"""generate_stream's per-token events: written from a header encoded once, byte for byte what
encoding the whole event object gives, and parsed back to the same fields; pushed as each token
is delivered until the stream's last, an error as an error event, a failed write ending the
response."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from cuvil_sidecar.generation.openai_api import chunk_writer
from cuvil_sidecar.generation.rest_generate import (
    TokenEvents,
    event_frames,
    sse_event,
    token_event_writer,
)
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


@pytest.mark.parametrize("chat", [False, True])
def test_an_openai_chunk_is_what_encoding_the_whole_object_gives(chat: bool) -> None:
    header = {"id": "chatcmpl-1", "created": 17, "model": 'a "mödel"', "object": "chunk"}
    chunk = chunk_writer(header, chat)
    for token in TOKENS:
        for text in (token.text, None, ""):
            for role in (False, True) if chat else (False,):
                if chat:
                    delta = ({"role": "assistant"} if role else {}) | (
                        {} if text is None else {"content": text}
                    )
                    choice: dict[str, object] = {"index": 0, "delta": delta}
                else:
                    choice = {"index": 0, "text": text or ""}
                for logprobs in (None, {"content": [{"token": "é", "logprob": -0.5}]}):
                    whole = header | {
                        "choices": [choice | {"logprobs": logprobs, "finish_reason": token.finish}]
                    }
                    written = chunk(text, token.finish, role=role, logprobs=logprobs)
                    assert written == sse_event(whole)
                    assert json.loads(written[6:]) == whole


def test_a_streamed_token_counts_and_its_gap_lands_in_the_histogram() -> None:
    metrics = Metrics()
    metrics.token_generated("tiny", "1", None)  # a stream's first token: no gap
    metrics.token_generated("tiny", "1", 0.004)
    text = metrics.render().decode()
    labels = 'model="tiny",version="1"'
    assert f"cuvil_generation_tokens{{{labels}}} 2\n" in text
    assert f"cuvil_inter_token_latency_seconds_count{{{labels}}} 1" in text
    assert f"cuvil_inter_token_latency_seconds_sum{{{labels}}} 0.004" in text


class _Stream:
    """What TokenEvents reads of a GenerationStream: its header fields, its tokens per write,
    ``push`` and ``close``."""

    model_name, model_version, request_id, with_text = "tiny", "1", "", False

    def __init__(self, stream_interval: int = 1) -> None:
        self.stream_interval = stream_interval
        self.on_token: Any = None
        self.closed = False

    def push(self, on_token: Any) -> None:
        self.on_token = on_token

    def close(self) -> None:
        self.closed = True


def _pushed(
    tokens: list[GeneratedToken], write: Any, stream_interval: int = 1
) -> tuple[Any, _Stream]:
    """TokenEvents over a stand-in stream, started with ``write``, handed ``tokens``; returns
    what its start returned (done, or not) and the stream."""

    async def run() -> tuple[Any, _Stream]:
        stream = _Stream(stream_interval)
        events = TokenEvents(stream, event_frames(stream))  # type: ignore[arg-type]
        ended = events.start(write)
        for token in tokens:
            stream.on_token(token)
        await asyncio.sleep(0)
        await events.aclose()
        return ended, stream

    return asyncio.run(run())


def test_pushed_events_are_written_until_the_last_token_and_no_further() -> None:
    written: list[bytes] = []
    tokens = [GeneratedToken(5, 0, "", None), GeneratedToken(7, 1, "", "length")]
    ended, stream = _pushed([*tokens, GeneratedToken(9, 2, "", None)], written.append)
    header = {"model_name": "tiny", "model_version": "1"}
    assert written == [token_event_writer(header, False)(token) for token in tokens]
    assert ended.done() and ended.exception() is None
    assert stream.closed


def test_an_error_token_is_written_as_an_error_event_and_ends_the_stream() -> None:
    written: list[bytes] = []
    ended, _ = _pushed([GeneratedToken(None, 0, "", "error", "the model failed")], written.append)
    assert written == [sse_event({"error": "the model failed"})]
    assert ended.done() and ended.exception() is None


def test_a_failing_write_ends_the_response_with_its_error() -> None:
    def broken(part: bytes) -> None:
        raise ConnectionResetError("gone")

    ended, stream = _pushed([GeneratedToken(5, 0, "", None)], broken)
    assert isinstance(ended.exception(), ConnectionResetError)
    assert stream.closed


def test_the_opening_goes_first_and_a_token_may_write_several_frames() -> None:
    """The OpenAI-compatible streams' form: a role chunk first, the last token's chunk then the
    usage chunk and ``[DONE]`` in one write; a token with no frames writes nothing."""
    written: list[bytes] = []

    def frames(token: GeneratedToken) -> list[bytes]:
        parts = [b"token %d" % token.index] if token.token is not None else []
        return parts + ([b"usage", b"[DONE]"] if token.finish is not None else [])

    async def run() -> Any:
        stream = _Stream()
        ended = TokenEvents(stream, frames, (b"role",)).start(written.append)  # type: ignore[arg-type]
        for token in (GeneratedToken(1, 0, "", None), GeneratedToken(None, 1, "", "stop")):
            stream.on_token(token)
        return ended

    ended = asyncio.run(run())
    assert written == [b"role", b"token 0", b"usage[DONE]"]
    assert ended.done()


@pytest.mark.parametrize("count", [1, 2, 6, 7, 8])
def test_a_stream_interval_writes_its_tokens_events_together_and_the_last_at_once(
    count: int,
) -> None:
    """``CUVIL_STREAM_INTERVAL`` 3: the same events, byte for byte, in writes of three tokens'
    events; the last token writes what is held however few, and nothing follows it."""
    tokens = [GeneratedToken(index + 100, index, "", None) for index in range(count - 1)]
    tokens.append(GeneratedToken(99, count - 1, "", "length"))
    one_by_one: list[bytes] = []
    ended, _ = _pushed(tokens, one_by_one.append)
    assert len(one_by_one) == count and ended.done()
    written: list[bytes] = []
    ended, stream = _pushed([*tokens, GeneratedToken(1, count, "", None)], written.append, 3)
    assert written == [b"".join(one_by_one[at : at + 3]) for at in range(0, count, 3)]
    assert ended.done() and ended.exception() is None and stream.closed


def test_an_error_within_an_interval_writes_the_held_events_before_it() -> None:
    tokens = [GeneratedToken(5, 0, "", None), GeneratedToken(None, 1, "", "error", "it failed")]
    written: list[bytes] = []
    ended, _ = _pushed(tokens, written.append, 4)
    header = {"model_name": "tiny", "model_version": "1"}
    event = token_event_writer(header, False)(tokens[0])
    assert written == [event + sse_event({"error": "it failed"})]
    assert ended.done() and ended.exception() is None
