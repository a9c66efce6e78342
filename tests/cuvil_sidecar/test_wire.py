"""Cutting raw_input_contents out of a large ModelInferRequest (cuvil_sidecar/wire.py) reads
exactly what protobuf reads: the same fields, the same tensor bytes, the same failures; and a
response serialized from tensor views is the message protobuf would write.

The messages are NVIDIA's (tritonclient's generated module): the same wire format as the
sidecar's, which cannot be loaded beside it in one process (test_proto checks they agree)."""

from __future__ import annotations

import random

import pytest
from cuvil_sidecar import wire
from cuvil_sidecar.messages import InferRequest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2 as pb

names = st.text(min_size=0, max_size=12)
parameters = st.dictionaries(
    names,
    st.one_of(
        st.builds(lambda v: pb.InferParameter(string_param=v), names),
        st.builds(lambda v: pb.InferParameter(int64_param=v), st.integers(-(2**63), 2**63 - 1)),
        st.builds(lambda v: pb.InferParameter(bool_param=v), st.booleans()),
    ),
    max_size=3,
)


@st.composite
def requests(draw: st.DrawFn) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(
        model_name=draw(names), model_version=draw(names), id=draw(names)
    )
    for key, value in draw(parameters).items():
        request.parameters[key].CopyFrom(value)
    for _ in range(draw(st.integers(0, 3))):
        tensor = request.inputs.add(
            name=draw(names), datatype=draw(st.sampled_from(["FP32", "INT64"]))
        )
        tensor.shape.extend(draw(st.lists(st.integers(-1, 2**40), max_size=4)))
        for key, value in draw(parameters).items():
            tensor.parameters[key].CopyFrom(value)
        request.raw_input_contents.append(draw(st.binary(max_size=300)))
    for _ in range(draw(st.integers(0, 2))):
        request.outputs.add(name=draw(names))
    return request


def _without_raws(request: pb.ModelInferRequest) -> pb.ModelInferRequest:
    copy = pb.ModelInferRequest()
    copy.CopyFrom(request)
    copy.ClearField("raw_input_contents")
    return copy


@settings(max_examples=300, deadline=None)
@given(requests(), st.randoms(use_true_random=False))
def test_cutting_reads_what_protobuf_reads(
    request: pb.ModelInferRequest, rng: random.Random
) -> None:
    # Serialized in field order, and as shuffled pieces: a parser must take fields in any order
    pieces = [
        pb.ModelInferRequest(raw_input_contents=[raw]).SerializeToString()
        for raw in request.raw_input_contents
    ]
    pieces.append(_without_raws(request).SerializeToString())
    rng.shuffle(pieces)
    for payload in (request.SerializeToString(), b"".join(pieces)):
        whole = pb.ModelInferRequest.FromString(payload)
        rest, raws = wire.cut_field(payload, wire.RAW_INPUT_CONTENTS)
        assert pb.ModelInferRequest.FromString(rest) == _without_raws(whole)
        assert [bytes(raw) for raw in raws] == list(whole.raw_input_contents)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=200))
def test_bytes_that_are_no_message_fail_as_protobuf_fails(payload: bytes) -> None:
    try:
        expected = pb.ModelInferRequest.FromString(payload)
    except DecodeError:
        with pytest.raises(DecodeError):
            wire.split_infer_request(payload, pb.ModelInferRequest, split_from=0)
        return
    got = wire.split_infer_request(payload, pb.ModelInferRequest, split_from=0)
    assert list(got.raw_input_contents) == list(expected.raw_input_contents)
    assert got.model_name == expected.model_name and list(got.inputs) == list(expected.inputs)


