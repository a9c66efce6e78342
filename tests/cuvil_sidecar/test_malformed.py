"""Bad input never crashes the sidecar: thousands of malformed requests (hypothesis) each get a
clean INVALID_ARGUMENT or NOT_FOUND with a message, oversized and unparseable messages get a
status too, and a valid request afterwards still succeeds. The fuzzed tensors also carry
shared-memory references of every kind, some into a real registered region."""

from __future__ import annotations

from multiprocessing import shared_memory

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2, service_pb2_grpc

from tests.cuvil_sidecar.conftest import Sidecar

CLEAN = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}
DATATYPES = ["FP32", "FP16", "BF16", "FP64", "INT64", "INT32", "INT8", "UINT8", "BOOL", "BYTES"]
TYPED_FIELDS = {
    "bool_contents": st.booleans(),
    "int_contents": st.integers(-(2**31), 2**31 - 1),
    "int64_contents": st.integers(-(2**63), 2**63 - 1),
    "uint_contents": st.integers(0, 2**32 - 1),
    "fp32_contents": st.floats(width=32, allow_nan=True),
    "fp64_contents": st.floats(allow_nan=True),
    "bytes_contents": st.binary(max_size=8),
}
# parameters: (key, InferParameter field, value), shared-memory keys most of the time
SHM_KEYS = ["shared_memory_region", "shared_memory_byte_size", "shared_memory_offset"]
FUZZ_REGION = "fuzz"  # registered, 4096 bytes
parameter = st.one_of(
    st.tuples(
        st.sampled_from(SHM_KEYS),
        st.just("string_param"),
        st.one_of(st.sampled_from([FUZZ_REGION, "nope", ""]), st.text(max_size=4)),
    ),
    st.tuples(
        st.sampled_from(SHM_KEYS),
        st.sampled_from(["int64_param", "uint64_param"]),
        st.one_of(st.integers(0, 5000), st.sampled_from([3136, 4096, 2**62])),
    ),
    st.tuples(st.sampled_from(SHM_KEYS), st.just("int64_param"), st.integers(-(2**63), -1)),
    st.tuples(st.sampled_from(SHM_KEYS), st.just("bool_param"), st.booleans()),
    st.tuples(st.text(max_size=4), st.just("double_param"), st.floats(allow_nan=True)),
)
parameters = st.lists(parameter, max_size=3)
dims = st.one_of(st.integers(-3, 4), st.sampled_from([784, 785, 0, 64, 65, 2**31, 2**62]))
tensor = st.fixed_dictionaries(
    {
        "name": st.one_of(st.just("x"), st.text(max_size=6)),
        "datatype": st.one_of(st.sampled_from(DATATYPES), st.text(max_size=5)),
        "shape": st.lists(dims, max_size=4),
        "typed": st.one_of(
            st.none(),
            st.sampled_from(sorted(TYPED_FIELDS)).flatmap(
                lambda field: st.tuples(st.just(field), st.lists(TYPED_FIELDS[field], max_size=6))
            ),
        ),
        "parameters": parameters,
    }
)
requests = st.fixed_dictionaries(
    {
        "model": st.one_of(st.just("mlp"), st.text(max_size=6)),
        "version": st.sampled_from(["", "1", "2", "latest"]),
        "inputs": st.lists(tensor, max_size=3),
        "raw": st.one_of(st.none(), st.lists(st.binary(max_size=64), max_size=3)),
        "outputs": st.lists(
            st.tuples(st.one_of(st.just("output"), st.text(max_size=4)), parameters), max_size=2
        ),
    }
)


def set_parameters(target, items: list) -> None:
    for key, field, value in items:
        setattr(target.parameters[key], field, value)


def build(spec: dict) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name=spec["model"], model_version=spec["version"])
    for item in spec["inputs"]:
        pb = request.inputs.add(name=item["name"], datatype=item["datatype"])
        pb.shape.extend(item["shape"])
        if item["typed"] is not None:
            field, values = item["typed"]
            getattr(pb.contents, field).extend(values)
        set_parameters(pb, item["parameters"])
    if spec["raw"] is not None:
        request.raw_input_contents.extend(spec["raw"])
    for name, items in spec["outputs"]:
        set_parameters(request.outputs.add(name=name), items)
    return request


def valid_request() -> service_pb2.ModelInferRequest:
    x = np.ones((1, 784), np.float32)
    request = service_pb2.ModelInferRequest(model_name="mlp", raw_input_contents=[x.tobytes()])
    request.inputs.add(name="x", datatype="FP32", shape=[1, 784])
    return request


