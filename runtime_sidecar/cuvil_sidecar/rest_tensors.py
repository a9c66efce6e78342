"""Inference requests and responses of the REST protocol <-> the data plane's neutral types.

A request body is JSON (KServe's and Triton's v2 REST format), optionally followed by tensor
bytes: with Triton's binary-data extension the ``Inference-Header-Content-Length`` header says
how long the JSON is, and each input whose ``parameters`` hold ``binary_data_size`` takes that
many bytes of what follows, in the order of ``inputs``. Every other input carries ``data``, a
flat or nested JSON list in row-major order. An output is answered as bytes after the JSON when
its own ``binary_data`` parameter, or else the request's ``binary_data_output``, is true; else
as a flat ``data`` list. Tensors in system shared memory are named by the same three parameters
as over gRPC (``shared_memory.py``).

Every count is checked against what was sent before anything is built from a declared shape,
as over gRPC (``codec``): a lying shape or size is a 400, never an allocation.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from cuvil_sidecar.codec import DATATYPES
from cuvil_sidecar.errors import InvalidInput
from cuvil_sidecar.messages import InferInput, InferRequest, InferResponse, ParameterValue
from cuvil_sidecar.shared_memory import reference

BINARY_SIZE = "binary_data_size"
HEADER_LENGTH = "inference-header-content-length"


def parse_infer(
    body: bytes, header_length: str | None, model: str, version: str
) -> tuple[InferRequest, set[str], bool]:
    """The request, the outputs asked for as binary, and whether every output is asked for so."""
    document, binary = _split(body, header_length)
    if not isinstance(document, dict):
        raise InvalidInput("the request body must be a JSON object with an `inputs` list")
    parameters = _parameters(document.get("parameters"), "the request")
    inputs_json = document.get("inputs")
    if not isinstance(inputs_json, list) or not inputs_json:
        raise InvalidInput("the request has no `inputs` list")
    inputs, offset = [], 0
    for index, tensor in enumerate(inputs_json):
        item, used = _input(tensor, index, binary, offset)
        inputs.append(item)
        offset += used
    if offset != len(binary):
        raise InvalidInput(
            f"the body holds {len(binary)} bytes after the JSON header, but the inputs' "
            f"{BINARY_SIZE} add up to {offset}"
        )
    outputs, binary_outputs, shared_outputs = _outputs(document.get("outputs"))
    request_id = document.get("id", "")
    if not isinstance(request_id, str):
        raise InvalidInput("`id` must be a string")
    request = InferRequest(
        model_name=model,
        model_version=version,
        id=request_id,
        inputs=tuple(inputs),
        outputs=outputs,
        parameters=parameters,
        shared_outputs=shared_outputs,
    )
    return request, binary_outputs, parameters.get("binary_data_output") is True


def _split(body: bytes, header_length: str | None) -> tuple[Any, memoryview]:
    view = memoryview(body)
    if header_length is None:
        length = len(body)
    else:
        text = header_length.strip()
        if not text.isdigit() or int(text) > len(body):
            raise InvalidInput(
                f"Inference-Header-Content-Length {text[:40]!r} is not a byte count within the "
                f"{len(body)}-byte body"
            )
        length = int(text)
    try:
        document = json.loads(bytes(view[:length]))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise InvalidInput(f"the request's JSON does not parse: {error}") from None
    return document, view[length:]


def _parameters(value: Any, where: str) -> dict[str, ParameterValue]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
        isinstance(v, (bool, int, float, str)) for v in value.values()
    ):
        raise InvalidInput(f"`parameters` of {where} must be an object of scalars")
    return dict(value)


def _input(tensor: Any, index: int, binary: memoryview, offset: int) -> tuple[InferInput, int]:
    """One input, and how many of the binary bytes it took."""
    if not isinstance(tensor, dict) or not isinstance(tensor.get("name"), str):
        raise InvalidInput(f"input {index} must be an object with a `name`")
    name = tensor["name"]
    datatype, shape = tensor.get("datatype"), tensor.get("shape")
    if not isinstance(datatype, str):
        raise InvalidInput(f"input {name!r} has no `datatype`")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise InvalidInput(f"input {name!r}: `shape` must be a list of non-negative integers")
    parameters = _parameters(tensor.get("parameters"), f"input {name!r}")
    shared = reference(name, parameters)
    size = parameters.get(BINARY_SIZE)
    if size is not None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise InvalidInput(f"input {name!r}: {BINARY_SIZE} must be a non-negative integer")
        if offset + size > len(binary):
            raise InvalidInput(
                f"input {name!r}: {BINARY_SIZE} {size} runs past the end of the body "
                f"({len(binary) - offset} bytes left)"
            )
        raw = bytearray(binary[offset : offset + size])
        return InferInput(name, datatype, tuple(shape), raw=raw), size
    if shared is not None:
        return InferInput(name, datatype, tuple(shape), shared=shared), 0
    if "data" not in tensor:
        raise InvalidInput(f"input {name!r} carries no `data` and no {BINARY_SIZE}")
    raw = _json_bytes(name, datatype, tuple(shape), tensor["data"])
    return InferInput(name, datatype, tuple(shape), raw=raw), 0


def _json_bytes(name: str, datatype: str, shape: tuple[int, ...], data: Any) -> bytearray:
    """A JSON ``data`` list -> the tensor's little-endian bytes, checked element by element."""
    kind = DATATYPES.get(datatype)
    if kind is None:
        raise InvalidInput(
            f"input {name!r}: datatype {datatype!r} is not supported; "
            f"use one of {sorted(DATATYPES)}"
        )
    values = _flatten(data, name)
    if len(values) != math.prod(shape):
        raise InvalidInput(
            f"input {name!r}: {len(values)} values in `data`, but shape {list(shape)} needs "
            f"{math.prod(shape)}"
        )
    if kind.torch is torch.bool:
        if not all(isinstance(v, bool) for v in values):
            raise InvalidInput(f"input {name!r}: BOOL data must be true or false")
        return bytearray(np.asarray(values, dtype=np.bool_).tobytes())
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in values):
        raise InvalidInput(f"input {name!r}: {datatype} data must be numbers")
    if not kind.torch.is_floating_point:
        if not all(isinstance(v, int) for v in values):
            raise InvalidInput(f"input {name!r}: {datatype} data must be integers")
        info = torch.iinfo(kind.torch)
        if values and (min(values) < info.min or max(values) > info.max):
            raise InvalidInput(
                f"input {name!r}: values outside the {datatype} range [{info.min}, {info.max}]"
            )
    if not values:
        return bytearray()
    wide = torch.tensor(values, dtype=torch.float64 if kind.torch.is_floating_point else None)
    return bytearray(wide.to(kind.torch).view(torch.uint8).numpy().tobytes())