def test_a_large_request_reaches_the_tensors_uncopied_and_equal() -> None:
    image = bytes(range(256)) * 2400  # 600 KB, ResNet-50's input
    request = pb.ModelInferRequest(model_name="resnet50", id="7")
    request.inputs.add(name="pixel_values", datatype="FP32", shape=[1, 3, 224, 224])
    request.raw_input_contents.append(image)
    payload = request.SerializeToString()
    assert len(payload) >= wire.SPLIT_FROM
    split = wire.split_infer_request(payload, pb.ModelInferRequest)
    assert isinstance(split, wire.SplitInferRequest)
    assert isinstance(split.raw_input_contents[0], memoryview)  # a view: no copy made
    assert split.raw_input_contents[0].obj is payload
    ours, theirs = InferRequest.from_pb(split), InferRequest.from_pb(request)
    assert ours.model_name == "resnet50" and ours.id == "7"
    assert [bytes(i.raw or b"") for i in ours.inputs] == [
        bytes(i.raw or b"") for i in theirs.inputs
    ]
    assert [(i.name, i.shape) for i in ours.inputs] == [(i.name, i.shape) for i in theirs.inputs]
    small = pb.ModelInferRequest(model_name="mlp").SerializeToString()
    assert not isinstance(
        wire.split_infer_request(small, pb.ModelInferRequest), wire.SplitInferRequest
    )


def test_a_lent_request_is_copied_once_into_tensors_of_its_own() -> None:
    """The native front end parses gRPC's buffer while it is lent: nothing of it may be kept,
    and each tensor's bytes are copied once, into memory the tensor then takes as it is."""
    import torch
    from cuvil_sidecar.codec import decode_input

    image = torch.randn(1, 3, 224, 224)
    request = pb.ModelInferRequest(model_name="resnet50", id="7")
    request.inputs.add(name="pixel_values", datatype="FP32", shape=[1, 3, 224, 224])
    request.raw_input_contents.append(image.numpy().tobytes())
    lent = bytearray(request.SerializeToString())
    split = wire.split_infer_request(memoryview(lent), pb.ModelInferRequest, owned_tensors=True)
    lent[:] = bytes(len(lent))  # gRPC reuses its buffer once the call is handed over
    assert split.model_name == "resnet50" and split.id == "7"
    (raw,) = split.raw_input_contents
    assert isinstance(raw, bytearray)
    (item,) = InferRequest.from_pb(split).inputs
    tensor = decode_input(item, max_bytes=2**30)
    assert torch.equal(tensor, image)
    # the tensor is the bytearray's memory, not a copy of it
    assert tensor.data_ptr() == torch.frombuffer(raw, dtype=torch.uint8).data_ptr()
    small = pb.ModelInferRequest(model_name="mlp", raw_input_contents=[b"\0" * 8])
    lent = bytearray(small.SerializeToString())
    parsed = wire.split_infer_request(memoryview(lent), pb.ModelInferRequest, owned_tensors=True)
    lent[:] = bytes(len(lent))
    assert parsed.model_name == "mlp" and list(parsed.raw_input_contents) == [b"\0" * 8]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(names, st.lists(st.integers(0, 2**40), max_size=3)), max_size=3),
    st.lists(st.binary(max_size=400), min_size=3, max_size=3),
)
def test_an_encoded_response_is_the_message_protobuf_would_write(
    outputs: list[tuple[str, list[int]]], raws: list[bytes]
) -> None:
    header = pb.ModelInferResponse(model_name="m", model_version="1", id="x")
    for name, shape in outputs:
        header.outputs.add(name=name, datatype="FP32", shape=shape)
    entries = raws[: len(outputs)]
    expected = pb.ModelInferResponse()
    expected.CopyFrom(header)
    expected.raw_output_contents.extend(entries)
    encoded = wire.EncodedInferResponse(header, [memoryview(raw) for raw in entries])
    assert pb.ModelInferResponse.FromString(encoded.SerializeToString()) == expected