def test_malformed_requests_get_clean_errors(mlp_sidecar: Sidecar) -> None:
    sent: list[grpc.StatusCode] = []
    details: list[str] = []
    region = shared_memory.SharedMemory(create=True, size=4096)
    with grpc.insecure_channel(mlp_sidecar.url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        stub.SystemSharedMemoryRegister(
            service_pb2.SystemSharedMemoryRegisterRequest(
                name=FUZZ_REGION, key="/" + region.name, byte_size=4096
            )
        )

        @settings(
            max_examples=2000,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(requests)
        def check(spec: dict) -> None:
            try:
                response = stub.ModelInfer(build(spec), timeout=30)
            except grpc.RpcError as error:
                sent.append(error.code())
                details.append(error.details() or "")
                assert error.code() in CLEAN, (error.code(), error.details(), spec)
                assert error.details(), spec
                return
            sent.append(grpc.StatusCode.OK)  # hypothesis found a valid request: a real answer
            assert list(response.outputs[0].shape)[-1] == 10

        check()
        assert len(sent) >= 2000
        assert sent.count(grpc.StatusCode.OK) < len(sent) // 100
        # the shared-memory checks were reached, past the request's other faults
        assert sum("shared memory" in text for text in details) > 20
        answer = stub.ModelInfer(valid_request(), timeout=30)
        assert list(answer.outputs[0].shape) == [1, 10]
        stub.SystemSharedMemoryUnregister(
            service_pb2.SystemSharedMemoryUnregisterRequest(name=FUZZ_REGION)
        )
    region.close()
    region.unlink()
    assert mlp_sidecar.process.poll() is None


@pytest.mark.parametrize(
    ("mutate", "code", "message"),
    [
        (lambda r: r.inputs[0].shape.__setitem__(0, 2**20), "INVALID_ARGUMENT", "byte message"),
        (lambda r: r.raw_input_contents.__setitem__(0, b"\0" * 13), "INVALID_ARGUMENT", "13 bytes"),
        (lambda r: r.inputs[0].shape.__setitem__(0, 65), "INVALID_ARGUMENT", "needs"),
        (lambda r: r.inputs[0].contents.fp32_contents.append(1.0), "INVALID_ARGUMENT", "typed"),
        (lambda r: setattr(r, "model_version", "7"), "NOT_FOUND", "no version '7'"),
        (lambda r: r.outputs.add(name="logits"), "INVALID_ARGUMENT", "unknown requested output"),
        (lambda r: setattr(r.inputs[0], "datatype", "FP16"), "INVALID_ARGUMENT", "takes FP32"),
    ],
)
def test_specific_faults_say_what_is_wrong(
    mlp_sidecar: Sidecar, mutate, code: str, message: str
) -> None:
    request = valid_request()
    mutate(request)
    with grpc.insecure_channel(mlp_sidecar.url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as raised:
            stub.ModelInfer(request, timeout=30)
        assert raised.value.code().name == code
        assert message in raised.value.details()


def test_dims_out_of_declared_range(mlp_sidecar: Sidecar) -> None:
    x = np.ones((65, 784), np.float32)
    request = service_pb2.ModelInferRequest(model_name="mlp", raw_input_contents=[x.tobytes()])
    request.inputs.add(name="x", datatype="FP32", shape=[65, 784])
    with grpc.insecure_channel(mlp_sidecar.url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as raised:
            stub.ModelInfer(request, timeout=30)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "outside its declared range [1, 64]" in raised.value.details()


def test_oversized_and_unparseable_messages(mlp_sidecar: Sidecar) -> None:
    """A message over CUVIL_MAX_MESSAGE_BYTES (4 MiB here) is refused by gRPC itself with
    RESOURCE_EXHAUSTED before any of it is parsed; bytes that are not a protobuf message get a
    status as well; the server keeps answering."""
    big = np.ones((64, 784 * 24), np.float32)
    request = service_pb2.ModelInferRequest(model_name="mlp", raw_input_contents=[big.tobytes()])
    request.inputs.add(name="x", datatype="FP32", shape=[64, 784 * 24])
    with grpc.insecure_channel(mlp_sidecar.url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as raised:
            stub.ModelInfer(request, timeout=30)
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        garbage = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=lambda data: data,
            response_deserializer=lambda data: data,
        )
        for blob in (b"\xff\xff\xff", b"\x2a\x05\x0a\x03\xff\xfe", bytes(range(256))):
            with pytest.raises(grpc.RpcError) as raised:
                garbage(blob, timeout=30)
            assert raised.value.code() != grpc.StatusCode.OK
        answer = stub.ModelInfer(valid_request(), timeout=30)
        assert list(answer.outputs[0].shape) == [1, 10]