def _flatten(data: Any, name: str) -> list[Any]:
    if not isinstance(data, list):
        raise InvalidInput(f"input {name!r}: `data` must be a list")
    flat: list[Any] = []
    stack = [iter(data)]
    while stack:
        for value in stack[-1]:
            if isinstance(value, list):
                if len(stack) > 32:
                    raise InvalidInput(f"input {name!r}: `data` nests too deeply")
                stack.append(iter(value))
                break
            flat.append(value)
        else:
            stack.pop()
    return flat


def _outputs(value: Any) -> tuple[tuple[str, ...], set[str], dict[str, Any]]:
    if value is None:
        return (), set(), {}
    if not isinstance(value, list):
        raise InvalidInput("`outputs` must be a list")
    names, binary, shared = [], set(), {}
    for index, output in enumerate(value):
        if not isinstance(output, dict) or not isinstance(output.get("name"), str):
            raise InvalidInput(f"output {index} must be an object with a `name`")
        name = output["name"]
        parameters = _parameters(output.get("parameters"), f"output {name!r}")
        names.append(name)
        if parameters.get("binary_data") is True:
            binary.add(name)
        ref = reference(name, parameters)
        if ref is not None:
            shared[name] = ref
    return tuple(names), binary, shared


def encode_infer(
    response: InferResponse, binary: set[str], all_binary: bool
) -> tuple[list[bytes | memoryview], int | None]:
    """The response body (JSON, then the binary outputs' bytes) and the JSON's length when
    binary data follows it (for Inference-Header-Content-Length)."""
    outputs, tail = [], []
    for output in response.outputs:
        entry: dict[str, Any] = {
            "name": output.name,
            "datatype": output.datatype,
            "shape": list(output.shape),
        }
        if output.shared is not None:
            entry["parameters"] = dict(output.shared.parameters())
        elif all_binary or output.name in binary:
            entry["parameters"] = {BINARY_SIZE: memoryview(output.raw).nbytes}
            tail.append(output.raw)
        else:
            entry["data"] = _json_values(output.datatype, output.raw)
        outputs.append(entry)
    document: dict[str, Any] = {
        "model_name": response.model_name,
        "model_version": response.model_version,
        "outputs": outputs,
    }
    if response.id:
        document["id"] = response.id
    header = json.dumps(document, separators=(",", ":")).encode()
    return [header, *tail], (len(header) if tail else None)


def _json_values(datatype: str, raw: bytes | memoryview) -> list[Any]:
    kind = DATATYPES[datatype]
    flat = torch.frombuffer(bytearray(raw), dtype=kind.torch) if len(raw) else torch.empty(0)
    if kind.torch in (torch.bfloat16, torch.float16):
        flat = flat.float()
    return list(flat.tolist())


def header_length(headers: Mapping[str, str]) -> str | None:
    return headers.get(HEADER_LENGTH)
