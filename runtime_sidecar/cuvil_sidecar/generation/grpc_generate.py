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
messages carry no status code), and the stream goes on.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import numpy as np

from cuvil_sidecar.dataplane import DataPlane
from cuvil_sidecar.errors import InvalidInput, SidecarError, grpc_status
from cuvil_sidecar.generation.requests import SAMPLING_KEYS, GenerateRequest, read_parameters
from cuvil_sidecar.generation.scheduler import FINISH_ERROR, FINISH_SHUTDOWN
from cuvil_sidecar.generation.servable import (
    INPUT_IDS,
    OUTPUT_IDS,
    TEXT_INPUT,
    TEXT_OUTPUT,
    GenerationServable,
)
from cuvil_sidecar.messages import InferInput, InferRequest

SAMPLING_INPUT, STREAM_INPUT = "sampling_parameters", "stream"
FINAL = "triton_final_response"
EMPTY_FINAL = "triton_enable_empty_final_response"


async def stream_answers(
    dataplane: DataPlane, request: Any, client_gone: Callable[[], bool] | None = None
) -> AsyncIterator[Any]:
    """The responses (ModelStreamInferResponse messages) to one request of the stream;
    ``client_gone``: the call's check, for a front end that cannot cancel this generator when
    the client goes (asked by the scheduler before it runs the request's prompt)."""
    from cuvil_sidecar._generated import grpc_service_pb2 as pb

    def error(message: str) -> Any:
        infer = pb.ModelInferResponse(
            model_name=request.model_name, model_version=request.model_version, id=request.id
        )
        return pb.ModelStreamInferResponse(error_message=message, infer_response=infer)

    try:
        neutral = InferRequest.from_pb(request)
        streaming = _stream_flag(neutral)
        stream = dataplane.open_generation(
            neutral.model_name,
            neutral.model_version,
            lambda model: dataclasses.replace(_read(model, neutral), client_gone=client_gone),
        )
    except SidecarError as refused:  # the status code leads the message: streams carry none
        yield error(f"{grpc_status(refused).name}: {refused}")
        return
    empty_final = neutral.parameters.get(EMPTY_FINAL) is True
    try:
        held: list[int] = []
        text = []
        async for token in stream:
            if token.finish in (FINISH_ERROR, FINISH_SHUTDOWN):
                yield error(token.error or f"the generation ended: {token.finish}")
                return
            ids = [] if token.token is None else [token.token]
            if not streaming:
                held += ids
                text.append(token.text)
                if token.finish is None:
                    continue
                ids, pieces = held, ["".join(text)]
            else:
                pieces = [token.text]
            last = token.finish is not None
            yield _response(
                pb, neutral, stream.model_name, stream.model_version, ids,
                pieces if stream.with_text else None,
                final=last and not empty_final, finish=token.finish,
            )  # fmt: skip
            if last and empty_final:
                yield _response(
                    pb, neutral, stream.model_name, stream.model_version, [], None, final=True
                )
    finally:
        stream.close()


def _response(
    pb: Any,
    request: InferRequest,
    model: str,
    version: str,
    ids: list[int],
    pieces: list[str] | None,
    *,
    final: bool,
    finish: str | None = None,
) -> Any:
    response = pb.ModelInferResponse(model_name=model, model_version=version, id=request.id)
    response.parameters[FINAL].bool_param = final
    if finish is not None:
        response.parameters["finish_reason"].string_param = finish
    if ids or pieces is not None:
        response.outputs.add(name=OUTPUT_IDS, datatype="INT64", shape=[len(ids)])
        response.raw_output_contents.append(np.asarray(ids, dtype="<i8").tobytes())
    if pieces is not None:
        response.outputs.add(name=TEXT_OUTPUT, datatype="BYTES", shape=[len(pieces)])
        response.raw_output_contents.append(b"".join(_bytes_element(p) for p in pieces))
    return pb.ModelStreamInferResponse(infer_response=response)


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
    params, stop = read_parameters(parameters, model.model.eos_token_ids)
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
