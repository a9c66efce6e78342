"""Tensor bytes in and out of ModelInfer's protobuf messages without copying them about.

**Requests.** Cutting a large ModelInferRequest's tensor bytes out before parsing it.

Parsed whole, each ``raw_input_contents`` entry is copied twice more on its way to a tensor:
into the parsed message, and out of it as a Python ``bytes`` (then once more into the tensor's
own buffer). ``split_infer_request`` walks the message's top-level fields instead, parses only
the rest (names, shapes, parameters: a few hundred bytes), and hands the entries on without
copying them through protobuf. Where the payload is Python's own ``bytes`` (grpcio), the entries
are views into it and decoding makes the tensor's copy. The native front end splits large
requests in C++ before Python sees them (``infer_request_from_split``); a large request it hands
over whole (it could not allocate the tensors' buffer) lies in gRPC's buffer, lent only for the
call, so with ``owned_tensors`` each entry is copied once into a ``bytearray`` that decoding
hands to the tensor as it is: one copy from the wire to the tensor in every case. ResNet-50's
600 KB image: two or three 600 KB copies fewer per call.

Small requests are parsed whole: below ``SPLIT_FROM`` bytes the walk costs more than the
copies it saves. Bytes that are not a valid message are parsed whole too, so that protobuf
reports them as it always does.

**Responses.** ``EncodedInferResponse`` writes a response's fields other than
``raw_output_contents`` and appends those entries after them in one join, so an output's bytes
are copied once, from the tensor into the answer, instead of three times (into a ``bytes``, into
the message, into its serialization): MiniLM's 196 KB hidden state, or an LLM's logits.
Protobuf reads fields in any order, and repeated ones in the order they come. The other fields
are written by hand (``encode_response_header``) unless an output carries parameters: right
after a model's run every cache is cold, and building the message with protobuf then costs
several times what writing its few fields by hand does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from google.protobuf.message import DecodeError

SPLIT_FROM = 64 * 1024  # request bytes from which the tensors are cut out
# Field numbers of the protocol (KServe's and Triton's grpc_service.proto; tests check ours).
# No generated module is imported here: tests load NVIDIA's, and the two cannot share a process.
RAW_INPUT_CONTENTS = 7  # ModelInferRequest.raw_input_contents
RAW_OUTPUT_CONTENTS = 6  # ModelInferResponse.raw_output_contents
_PARAMETERS = 4  # ModelInferResponse.parameters
_OUTPUTS = 5  # ModelInferResponse.outputs
_LENGTH_DELIMITED = 2
_INT64 = 2**64 - 1


class EncodedInferResponse:
    """A ModelInferResponse (``header``, without raw_output_contents: a message or its bytes)
    and its raw output entries, serialized as one message by ``SerializeToString``."""

    def __init__(
        self, header: Any | bytes, raw_output_contents: Sequence[bytes | memoryview]
    ) -> None:
        self.header = header
        self.raw_output_contents = raw_output_contents

    def SerializeToString(self) -> bytes:  # protobuf's name: both gRPC servers call it
        tag = encode_varint(RAW_OUTPUT_CONTENTS << 3 | _LENGTH_DELIMITED)
        header = self.header
        parts: list[bytes | memoryview] = [
            header if isinstance(header, bytes) else header.SerializeToString()
        ]
        for raw in self.raw_output_contents:
            parts += (tag, encode_varint(memoryview(raw).nbytes), raw)
        return b"".join(parts)


class EncodedStreamResponse:
    """A ModelStreamInferResponse: an error message, or an answer (an ``EncodedInferResponse``)
    written as its ``infer_response`` without being parsed or copied into a message."""

    def __init__(self, error_message: str, infer_response: Any) -> None:
        self.error_message = error_message
        self.infer_response = infer_response

    def SerializeToString(self) -> bytes:
        parts = [_string_field(1, self.error_message)] if self.error_message else []
        inner = self.infer_response.SerializeToString()
        parts.append(_sized_field(2, inner))
        return b"".join(parts)


def stream_error(request: Any, message: str) -> EncodedStreamResponse:
    """A ModelStreamInfer message's error as its answer in the stream (whose messages carry
    no status): the message, with the request's model, version and id (``request``: a
    ModelInferRequest, or anything with those three fields)."""
    header = encode_response_header(request.model_name, request.model_version, request.id, [])
    return EncodedStreamResponse(message, EncodedInferResponse(header, []))


def stream_failure(request: Any, failure: Exception) -> EncodedStreamResponse:
    """A bug met answering a ModelStreamInfer message, as that message's error in the stream
    (which goes on)."""
    return stream_error(request, f"internal error in ModelStreamInfer: {failure!r}")


def encode_response_header(
    model_name: str,
    model_version: str,
    id: str,
    outputs: Sequence[tuple[str, str, Sequence[int]]],
    parameters: Mapping[str, bool | str] | None = None,
) -> bytes:
    """A ModelInferResponse without raw_output_contents, serialized as protobuf serializes it
    (fields in order, proto3's empty values left out); ``outputs``: each InferOutputTensor's
    name, datatype and shape; ``parameters``: the response's, each a ``bool_param`` or a
    ``string_param``."""
    parts = [
        _string_field(number, text)
        for number, text in ((1, model_name), (2, model_version), (3, id))
        if text
    ]
    for key, value in (parameters or {}).items():
        parts.append(
            _sized_field(_PARAMETERS, _string_field(1, key) + _sized_field(2, _param(value)))
        )
    for name, datatype, shape in outputs:
        tensor = _string_field(1, name) if name else b""
        if datatype:
            tensor += _string_field(2, datatype)
        if shape:  # packed int64: a negative one takes ten bytes, as two's complement
            tensor += _sized_field(3, b"".join(encode_varint(dim & _INT64) for dim in shape))
        parts.append(_sized_field(_OUTPUTS, tensor))
    return b"".join(parts)


def _param(value: bool | str) -> bytes:
    """An InferParameter: a member of its oneof is written even when it holds its default."""
    if isinstance(value, bool):
        return b"\x08\x01" if value else b"\x08\x00"  # bool_param = 1, a varint
    return _string_field(3, value)  # string_param = 3


def _string_field(number: int, text: str) -> bytes:
    return _sized_field(number, text.encode())


def _sized_field(number: int, payload: bytes) -> bytes:
    return encode_varint(number << 3 | _LENGTH_DELIMITED) + encode_varint(len(payload)) + payload


def encode_varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


class SplitInferRequest:
    """A ModelInferRequest parsed without its ``raw_input_contents``, which it carries as
    views into the request's bytes or as memory of their own (a ``bytearray``, or a numpy
    uint8 array from the native front end); every other field reads through to the parsed
    message."""

    def __init__(self, header: Any, raw_input_contents: Sequence[Any]) -> None:
        self._header = header
        self.raw_input_contents = raw_input_contents

    def __getattr__(self, name: str) -> Any:
        return getattr(self._header, name)


def split_infer_request(
    payload: bytes | memoryview,
    request_type: Any,
    split_from: int = SPLIT_FROM,
    *,
    owned_tensors: bool = False,
) -> Any:
    """``payload`` as a ``request_type`` (ModelInferRequest), its tensor bytes uncopied when it
    is large. With ``owned_tensors`` the result keeps nothing of ``payload`` (which may be a
    view of memory lent for the call): a large request's tensor bytes become ``bytearray``
    copies, which the tensors may take as their own memory."""
    if len(payload) < split_from:
        return request_type.FromString(bytes(payload))
    try:
        rest, raws = cut_field(payload, RAW_INPUT_CONTENTS)
    except DecodeError:
        return request_type.FromString(bytes(payload))  # raises DecodeError, as protobuf says
    header = request_type.FromString(rest)
    if owned_tensors:
        return SplitInferRequest(header, [bytearray(raw) for raw in raws])
    return SplitInferRequest(header, raws)


def infer_request_from_split(
    rest: bytes | memoryview, raw_input_contents: Sequence[Any], request_type: Any
) -> SplitInferRequest:
    """A ModelInferRequest cut apart elsewhere (the native front end): its bytes without
    ``raw_input_contents``, and those entries, in order, as memory of their own."""
    return SplitInferRequest(request_type.FromString(bytes(rest)), raw_input_contents)


def cut_field(payload: bytes | memoryview, number: int) -> tuple[bytes, list[memoryview]]:
    """The top-level length-delimited fields ``number`` of a serialized message, cut out:
    (the message without them, their contents in order as views into ``payload``)."""
    view = memoryview(payload)
    kept: list[memoryview] = []
    cut: list[memoryview] = []
    start = at = 0
    end = len(payload)
    while at < end:
        field_start = at
        tag, at = _varint(payload, at)
        wire_type = tag & 7
        if wire_type == 0:
            _, at = _varint(payload, at)
        elif wire_type == 1:
            at += 8
        elif wire_type == 5:
            at += 4
        elif wire_type == _LENGTH_DELIMITED:
            size, at = _varint(payload, at)
            if tag >> 3 == number:
                if at + size > end:
                    raise DecodeError("truncated field")
                kept.append(view[start:field_start])
                cut.append(view[at : at + size])
                start = at + size
            at += size
        else:  # groups (3, 4) are not used by this protocol; 6 and 7 do not exist
            raise DecodeError(f"wire type {wire_type}")
        if at > end:
            raise DecodeError("truncated field")
    kept.append(view[start:])
    return b"".join(kept), cut


def _varint(data: bytes | memoryview, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(data) or shift > 63:
            raise DecodeError("truncated or overlong varint")
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7
