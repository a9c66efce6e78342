"""The native front end splits a large ModelInfer before Python sees it (``frontend.cc``): the
rest of the message parses to what protobuf reads, each tensor's bytes arrive equal, in memory
of their own at a 64-byte boundary, which is freed once nothing holds it; bytes that are no
message still get INVALID_ARGUMENT, and small requests are parsed whole as before.

A ``NativeFrontend`` runs in this process with a handler that keeps what it was given; the
messages are NVIDIA's (tritonclient's generated module: the same wire format)."""

from __future__ import annotations

import asyncio
import functools
import gc
import weakref
from typing import Any

import grpc
import numpy as np
import pytest
from cuvil_sidecar import wire
from cuvil_sidecar.codec import decode_input
from cuvil_sidecar.messages import InferRequest
from cuvil_sidecar.native_frontend import Method, NativeFrontend
from tritonclient.grpc import service_pb2 as pb

MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
SPLIT_FROM = 4096


class Empty:
    def SerializeToString(self) -> bytes:  # protobuf's name: the front end calls it
        return b""


class Recording:
    """A ModelInfer handler that keeps every request it is given."""

    def __init__(self) -> None:
        self.requests: list[Any] = []

    async def infer(self, request: Any, context: Any) -> Empty:
        self.requests.append(request)
        return Empty()


def _method(recording: Recording) -> Method:
    infer = pb.ModelInferRequest
    return Method(
        MODEL_INFER,
        infer,
        recording.infer,
        functools.partial(wire.split_infer_request, request_type=infer, owned_tensors=True),
        wire.RAW_INPUT_CONTENTS,
        functools.partial(wire.infer_request_from_split, request_type=infer),
    )


def _send(port: int, payloads: list[bytes]) -> list[grpc.StatusCode]:
    codes = []
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(MODEL_INFER)  # bytes in, bytes out
        for payload in payloads:
            try:
                call(payload, timeout=30)
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as error:
                codes.append(error.code())
    return codes


def _serve(payloads: list[bytes]) -> tuple[list[grpc.StatusCode], list[Any]]:
    """Each payload sent in turn to a fresh front end; the status codes and what the handler
    was given."""
    recording = Recording()

    async def main() -> list[grpc.StatusCode]:
        frontend = NativeFrontend([_method(recording)], (), 64 * 2**20, split_from=SPLIT_FROM)
        port = await frontend.start("127.0.0.1:0")
        try:
            return await asyncio.get_running_loop().run_in_executor(None, _send, port, payloads)
        finally:
            await frontend.stop(1.0)

    return asyncio.run(main()), recording.requests


def _request(sizes: list[int]) -> pb.ModelInferRequest:
    rng = np.random.default_rng(len(sizes))
    request = pb.ModelInferRequest(model_name="resnet50", model_version="1", id="split")
    request.parameters["priority"].int64_param = 3
    for index, size in enumerate(sizes):
        tensor = request.inputs.add(name=f"input{index}", datatype="INT8", shape=[size])
        tensor.parameters["note"].string_param = "x" * index
        request.raw_input_contents.append(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
    request.outputs.add(name="logits")
    return request


def _interleaved(request: pb.ModelInferRequest) -> bytes:
    """The same message with its tensor entries between its other fields, as protobuf allows."""
    rest = pb.ModelInferRequest()
    rest.CopyFrom(request)
    rest.ClearField("raw_input_contents")
    pieces = [
        pb.ModelInferRequest(raw_input_contents=[raw]).SerializeToString()
        for raw in request.raw_input_contents
    ]
    return pieces[0] + rest.SerializeToString() + b"".join(pieces[1:])


def _owner(array: np.ndarray) -> Any:
    while isinstance(array, np.ndarray):
        array = array.base
    return array


def test_a_large_request_arrives_split_aligned_and_equal() -> None:
    request = _request([100_003, 3, 0, 70_001])
    payloads = [request.SerializeToString(), _interleaved(request)]
    codes, received = _serve(payloads)
    assert codes == [grpc.StatusCode.OK] * 2
    expected_rest = pb.ModelInferRequest()
    expected_rest.CopyFrom(request)
    expected_rest.ClearField("raw_input_contents")
    for got in received:
        assert isinstance(got, wire.SplitInferRequest)
        assert got.model_name == "resnet50" and got.id == "split"
        assert list(got.inputs) == list(expected_rest.inputs)
        assert list(got.outputs) == list(expected_rest.outputs)
        assert got.parameters["priority"].int64_param == 3
        raws = got.raw_input_contents
        assert [bytes(raw) for raw in raws] == list(request.raw_input_contents)
        for raw in raws:
            assert isinstance(raw, np.ndarray) and raw.dtype == np.uint8
            assert raw.flags.writeable
            assert raw.ctypes.data % 64 == 0
        # the tensors take that memory as their own, uncopied
        item = InferRequest.from_pb(got).inputs[0]
        tensor = decode_input(item, max_bytes=2**30)
        assert tensor.data_ptr() == raws[0].ctypes.data
        assert tensor.numpy().tobytes() == request.raw_input_contents[0]


def test_the_split_buffer_is_freed_with_the_last_view() -> None:
    codes, received = _serve([_request([50_000, 20_000]).SerializeToString()])
    assert codes == [grpc.StatusCode.OK]
    (got,) = received
    first, second = got.raw_input_contents
    owner = weakref.ref(_owner(first))
    assert _owner(second) is owner()  # one buffer holds both
    del got, received, first
    gc.collect()
    assert owner() is not None  # the second view still reads it
    kept = bytes(second)
    del second
    gc.collect()
    assert owner() is None
    assert len(kept) == 20_000


def test_a_large_request_with_only_empty_tensors() -> None:
    request = pb.ModelInferRequest(model_name="m" * SPLIT_FROM)  # large for its header alone
    request.inputs.add(name="empty", datatype="INT8", shape=[0])
    request.raw_input_contents.append(b"")
    codes, (got,) = _serve([request.SerializeToString()])
    assert codes == [grpc.StatusCode.OK]
    assert isinstance(got, wire.SplitInferRequest) and got.model_name == request.model_name
    (raw,) = got.raw_input_contents
    assert isinstance(raw, np.ndarray) and raw.size == 0


def test_small_requests_are_parsed_whole() -> None:
    request = _request([10, 20])
    assert len(request.SerializeToString()) < SPLIT_FROM
    codes, (got,) = _serve([request.SerializeToString()])
    assert codes == [grpc.StatusCode.OK]
    assert not isinstance(got, wire.SplitInferRequest)
    assert got == request


@pytest.mark.parametrize(
    "damage",
    [
        lambda payload: payload[: len(payload) - 10],  # a tensor entry cut short
        lambda payload: payload + b"\x0f\x01",  # wire type 7 does not exist
        lambda payload: payload + b"\x80" * 11,  # an overlong varint
    ],
    ids=["truncated", "bad-wire-type", "overlong-varint"],
)
def test_large_bytes_that_are_no_message_get_invalid_argument(damage: Any) -> None:
    payload = _request([60_000]).SerializeToString()
    good = _request([8]).SerializeToString()
    codes, received = _serve([damage(payload), good])
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OK]
    assert len(received) == 1 and received[0].model_name == "resnet50"
