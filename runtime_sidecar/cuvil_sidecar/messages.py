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

ParameterValue = bool | int | str | float


@dataclass(frozen=True)
class InferInput:
    name: str
    datatype: str
    shape: tuple[int, ...]
    raw: bytes | None = None  # this input's raw_input_contents entry
    typed: Mapping[str, Sequence[Any]] = field(default_factory=dict)  # non-empty typed fields


@dataclass(frozen=True)
class InferRequest:
    model_name: str
    model_version: str = ""
    id: str = ""
    inputs: tuple[InferInput, ...] = ()
    outputs: tuple[str, ...] = ()  # requested output names; empty: all
    parameters: Mapping[str, ParameterValue] = field(default_factory=dict)

    @classmethod
    def from_pb(cls, request: Any) -> InferRequest:
        raws = list(request.raw_input_contents)
        if raws and len(raws) != len(request.inputs):
            raise InvalidInput(
                f"raw_input_contents has {len(raws)} entries for {len(request.inputs)} inputs; "
                "send one entry per input, in the order of `inputs`"
            )
        inputs = []
        for index, tensor in enumerate(request.inputs):
            typed = (
                {fd.name: value for fd, value in tensor.contents.ListFields()}
                if tensor.HasField("contents")
                else {}
            )
            if raws and typed:
                raise InvalidInput(
                    f"input {tensor.name!r} sets typed contents while the request uses "
                    "raw_input_contents; use one or the other"
                )
            inputs.append(
                InferInput(
                    name=tensor.name,
                    datatype=tensor.datatype,
                    shape=tuple(tensor.shape),
                    raw=raws[index] if raws else None,
                    typed=typed,
                )
            )
        return cls(
            model_name=request.model_name,
            model_version=request.model_version,
            id=request.id,
            inputs=tuple(inputs),
            outputs=tuple(output.name for output in request.outputs),
            parameters=_parameters_from_pb(request.parameters),
        )


@dataclass(frozen=True)
class InferOutput:
    name: str
    datatype: str
    shape: tuple[int, ...]
    raw: bytes


@dataclass(frozen=True)
class InferResponse:
    model_name: str
    model_version: str
    id: str
    outputs: tuple[InferOutput, ...]

    def to_pb(self) -> Any:
        from cuvil_sidecar._generated import grpc_service_pb2 as pb

        response = pb.ModelInferResponse(
            model_name=self.model_name, model_version=self.model_version, id=self.id
        )
        for output in self.outputs:
            response.outputs.add(name=output.name, datatype=output.datatype, shape=output.shape)
            response.raw_output_contents.append(output.raw)
        return response


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
