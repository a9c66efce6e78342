"""Triton's generate extension over REST, for a generation model:

    POST /v2/models/{m}[/versions/{v}]/generate          one JSON answer with every token
    POST /v2/models/{m}[/versions/{v}]/generate_stream   server-sent events, one per token

The body is a JSON object: ``text_input`` (a string; needs the model's tokenizer) or
``input_ids`` (token ids), ``parameters`` (``requests.py``; Triton also takes them at the top
level, and so does this), and an optional ``id``. ``generate`` answers ``model_name``,
``model_version``, ``text_output`` (with a tokenizer), ``output_ids`` and ``finish_reason``
(``stop``: an eos token or stop string; ``length``: max_tokens or the model's max_seq).
``generate_stream`` sends the same fields per token, ``text_output`` holding the text that
token completes and ``finish_reason`` null until the last event; an error after the stream
began comes as an event ``{"error": ...}``. A refusal before any token is an ordinary error
answer: 400 for a malformed request, 413 for one larger than the KV cache budget, 429 when
the waiting queue is full (``errors.HTTP_STATUS``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from cuvil_sidecar.dataplane import DataPlane
from cuvil_sidecar.errors import InvalidInput
from cuvil_sidecar.generation.requests import GenerateRequest, read_parameters, read_prompt
from cuvil_sidecar.generation.sequences import FINISH_ERROR, FINISH_SHUTDOWN
from cuvil_sidecar.generation.servable import (
    INPUT_IDS,
    TEXT_INPUT,
    GeneratedToken,
    GenerationServable,
    GenerationStream,
    ended_error,
)
from cuvil_sidecar.http_server import HttpRequest, HttpResponse, json_response
from cuvil_sidecar.json_body import json_object

BODY_KEYS = frozenset({TEXT_INPUT, INPUT_IDS, "parameters", "id"})


def reader(body: bytes) -> Callable[[GenerationServable], GenerateRequest]:
    """The request body -> how to read it against the model (its tokenizer, its eos ids)."""
    value = json_object(body, "the generate request")
    nested = value.get("parameters", {})
    if not isinstance(nested, dict):
        raise InvalidInput("parameters must be a JSON object")
    top = {key: item for key, item in value.items() if key not in BODY_KEYS}
    both = sorted(set(top) & set(nested))
    if both:
        raise InvalidInput(f"{both} given both at the top level and in parameters")
    parameters = top | nested
    if (TEXT_INPUT in value) == (INPUT_IDS in value):
        raise InvalidInput(f"give one of {TEXT_INPUT} (a string) or {INPUT_IDS} (token ids)")
    text = value.get(TEXT_INPUT)
    if TEXT_INPUT in value and not isinstance(text, str):
        raise InvalidInput(f"{TEXT_INPUT} must be a string")
    prompt = read_prompt(value[INPUT_IDS], INPUT_IDS) if INPUT_IDS in value else None
    request_id = value.get("id", "")
    if not isinstance(request_id, str):
        raise InvalidInput("id must be a string")

    def read(model: GenerationServable) -> GenerateRequest:
        params, stop = read_parameters(
            parameters, model.model.eos_token_ids, model.model.sampling_defaults
        )
        return GenerateRequest(prompt, text, params, stop, request_id)

    return read


async def generate(
    dataplane: DataPlane, request: HttpRequest, model: str, version: str
) -> HttpResponse:
    stream = dataplane.open_generation(model, version, reader(request.body))
    try:
        last = await stream.last()
    finally:
        stream.close()
    if last.finish in (FINISH_ERROR, FINISH_SHUTDOWN):
        raise ended_error(last.finish, last.error)
    answer = _header(stream) | {"output_ids": stream.tokens, "finish_reason": stream.finish}
    if stream.with_text:
        answer["text_output"] = stream.text
    return json_response(200, answer)


async def generate_stream(
    dataplane: DataPlane, request: HttpRequest, model: str, version: str
) -> HttpResponse:
    stream = dataplane.open_generation(model, version, reader(request.body))
    events = TokenEvents(stream, event_frames(stream))
    return HttpResponse(200, content_type="text/event-stream", stream=events)


def event_frames(stream: GenerationStream) -> Callable[[GeneratedToken], list[bytes]]:
    """``generate_stream``'s events per token: the token's event, or an ``{"error": ...}``
    event for a generation that failed or was stopped by a shutdown."""
    event = token_event_writer(_header(stream), stream.with_text)

    def frames(token: GeneratedToken) -> list[bytes]:
        if token.finish in (FINISH_ERROR, FINISH_SHUTDOWN):
            return [sse_event({"error": str(ended_error(token.finish, token.error))})]
        return [event(token)]

    return frames


class TokenEvents:
    """A generation stream's server-sent events as an http_server ``PushedStream``: ``opening``
    first, then each token's ``frames(token)`` written as the inbox delivers the token, on the
    event loop, with no task per stream woken per token (of the event loop's CPU per streamed
    token, waking a reader task through a queue and two async iterators took about as much as
    the socket write). The frames of ``stream.stream_interval`` tokens go out in one write (one
    chunk, one send: the socket's ``send`` is most of the loop's remaining work per token), and
    the stream's last token (an end, an error, a shutdown) writes what is held and ends it; a
    write that fails ends the response with its error."""

    def __init__(
        self,
        stream: GenerationStream,
        frames: Callable[[GeneratedToken], list[bytes]],
        opening: tuple[bytes, ...] = (),
    ) -> None:
        self._stream = stream
        self._frames = frames
        self._opening = opening
        self._interval = stream.stream_interval
        self._held: list[bytes] = []  # frames of the tokens not written yet
        self._held_tokens = 0
        self._ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._write: Callable[[bytes], None] = lambda part: None

    def start(self, write: Callable[[bytes], None]) -> asyncio.Future[None]:
        self._write = write
        for part in self._opening:
            write(part)
        self._stream.push(self._token)
        return self._ended

    def _token(self, token: GeneratedToken) -> None:
        if self._ended.done():
            return
        try:
            self._held += self._frames(token)
            self._held_tokens += 1
            if token.finish is None and self._held_tokens < self._interval:
                return
            if self._held:
                self._write(b"".join(self._held))
            self._held.clear()
            self._held_tokens = 0
        except Exception as error:  # the response ends with it, rather than wait for more
            self._ended.set_exception(error)
            return
        if token.finish is not None:
            self._ended.set_result(None)

    async def aclose(self) -> None:
        self._stream.close()


def sse_event(value: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(value, separators=(",", ":")).encode() + b"\n\n"


def token_event_writer(
    header: dict[str, Any], with_text: bool
) -> Callable[[GeneratedToken], bytes]:
    """One stream's per-token event as ``sse_event`` writes it (``header`` | ``output_ids``,
    ``index``, ``finish_reason``, then ``text_output`` with a tokenizer), from the header's
    JSON encoded once: a stream sends an event per token, and encoding the whole object each
    time was most of the event loop's CPU per token beside the socket write."""
    opening = b"data: " + json.dumps(header, separators=(",", ":")).encode()[:-1] + b","

    def event(token: GeneratedToken) -> bytes:
        ids = b"[]" if token.token is None else b"[%d]" % token.token
        finish = b"null" if token.finish is None else json.dumps(token.finish).encode()
        text = b',"text_output":' + json.dumps(token.text).encode() if with_text else b""
        return b'%s"output_ids":%s,"index":%d,"finish_reason":%s%s}\n\n' % (
            opening,
            ids,
            token.index,
            finish,
            text,
        )

    return event


def _header(stream: GenerationStream) -> dict[str, Any]:
    header: dict[str, Any] = {
        "model_name": stream.model_name,
        "model_version": stream.model_version,
    }
    if stream.request_id:
        header["id"] = stream.request_id
    return header
