"""ModelStreamInfer for a generation model: Triton's decoupled mode, one response per token.

A request carries ``text_input`` (BYTES, one element; needs the model's tokenizer) or
``input_ids`` (INT32 or INT64, one sequence: shape ``[n]`` or ``[1, n]``); the generate
parameters (``requests.py``) as request parameters, as one-element input tensors of the same
names (TensorRT-LLM's style: ``max_tokens`` INT32 ``[1]``), or as a JSON string in a
``sampling_parameters`` BYTES input (vLLM's backend's style); and optionally ``stream`` (BOOL):
false sends every token in one response. Each response holds ``output_ids`` (INT64, the
token) and, with a tokenizer, ``text_output`` (BYTES, the text the token completes); the
response parameter ``triton_final_response`` is false except on the last one, which also
carries ``finish_reason``. With the request parameter ``triton_enable_empty_final_response``
the last token's response is not final, and an empty response flagged final follows it, as
Triton does. A request the model refuses is answered with its error in the stream
(``error_message``, led by its gRPC status name: ``RESOURCE_EXHAUSTED: ...``, since a stream's
messages carry no status code), and the stream goes on; so is a generation the engine fails
(``INTERNAL: ...``) or a stopping sidecar ends (``UNAVAILABLE: ...``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import struct
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import numpy as np

from cuvil_sidecar.dataplane import DataPlane
from cuvil_sidecar.errors import InvalidInput, SidecarError, grpc_status
from cuvil_sidecar.generation.requests import SAMPLING_KEYS, GenerateRequest, read_parameters
from cuvil_sidecar.generation.sequences import FINISH_ERROR, FINISH_SHUTDOWN
from cuvil_sidecar.generation.servable import (
    INPUT_IDS,
    OUTPUT_IDS,
    TEXT_INPUT,
    TEXT_OUTPUT,
    GeneratedToken,
    GenerationServable,
    GenerationStream,
    ended_error,
)
from cuvil_sidecar.messages import InferInput, InferRequest
from cuvil_sidecar.wire import (
    EncodedInferResponse,
    EncodedStreamResponse,
    encode_response_header,
    stream_error,
    stream_failure,
)

log = logging.getLogger("cuvil_sidecar.generation")

SAMPLING_INPUT, STREAM_INPUT = "sampling_parameters", "stream"
FINAL = "triton_final_response"
EMPTY_FINAL = "triton_enable_empty_final_response"


def open_answers(
    dataplane: DataPlane, request: Any, client_gone: Callable[[], bool] | None = None
) -> TokenAnswers | EncodedStreamResponse:
    """The request's generation opened: its ``TokenAnswers``, or the refusal as its one
    answer. ``client_gone``: the call's check, for a front end that cannot cancel the request
    when the client goes (asked by the scheduler before it runs the request's prompt)."""
    try:
        neutral = InferRequest.from_pb(request)
        streaming = _stream_flag(neutral)
        stream = dataplane.open_generation(
            neutral.model_name,
            neutral.model_version,
            lambda model: dataclasses.replace(_read(model, neutral), client_gone=client_gone),
        )
    except SidecarError as refused:  # the status code leads the message: streams carry none
        return stream_error(request, f"{grpc_status(refused).name}: {refused}")
    return TokenAnswers(stream, neutral, streaming)


async def stream_answers(
    dataplane: DataPlane, request: Any, client_gone: Callable[[], bool] | None = None
) -> AsyncIterator[Any]:
    """The responses (ModelStreamInferResponse messages) to one request of the stream, read
    from its generation with ``async for`` (grpcio's stream takes its answers so)."""
    answers = open_answers(dataplane, request, client_gone)
    if not isinstance(answers, TokenAnswers):
        yield answers
        return
    try:
        async for token in answers.stream:
            for answer in answers.of(token):
                yield answer
            if answers.ended:
                return
    finally:
        answers.stream.close()


class TokenAnswers:
    """One request's answers, token by token: with ``stream`` (the default) one per token, the
    token's id and, with a tokenizer, the text it completes; without it one answer with every
    token at the end; its error instead where the generation fails or the sidecar stops. The
    answers are written field by field (``wire.encode_response_header``), and a token's answer,
    but the last, is the request's header encoded once with the token's entries joined after
    it: a stream sends one per token, and building and serializing a protobuf message each
    time cost several times as much."""

    def __init__(self, stream: GenerationStream, request: InferRequest, streaming: bool) -> None:
        self.stream = stream
        self.request = request
        self.ended = False
        self._streaming = streaming
        self._empty_final = request.parameters.get(EMPTY_FINAL) is True
        self._held: list[int] = []
        self._text: list[str] = []
        self._token_header = self._header(1, 1 if stream.with_text else None, {FINAL: False})

    def of(self, token: GeneratedToken) -> list[EncodedStreamResponse]:
        """The answers ``token`` gives (none while one whole answer is held back); ``ended``
        once the last is among them."""
        if token.finish in (FINISH_ERROR, FINISH_SHUTDOWN):
            self.ended = True
            error = ended_error(token.finish, token.error)
            return [stream_error(self.request, f"{grpc_status(error).name}: {error}")]
        ids = [] if token.token is None else [token.token]
        if token.finish is None:
            if not self._streaming:
                self._held += ids
                self._text.append(token.text)
                return []
            if ids:
                raw = [struct.pack("<q", ids[0])]
                if self.stream.with_text:
                    raw.append(_bytes_element(token.text))
                return [EncodedStreamResponse("", EncodedInferResponse(self._token_header, raw))]
            return [self._answer(ids, self._pieces([token.text]), {FINAL: False})]
        self.ended = True
        pieces = [token.text]
        if not self._streaming:
            ids, pieces = self._held + ids, ["".join([*self._text, token.text])]
        final = not self._empty_final
        parameters: dict[str, bool | str] = {FINAL: final, "finish_reason": token.finish}
        answers = [self._answer(ids, self._pieces(pieces), parameters)]
        if not final:
            answers.append(self._answer([], None, {FINAL: True}))
        return answers

    def _answer(
        self, ids: list[int], pieces: list[str] | None, parameters: dict[str, bool | str]
    ) -> EncodedStreamResponse:
        """An answer with ``ids`` and the text ``pieces`` (None: no text output; no outputs at
        all without ids either)."""
        count = len(ids) if ids or pieces is not None else None
        raw = [] if count is None else [np.asarray(ids, dtype="<i8").tobytes()]
        if pieces is not None:
            raw.append(b"".join(_bytes_element(piece) for piece in pieces))
        header = self._header(count, None if pieces is None else len(pieces), parameters)
        return EncodedStreamResponse("", EncodedInferResponse(header, raw))

    def _header(
        self, ids: int | None, texts: int | None, parameters: dict[str, bool | str]
    ) -> bytes:
        """The answer's fields but its raw contents: ``ids`` token ids and ``texts`` text
        pieces (None: that output left out)."""
        outputs = [] if ids is None else [(OUTPUT_IDS, "INT64", [ids])]
        if texts is not None:
            outputs.append((TEXT_OUTPUT, "BYTES", [texts]))
        stream = self.stream
        return encode_response_header(
            stream.model_name, stream.model_version, self.request.id, outputs, parameters
        )

    def _pieces(self, pieces: list[str]) -> list[str] | None:
        return pieces if self.stream.with_text else None


class PushedAnswers:
    """A request's ``TokenAnswers`` written as the inbox delivers each token
    (``GenerationStream.push``), on the event loop, with no task woken per token: how the
    native front end's streams take them (``native_frontend.PushedAnswers``). ``start(write)``
    returns what completes after the last answer, or once ``write`` says the stream takes no
    more (its client went away): the generation is closed then, which frees its KV slot."""

    def __init__(self, answers: TokenAnswers) -> None:
        self._answers = answers
        self._ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._write: Callable[[bytes], bool] = lambda answer: False

    def start(self, write: Callable[[bytes], bool]) -> asyncio.Future[None]:
        self._write = write
        self._answers.stream.push(self._token)
        return self._ended

    def _token(self, token: GeneratedToken) -> None:
        if self._ended.done():
            return
        try:
            for answer in self._answers.of(token):
                if not self._write(answer.SerializeToString()):
                    self._end()
                    return
        except Exception as failure:  # a bug: answered in the stream, which goes on
            log.exception("ModelStreamInfer failed")
            self._write(stream_failure(self._answers.request, failure).SerializeToString())
            self._end()
            return
        if self._answers.ended:
            self._end()

    def _end(self) -> None:
        self._answers.stream.close()
        self._ended.set_result(None)

    async def aclose(self) -> None:
        self._answers.stream.close()


def _read(model: GenerationServable, request: InferRequest) -> GenerateRequest:
    inputs = {item.name: item for item in request.inputs}
    known = {TEXT_INPUT, INPUT_IDS, SAMPLING_INPUT, STREAM_INPUT} | SAMPLING_KEYS
    unknown = sorted(set(inputs) - known)
    if unknown:
        raise InvalidInput(
            f"unknown input(s) {unknown}; a generation model takes {TEXT_INPUT} or "
            f"{INPUT_IDS}, {SAMPLING_INPUT}, {STREAM_INPUT} and the generate parameters"
        )
    if (TEXT_INPUT in inputs) == (INPUT_IDS in inputs):
        raise InvalidInput(f"give one of the inputs {TEXT_INPUT} (BYTES) or {INPUT_IDS} (INT64)")
    parameters: dict[str, Any] = dict(request.parameters)
    if SAMPLING_INPUT in inputs:
        try:
            extra = json.loads(_single_string(inputs[SAMPLING_INPUT]))
        except ValueError as error:
            raise InvalidInput(f"{SAMPLING_INPUT} is not JSON: {error}") from None
        if not isinstance(extra, dict):
            raise InvalidInput(f"{SAMPLING_INPUT} must be a JSON object")
        parameters |= extra
    for name in SAMPLING_KEYS & set(inputs):
        parameters[name] = _scalar(inputs[name])
    params, stop = read_parameters(
        parameters, model.model.eos_token_ids, model.model.sampling_defaults
    )
    if TEXT_INPUT in inputs:
        return GenerateRequest(None, _single_string(inputs[TEXT_INPUT]), params, stop, request.id)
    return GenerateRequest(_token_ids(inputs[INPUT_IDS]), None, params, stop, request.id)


def _stream_flag(request: InferRequest) -> bool:
    for item in request.inputs:
        if item.name == STREAM_INPUT:
            value = _scalar(item)
            if not isinstance(value, bool):
                raise InvalidInput(f"{STREAM_INPUT} must be a BOOL")
            return value
    return True


def _token_ids(item: InferInput) -> tuple[int, ...]:
    if item.datatype not in ("INT32", "INT64"):
        raise InvalidInput(f"{INPUT_IDS} must be INT32 or INT64, not {item.datatype}")
    if len(item.shape) > 2 or (len(item.shape) == 2 and item.shape[0] != 1):
        raise InvalidInput(f"{INPUT_IDS} holds one sequence: shape [n] or [1, n]")
    values = _numbers(item, "<i4" if item.datatype == "INT32" else "<i8")
    if len(values) != int(np.prod(item.shape)):
        raise InvalidInput(f"{INPUT_IDS} holds {len(values)} values for shape {list(item.shape)}")
    return tuple(int(v) for v in values)


def _scalar(item: InferInput) -> Any:
    kinds = {"BOOL": "?", "INT32": "<i4", "INT64": "<i8", "FP32": "<f4", "FP64": "<f8"}
    if item.datatype == "BYTES":
        return _single_string(item)
    if item.datatype not in kinds:
        raise InvalidInput(f"input {item.name!r}: {item.datatype} is not taken here")
    values = _numbers(item, kinds[item.datatype])
    if len(values) != 1:
        raise InvalidInput(f"input {item.name!r} must hold one value")
    return values[0].item()


def _numbers(item: InferInput, dtype: str) -> np.ndarray:
    if item.raw is not None:
        raw = memoryview(item.raw).cast("B")
        if len(raw) % np.dtype(dtype).itemsize:
            raise InvalidInput(f"input {item.name!r}: {len(raw)} bytes is not whole values")
        return np.frombuffer(raw, dtype=dtype)
    for values in item.typed.values():
        return np.asarray(list(values), dtype=dtype)
    return np.asarray([], dtype=dtype)


def _single_string(item: InferInput) -> str:
    if item.datatype != "BYTES":
        raise InvalidInput(f"input {item.name!r} must be BYTES, not {item.datatype}")
    elements = list(_bytes_elements(item))
    if len(elements) != 1:
        raise InvalidInput(f"input {item.name!r} must hold one string, not {len(elements)}")
    try:
        return elements[0].decode()
    except UnicodeDecodeError:
        raise InvalidInput(f"input {item.name!r} is not UTF-8") from None


def _bytes_elements(item: InferInput) -> Iterator[bytes]:
    """A BYTES tensor's elements: raw contents are each a 4-byte little-endian length and
    the bytes; typed ones are ``bytes_contents``."""
    if item.raw is None:
        yield from (bytes(v) for v in item.typed.get("bytes_contents", ()))
        return
    raw = bytes(item.raw)
    at = 0
    while at < len(raw):
        if at + 4 > len(raw):
            raise InvalidInput(f"input {item.name!r}: a BYTES element's length is cut short")
        (size,) = struct.unpack_from("<I", raw, at)
        if at + 4 + size > len(raw):
            raise InvalidInput(f"input {item.name!r}: a BYTES element runs past the data")
        yield raw[at + 4 : at + 4 + size]
        at += 4 + size


def _bytes_element(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<I", len(data)) + data
