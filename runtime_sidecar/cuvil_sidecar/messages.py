"""Protocol-neutral request/response types of the data plane, with ``from_pb``/``to_pb``.

The data plane works on these; only the servicer sees protobuf. The generated module is
imported inside ``to_pb`` so that importing this module never registers the
``inference.*`` protobuf symbols (tests that also load NVIDIA's client stay clean).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cuvil_sidecar.errors import InvalidInput
from cuvil_sidecar.shared_memory import SharedMemoryRef, reference

ParameterValue = bool | int | str | float


@dataclass(frozen=True)
class InferInput:
    name: str
    datatype: str
    shape: tuple[int, ...]
    # its raw_input_contents entry (bytes or a view; a bytearray or a numpy uint8 array when it
    # is the request's own copy: codec takes those as they are), or shared memory
    raw: Any = None
    typed: Mapping[str, Sequence[Any]] = field(default_factory=dict)  # non-empty typed fields
    shared: SharedMemoryRef | None = None  # where it lies in shared memory, instead of raw


@dataclass(frozen=True)
class InferRequest:
    model_name: str
    model_version: str = ""
    id: str = ""
    inputs: tuple[InferInput, ...] = ()
    outputs: tuple[str, ...] = ()  # requested output names; empty: all
    parameters: Mapping[str, ParameterValue] = field(default_factory=dict)
    shared_outputs: Mapping[str, SharedMemoryRef] = field(default_factory=dict)

    @classmethod
    def from_pb(cls, request: Any) -> InferRequest:
        shared = [
            reference(tensor.name, _parameters_from_pb(tensor.parameters))
            for tensor in request.inputs
        ]
        # raw_input_contents holds one entry per input that is not in shared memory, in order
        raws = list(request.raw_input_contents)
        unshared = sum(ref is None for ref in shared)
        if raws and len(raws) != unshared:
            raise InvalidInput(
                f"raw_input_contents has {len(raws)} entries for {unshared} inputs not in "
                "shared memory; send one entry per such input, in the order of `inputs`"
            )
        inputs = []
        pending = iter(raws)
        for tensor, ref in zip(request.inputs, shared, strict=True):
            typed = (
                {fd.name: value for fd, value in tensor.contents.ListFields()}
                if tensor.HasField("contents")
                else {}
            )
            if typed and (raws or ref is not None):
                where = "lies in shared memory" if ref is not None else "uses raw_input_contents"
                raise InvalidInput(
                    f"input {tensor.name!r} sets typed contents while it {where}; "
                    "send its data one way only"
                )
            inputs.append(
                InferInput(
                    name=tensor.name,
                    datatype=tensor.datatype,
                    shape=tuple(tensor.shape),
                    raw=next(pending) if raws and ref is None else None,
                    typed=typed,
                    shared=ref,
                )
            )
        shared_outputs = {}
        for output in request.outputs:
            ref = reference(output.name, _parameters_from_pb(output.parameters))
            if ref is not None:
                shared_outputs[output.name] = ref
        return cls(
            model_name=request.model_name,
            model_version=request.model_version,
            id=request.id,
            inputs=tuple(inputs),
            outputs=tuple(output.name for output in request.outputs),
            parameters=_parameters_from_pb(request.parameters),
            shared_outputs=shared_outputs,
        )


@dataclass(frozen=True)
class InferOutput:
    name: str
    datatype: str
    shape: tuple[int, ...]
    raw: bytes | memoryview  # empty when the output was written to shared memory instead
    shared: SharedMemoryRef | None = None


@dataclass(frozen=True)
class InferResponse:
    model_name: str
    model_version: str
    id: str
    outputs: tuple[InferOutput, ...]

    def to_pb(self) -> Any:
        """The response as something that serializes as its message: a
        ``wire.EncodedInferResponse``, whose fields are written by hand unless an output lies in
        shared memory (its parameters say where), with fewer copies of the outputs' bytes."""
        from cuvil_sidecar.wire import EncodedInferResponse, encode_response_header

        # one entry per output, as the protocol asks: empty for one in shared memory, so that
        # clients which pair entries with outputs by position stay aligned
        raws = [output.raw for output in self.outputs]
        if all(output.shared is None for output in self.outputs):
            described = [(output.name, output.datatype, output.shape) for output in self.outputs]
            header = encode_response_header(self.model_name, self.model_version, self.id, described)
            return EncodedInferResponse(header, raws)
        from cuvil_sidecar._generated import grpc_service_pb2 as pb

        response = pb.ModelInferResponse(
            model_name=self.model_name, model_version=self.model_version, id=self.id
        )
        for output in self.outputs:
            tensor = response.outputs.add(
                name=output.name, datatype=output.datatype, shape=output.shape
            )
            if output.shared is not None:
                for key, value in output.shared.parameters().items():
                    if isinstance(value, str):
                        tensor.parameters[key].string_param = value
                    else:
                        tensor.parameters[key].int64_param = value
        return EncodedInferResponse(response, raws)


@dataclass(frozen=True)
class TensorMetadata:
    name: str
    datatype: str
    shape: tuple[int, ...]  # -1 where the dim varies


@dataclass(frozen=True)
class ModelMetadata:
    name: str
    versions: tuple[str, ...]
    platform: str
    inputs: tuple[TensorMetadata, ...]
    outputs: tuple[TensorMetadata, ...]

    def to_pb(self) -> Any:
        from cuvil_sidecar._generated import grpc_service_pb2 as pb

        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=self.name,
            versions=self.versions,
            platform=self.platform,
            inputs=[tensor(name=t.name, datatype=t.datatype, shape=t.shape) for t in self.inputs],
            outputs=[tensor(name=t.name, datatype=t.datatype, shape=t.shape) for t in self.outputs],
        )


@dataclass(frozen=True)
class ServerMetadata:
    name: str
    version: str
    extensions: tuple[str, ...] = ()

    def to_pb(self) -> Any:
        from cuvil_sidecar._generated import grpc_service_pb2 as pb

        return pb.ServerMetadataResponse(
            name=self.name, version=self.version, extensions=self.extensions
        )


def _parameters_from_pb(parameters: Mapping[str, Any]) -> dict[str, ParameterValue]:
    values: dict[str, ParameterValue] = {}
    for key, parameter in parameters.items():
        choice = parameter.WhichOneof("parameter_choice")
        if choice is not None:
            values[key] = getattr(parameter, choice)
    return values
