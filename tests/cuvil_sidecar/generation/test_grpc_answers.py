"""ModelStreamInfer's answers to a generation request, written field by field: each parses,
with NVIDIA's protobuf module, to the message protobuf builds for it (a streamed token's answer,
joined from a header encoded once, too). The last answer carries the finish reason (or is
followed by an empty final one), ``stream`` false holds every token for one answer, an ended
generation answers its error; pushed, they are written as each token is delivered, and a write
the stream refuses, or a failure, ends them and closes the generation."""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import pytest
from cuvil_sidecar.generation.grpc_generate import FINAL, PushedAnswers, TokenAnswers
from cuvil_sidecar.generation.servable import GeneratedToken
from cuvil_sidecar.messages import InferRequest
from tritonclient.grpc import service_pb2 as pb  # NVIDIA's: this process never loads ours

TOKENS = [
    GeneratedToken(5, 0, "", None),
    GeneratedToken(31999, 1, 'héllo "world"\n', None),
    GeneratedToken(2**40 + 3, 2, "x" * 300, None),  # a text element past one varint byte
    GeneratedToken(7, 3, "end", "length"),
]


class _Stream:
    """What TokenAnswers and PushedAnswers read of a GenerationStream: the model's name and
    version, whether it has text, ``push`` and ``close``."""

    model_name, model_version = "tiny", "3"

    def __init__(self, with_text: bool) -> None:
        self.with_text = with_text
        self.on_token: Any = None
        self.closes = 0

    def push(self, on_token: Any) -> None:
        self.on_token = on_token

    def close(self) -> None:
        self.closes += 1


def _answers(stream: _Stream, streaming: bool = True, **parameters: Any) -> TokenAnswers:
    request = InferRequest("tiny", "", "req-7", parameters=parameters)
    return TokenAnswers(stream, request, streaming)  # type: ignore[arg-type]


def _expected(
    ids: list[int], pieces: list[str] | None, final: bool, finish: str | None = None
) -> Any:
    """The answer built with protobuf, field by field."""
    response = pb.ModelInferResponse(model_name="tiny", model_version="3", id="req-7")
    response.parameters[FINAL].bool_param = final
    if finish is not None:
        response.parameters["finish_reason"].string_param = finish
    if ids or pieces is not None:
        response.outputs.add(name="output_ids", datatype="INT64", shape=[len(ids)])
        response.raw_output_contents.append(struct.pack(f"<{len(ids)}q", *ids))
    if pieces is not None:
        response.outputs.add(name="text_output", datatype="BYTES", shape=[len(pieces)])
        elements = [struct.pack("<I", len(p.encode())) + p.encode() for p in pieces]
        response.raw_output_contents.append(b"".join(elements))
    return pb.ModelStreamInferResponse(infer_response=response)


def _parsed(answers: list[Any]) -> list[Any]:
    return [pb.ModelStreamInferResponse.FromString(a.SerializeToString()) for a in answers]


@pytest.mark.parametrize("with_text", [False, True])
def test_each_token_answers_what_protobuf_builds_and_the_last_carries_the_finish(
    with_text: bool,
) -> None:
    answers = _answers(_Stream(with_text))
    got = []
    for token in TOKENS:
        got += _parsed(answers.of(token))
    assert answers.ended
    expected = [
        _expected([t.token], [t.text] if with_text else None, t.finish is not None, t.finish)
        for t in TOKENS
        if t.token is not None
    ]
    assert got == expected


def test_an_empty_final_answer_follows_the_last_token_when_asked() -> None:
    answers = _answers(_Stream(False), triton_enable_empty_final_response=True)
    got = [_parsed(answers.of(token)) for token in TOKENS]
    assert [len(a) for a in got] == [1, 1, 1, 2]
    assert got[-1] == [_expected([7], None, False, "length"), _expected([], None, True)]


@pytest.mark.parametrize("with_text", [False, True])
def test_without_stream_every_token_comes_in_one_answer(with_text: bool) -> None:
    answers = _answers(_Stream(with_text), streaming=False)
    got = [_parsed(answers.of(token)) for token in TOKENS]
    assert got[:-1] == [[], [], []]
    text = ["".join(t.text for t in TOKENS)] if with_text else None
    ids = [t.token for t in TOKENS if t.token is not None]
    assert got[-1] == [_expected(ids, text, True, "length")]


@pytest.mark.parametrize(
    ("finish", "error", "message"),
    [
        ("error", "the model failed: boom", "INTERNAL: the model failed: boom"),
        ("shutdown", "", "UNAVAILABLE: the sidecar is stopping; the generation ended early"),
    ],
)
def test_an_ended_generation_answers_its_error(finish: str, error: str, message: str) -> None:
    """Led by the gRPC status name, as a refusal is (a stream's answers carry no status)."""
    answers = _answers(_Stream(True))
    [answer] = _parsed(answers.of(GeneratedToken(None, 2, "", finish, error)))
    assert answers.ended
    assert answer.error_message == message
    assert answer.infer_response.id == "req-7" and answer.infer_response.model_name == "tiny"
    assert not answer.infer_response.outputs


def _pushed(stream: _Stream, write: Any) -> tuple[PushedAnswers, asyncio.Future[None]]:
    pushed = PushedAnswers(_answers(stream))
    return pushed, asyncio.ensure_future(pushed.start(write))


def test_pushed_answers_are_written_as_delivered_until_the_last() -> None:
    async def run() -> None:
        stream, written = _Stream(False), []
        pushed, ended = _pushed(stream, lambda answer: written.append(answer) or True)
        for token in TOKENS[:2]:
            stream.on_token(token)
        assert len(written) == 2 and not ended.done() and not stream.closes
        for token in TOKENS[2:]:
            stream.on_token(token)
        await asyncio.wait_for(ended, 5)
        assert stream.closes == 1
        parsed = [pb.ModelStreamInferResponse.FromString(a) for a in written]
        assert [a.infer_response.parameters[FINAL].bool_param for a in parsed] == [
            False,
            False,
            False,
            True,
        ]
        stream.on_token(TOKENS[0])  # nothing after the last
        assert len(written) == 4
        await pushed.aclose()

    asyncio.run(run())


def test_a_refused_write_ends_the_pushed_answers_and_closes_the_generation() -> None:
    async def run() -> None:
        stream, written = _Stream(False), []

        def write(answer: bytes) -> bool:
            written.append(answer)
            return len(written) < 2  # the stream is gone at the second answer

        _, ended = _pushed(stream, write)
        for token in TOKENS:
            stream.on_token(token)
        await asyncio.wait_for(ended, 5)
        assert len(written) == 2 and stream.closes == 1

    asyncio.run(run())


def test_a_failing_answer_is_answered_as_an_internal_error_and_ends() -> None:
    async def run() -> None:
        stream, written = _Stream(True), []
        _, ended = _pushed(stream, lambda answer: written.append(answer) or True)
        stream.on_token(GeneratedToken(5, 0, "\ud800", None))  # text that is not UTF-8-encodable
        await asyncio.wait_for(ended, 5)
        [answer] = [pb.ModelStreamInferResponse.FromString(a) for a in written]
        assert answer.error_message.startswith("internal error in ModelStreamInfer: ")
        assert "UnicodeEncodeError" in answer.error_message
        assert stream.closes == 1

    asyncio.run(run())