def test_output_tensors_are_encoded_from_views_and_read_back_equal() -> None:
    import torch
    from cuvil_sidecar.codec import encode_output

    hidden, pooled = torch.randn(1, 128, 384), torch.randn(1, 384)  # MiniLM's outputs
    outputs = [encode_output("last_hidden_state", hidden), encode_output("pooler_output", pooled)]
    assert all(isinstance(output.raw, memoryview) for output in outputs)  # no copy yet
    header = pb.ModelInferResponse(model_name="minilm", model_version="1")
    for output in outputs:
        header.outputs.add(name=output.name, datatype=output.datatype, shape=output.shape)
    encoded = wire.EncodedInferResponse(header, [output.raw for output in outputs])
    parsed = pb.ModelInferResponse.FromString(encoded.SerializeToString())
    assert [output.name for output in parsed.outputs] == ["last_hidden_state", "pooler_output"]
    assert list(parsed.outputs[0].shape) == [1, 128, 384]
    assert parsed.raw_output_contents[0] == hidden.numpy().tobytes()
    assert parsed.raw_output_contents[1] == pooled.numpy().tobytes()


@settings(max_examples=300, deadline=None)
@given(
    names,
    names,
    names,
    st.lists(
        st.tuples(
            names,
            st.sampled_from(["", "FP32", "BF16", "BOOL"]),
            st.lists(st.integers(-(2**63), 2**63 - 1), max_size=4),
        ),
        max_size=3,
    ),
    st.lists(st.binary(max_size=300), min_size=3, max_size=3),
    st.dictionaries(names, st.booleans() | names, max_size=3),
)
def test_a_hand_written_response_header_is_what_protobuf_writes(
    model_name: str,
    model_version: str,
    request_id: str,
    outputs: list[tuple[str, str, list[int]]],
    raws: list[bytes],
    parameters: dict[str, bool | str],
) -> None:
    expected = pb.ModelInferResponse(model_name=model_name, model_version=model_version)
    expected.id = request_id
    for key, value in parameters.items():
        if isinstance(value, bool):
            expected.parameters[key].bool_param = value
        else:
            expected.parameters[key].string_param = value
    for name, datatype, shape in outputs:
        expected.outputs.add(name=name, datatype=datatype, shape=shape)
    header = wire.encode_response_header(model_name, model_version, request_id, outputs, parameters)
    assert pb.ModelInferResponse.FromString(header) == expected
    if len(parameters) < 2:  # a map's entries come in no fixed order
        assert header == expected.SerializeToString()  # byte for byte
    entries = raws[: len(outputs)]
    expected.raw_output_contents.extend(entries)
    encoded = wire.EncodedInferResponse(header, entries).SerializeToString()
    assert pb.ModelInferResponse.FromString(encoded) == expected


def test_plain_outputs_are_encoded_as_views_of_their_memory() -> None:
    """One torch call for a plain CPU tensor: its bytes are a view of its memory; anything else
    (bf16, a transposed view, a tensor that needs grad, an empty one) is still encoded right."""
    import numpy as np
    import torch
    from cuvil_sidecar.codec import encode_output

    logits = torch.randn(1, 1000)
    raw = encode_output("logits", logits).raw
    assert isinstance(raw, memoryview)
    assert np.frombuffer(raw, dtype=np.uint8).ctypes.data == logits.data_ptr()
    for tensor in (
        torch.tensor([True, False, True]),
        torch.randn(2, 3).to(torch.bfloat16),
        torch.randn(3, 4).t(),
        torch.zeros(1, 0),
        torch.randn(2, 2, requires_grad=True),
        torch.randn(5).half(),
        torch.tensor(3.0),
        torch.arange(6, dtype=torch.int64).reshape(2, 3),
    ):
        output = encode_output("y", tensor)
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        assert bytes(output.raw) == flat.numpy().tobytes()
        assert output.shape == tuple(tensor.shape)


def test_the_field_numbers_are_the_protocols() -> None:
    request = pb.ModelInferRequest.DESCRIPTOR.fields_by_name["raw_input_contents"]
    response = pb.ModelInferResponse.DESCRIPTOR.fields_by_name["raw_output_contents"]
    assert (request.number, response.number) == (wire.RAW_INPUT_CONTENTS, wire.RAW_OUTPUT_CONTENTS)
