"""Every datatype the issue names, end to end: a model with FP16, BF16, INT32 and BOOL inputs
and outputs, called through tritonclient (raw contents) and NVIDIA's stubs (typed contents),
plus the codec's round trips in process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import ml_dtypes
import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from cuvil_sidecar.codec import DATATYPES, decode_input, encode_output
from cuvil_sidecar.errors import InvalidInput
from cuvil_sidecar.messages import InferInput
from torch.export import Dim
from tritonclient.grpc import service_pb2, service_pb2_grpc

from cuvil.models.catalog import ModelSpec
from tests.cuvil_sidecar.conftest import Sidecar, compile_spec, ready_sidecar


class Mixed(torch.nn.Module):
    def forward(self, a, b, c, d):
        return a * 2, b + 1, c * 3, torch.logical_not(d)


@pytest.fixture(scope="module")
def mixed_sidecar(artifact_dir: Path, tmp_path_factory) -> Iterator[Sidecar]:
    batch = Dim("batch", min=1, max=16)
    example = (
        torch.randn(2, 4).half(),
        torch.randn(2, 4).bfloat16(),
        torch.randint(0, 9, (2, 4), dtype=torch.int32),
        torch.rand(2, 4) > 0.5,
    )
    shapes = {name: {0: batch} for name in "abcd"}
    path = compile_spec(ModelSpec("mixed", Mixed(), example, shapes), artifact_dir / "mixed")
    sidecar = Sidecar(path, tmp_path_factory.mktemp("mixed") / "sidecar.log")
    with ready_sidecar(sidecar):
        yield sidecar


def test_raw_contents_every_datatype(mixed_sidecar: Sidecar) -> None:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((3, 4)).astype(np.float16)
    b = rng.standard_normal((3, 4)).astype(ml_dtypes.bfloat16)  # tritonclient's BF16 type
    c = rng.integers(-100, 100, (3, 4), dtype=np.int32)
    d = rng.random((3, 4)) > 0.5
    client = grpcclient.InferenceServerClient(mixed_sidecar.url)
    items = []
    for name, array, datatype in (
        ("a", a, "FP16"),
        ("b", b, "BF16"),
        ("c", c, "INT32"),
        ("d", d, "BOOL"),
    ):
        item = grpcclient.InferInput(name, list(array.shape), datatype)
        item.set_data_from_numpy(array)
        items.append(item)
    result = client.infer("mixed", items)
    client.close()
    np.testing.assert_array_equal(result.as_numpy("output_0"), a * 2)
    b16 = torch.from_numpy(b.view(np.int16)).view(torch.bfloat16)
    expected_b = (b16 + 1).view(torch.int16).numpy()
    assert result.as_numpy("output_1").view(np.int16).tolist() == expected_b.tolist()
    np.testing.assert_array_equal(result.as_numpy("output_2"), c * 3)
    np.testing.assert_array_equal(result.as_numpy("output_3"), ~d)
    outputs = {o.name: o.datatype for o in result.get_response().outputs}
    assert outputs == {
        "output_0": "FP16",
        "output_1": "BF16",
        "output_2": "INT32",
        "output_3": "BOOL",
    }


def test_typed_contents_and_their_limits(mixed_sidecar: Sidecar) -> None:
    a = np.ones((1, 4), np.float16)
    b16 = torch.ones(1, 4, dtype=torch.bfloat16).view(torch.int16).numpy().tobytes()
    with grpc.insecure_channel(mixed_sidecar.url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = service_pb2.ModelInferRequest(model_name="mixed")
        for name, datatype in (("a", "FP16"), ("b", "BF16"), ("c", "INT32"), ("d", "BOOL")):
            request.inputs.add(name=name, datatype=datatype, shape=[1, 4])
        request.inputs[2].contents.int_contents.extend([1, 2, 3, 4])
        request.inputs[3].contents.bool_contents.extend([True, False, True, False])
        # FP16/BF16 have no typed field in the protocol: with typed contents elsewhere they
        # cannot be sent at all, and the answer says so.
        request.inputs[0].contents.fp32_contents.extend([1.0] * 4)
        request.inputs[1].contents.fp32_contents.extend([1.0] * 4)
        with pytest.raises(grpc.RpcError) as raised:
            stub.ModelInfer(request, timeout=30)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "has no typed contents field" in raised.value.details()
        raw = service_pb2.ModelInferRequest(
            model_name="mixed",
            raw_input_contents=[
                a.tobytes(),
                b16,
                np.array([[1, 2, 3, 4]], np.int32).tobytes(),
                bytes([1, 0, 1, 0]),
            ],
        )
        for name, datatype in (("a", "FP16"), ("b", "BF16"), ("c", "INT32"), ("d", "BOOL")):
            raw.inputs.add(name=name, datatype=datatype, shape=[1, 4])
        answer = stub.ModelInfer(raw, timeout=30)
        ints = np.frombuffer(answer.raw_output_contents[2], np.int32)
        assert ints.tolist() == [3, 6, 9, 12]
        assert list(answer.raw_output_contents[3]) == [0, 1, 0, 1]


@pytest.mark.parametrize("datatype", sorted(DATATYPES))
def test_codec_round_trip(datatype: str) -> None:
    spec = DATATYPES[datatype]
    tensor = (torch.arange(12) % 7).reshape(3, 4)
    tensor = (tensor > 2) if spec.torch is torch.bool else tensor.to(spec.torch)
    encoded = encode_output("t", tensor)
    assert encoded.datatype == datatype and encoded.shape == (3, 4)
    raw = decode_input(InferInput("t", datatype, (3, 4), raw=encoded.raw), max_bytes=2**20)
    assert torch.equal(raw, tensor)
    if spec.typed_field is not None:
        values = tensor.flatten().tolist()
        typed = decode_input(
            InferInput("t", datatype, (3, 4), typed={spec.typed_field: values}), max_bytes=2**20
        )
        assert torch.equal(typed, tensor)


@pytest.mark.parametrize(
    ("item", "message"),
    [
        (InferInput("t", "INT8", (2,), typed={"int_contents": [1, 300]}), "outside the INT8"),
        (InferInput("t", "BOOL", (2,), raw=bytes([1, 7])), "must be 0 or 1"),
        (InferInput("t", "FP32", (2,), typed={"int64_contents": [1, 2]}), "goes in fp32"),
        (InferInput("t", "FP32", (2, -1), raw=b""), "negative dim"),
        # no elements, but strides past 64 bits (the malformed-request fuzzing found it)
        (InferInput("t", "FP32", (0, 2, 2**62), raw=b""), "past what a tensor indexes"),
        (InferInput("t", "INT8", (2**31, 0, 2**32)), "past what a tensor indexes"),
        (InferInput("t", "STRING", (1,), raw=b"x"), "not supported"),
        (InferInput("t", "FP32", (1,)), "carries no data"),
    ],
)
def test_codec_refusals(item: InferInput, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        decode_input(item, max_bytes=2**20)
