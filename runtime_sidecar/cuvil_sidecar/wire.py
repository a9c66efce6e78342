"""Cutting a large ModelInfer request's tensor bytes out of its protobuf before parsing it.

Parsed whole, each ``raw_input_contents`` entry is copied twice more on its way to a tensor:
into the parsed message, and out of it as a Python ``bytes`` (then once more into the tensor's
own buffer). ``split_infer_request`` walks the message's top-level fields instead, parses only
the rest (names, shapes, parameters: a few hundred bytes), and hands the entries on as views
into the request's bytes, so that the tensor's own copy is the only one. ResNet-50's 600 KB
image: two 600 KB copies fewer per call.

Small requests are parsed whole: below ``SPLIT_FROM`` bytes the walk costs more than the
copies it saves. Bytes that are not a valid message are parsed whole too, so that protobuf
reports them as it always does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from google.protobuf.message import DecodeError

from cuvil_sidecar._generated import grpc_service_pb2 as pb

SPLIT_FROM = 64 * 1024
RAW_INPUT_CONTENTS = pb.ModelInferRequest.DESCRIPTOR.fields_by_name["raw_input_contents"].number
_LENGTH_DELIMITED = 2


class SplitInferRequest:
    """A ModelInferRequest parsed without its ``raw_input_contents``, which it carries as
    views into the request's bytes; every other field reads through to the parsed message."""

    def __init__(self, header: Any, raw_input_contents: Sequence[memoryview]) -> None:
        self._header = header
        self.raw_input_contents = raw_input_contents

    def __getattr__(self, name: str) -> Any:
        return getattr(self._header, name)


def split_infer_request(payload: bytes, split_from: int = SPLIT_FROM) -> Any:
    """``payload`` as a ModelInferRequest, its tensor bytes uncopied when it is large."""
    if len(payload) < split_from:
        return pb.ModelInferRequest.FromString(payload)
    try:
        rest, raws = cut_field(payload, RAW_INPUT_CONTENTS)
    except DecodeError:
        return pb.ModelInferRequest.FromString(payload)  # raises DecodeError, as protobuf says
    return SplitInferRequest(pb.ModelInferRequest.FromString(rest), raws)


def cut_field(payload: bytes, number: int) -> tuple[bytes, list[memoryview]]:
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


def _varint(data: bytes, at: int) -> tuple[int, int]:
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
