"""Tensor data on the wire <-> torch tensors, for every datatype the protocol and Cuvil share.

Raw contents are little-endian row-major bytes; typed contents are the repeated fields of
InferTensorContents (FP16 and BF16 have none: raw only, as in Triton and KServe). Every check
that a client can fail happens before anything is allocated from a declared shape: the byte
or element count must match what was actually sent, so a lying shape cannot make the server
allocate memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from cuvil_sidecar.errors import InvalidInput, RequestTooLarge
from cuvil_sidecar.messages import InferInput, InferOutput
from cuvil_sidecar.shared_memory import SharedMemoryRef


@dataclass(frozen=True)
class Datatype:
    name: str  # the protocol's name
    torch: torch.dtype
    cuvil: str  # the name in Cuvil signatures
    typed_field: str | None  # InferTensorContents field; None: raw only
    numpy: str | None  # numpy dtype for typed contents and range checks


DATATYPES: dict[str, Datatype] = {
    d.name: d
    for d in (
        Datatype("BOOL", torch.bool, "bool", "bool_contents", "bool"),
        Datatype("UINT8", torch.uint8, "u8", "uint_contents", "uint8"),
        Datatype("INT8", torch.int8, "i8", "int_contents", "int8"),
        Datatype("INT16", torch.int16, "i16", "int_contents", "int16"),
        Datatype("INT32", torch.int32, "i32", "int_contents", "int32"),
        Datatype("INT64", torch.int64, "i64", "int64_contents", "int64"),
        Datatype("FP16", torch.float16, "f16", None, None),
        Datatype("BF16", torch.bfloat16, "bf16", None, None),
        Datatype("FP32", torch.float32, "f32", "fp32_contents", "float32"),
        Datatype("FP64", torch.float64, "f64", "fp64_contents", "float64"),
    )
}
INDEXABLE_BYTES = 2**63 - 1  # a tensor's strides and byte offsets are signed 64-bit
BY_CUVIL_NAME: dict[str, Datatype] = {d.cuvil: d for d in DATATYPES.values()}
BY_TORCH: dict[torch.dtype, Datatype] = {d.torch: d for d in DATATYPES.values()}


def datatype_of(cuvil_dtype: str) -> str:
    """Cuvil signature dtype (``f32``) -> protocol datatype (``FP32``)."""
    return BY_CUVIL_NAME[cuvil_dtype].name


def decode_input(item: InferInput, *, max_bytes: int) -> torch.Tensor:
    """One request input -> a CPU tensor of its datatype and shape, or InvalidInput."""
    datatype = DATATYPES.get(item.datatype)
    if datatype is None:
        raise InvalidInput(
            f"input {item.name!r}: datatype {item.datatype!r} is not supported; "
            f"use one of {sorted(DATATYPES)}"
        )
    if any(dim < 0 for dim in item.shape):
        raise InvalidInput(f"input {item.name!r}: shape {list(item.shape)} has a negative dim")
    elements = math.prod(item.shape)
    itemsize = datatype.torch.itemsize
    if elements * itemsize > max_bytes:
        raise RequestTooLarge(
            f"input {item.name!r}: shape {list(item.shape)} {item.datatype} declares "
            f"{elements * itemsize} bytes, more than the {max_bytes}-byte message limit"
        )
    if math.prod(max(dim, 1) for dim in item.shape) * itemsize > INDEXABLE_BYTES:
        # no elements, but dims whose strides a tensor cannot hold ([0, 2, 2**62])
        raise InvalidInput(
            f"input {item.name!r}: shape {list(item.shape)} has dims past what a tensor indexes"
        )
    if item.raw is not None:
        return _from_raw(item, datatype, elements, itemsize)
    if item.typed:
        return _from_typed(item, datatype, elements)
    if elements == 0:
        return torch.empty(item.shape, dtype=datatype.torch)
    raise InvalidInput(
        f"input {item.name!r} carries no data: set raw_input_contents or typed contents"
    )


def _from_raw(item: InferInput, datatype: Datatype, elements: int, itemsize: int) -> torch.Tensor:
    raw = item.raw if item.raw is not None else b""
    if len(raw) != elements * itemsize:
        raise InvalidInput(
            f"input {item.name!r}: {len(raw)} bytes of raw data, but shape {list(item.shape)} "
            f"{item.datatype} needs {elements * itemsize}"
        )
    if elements == 0:
        return torch.empty(item.shape, dtype=datatype.torch)
    # A bytearray or a numpy array is the request's own copy of these bytes, made for the tensor
    # (wire.split_infer_request; the native front end's split): taken as it is. Anything else
    # (bytes from protobuf, a view into the request or into a client's shared memory) is copied
    # into one: torch warns on read-only buffers, a kernel may write into its input, and a
    # client may rewrite its shared memory meanwhile. Native byte order is the protocol's
    # little-endian on every target Cuvil builds for.
    owned = raw if isinstance(raw, (bytearray, np.ndarray)) else bytearray(raw)
    flat = torch.frombuffer(owned, dtype=datatype.torch)
    if datatype.torch is torch.bool and bool((flat.view(torch.uint8) > 1).any()):
        raise InvalidInput(f"input {item.name!r}: BOOL raw bytes must be 0 or 1")
    return flat.reshape(item.shape)


def _from_typed(item: InferInput, datatype: Datatype, elements: int) -> torch.Tensor:
    if datatype.typed_field is None:
        raise InvalidInput(
            f"input {item.name!r}: {item.datatype} has no typed contents field in the protocol; "
            "send it as raw_input_contents"
        )
    wrong = sorted(set(item.typed) - {datatype.typed_field})
    if wrong:
        raise InvalidInput(
            f"input {item.name!r} is {item.datatype} but sets {', '.join(wrong)}; "
            f"{item.datatype} data goes in {datatype.typed_field}"
        )
    values = item.typed[datatype.typed_field]
    if len(values) != elements:
        raise InvalidInput(
            f"input {item.name!r}: {len(values)} values in {datatype.typed_field}, but shape "
            f"{list(item.shape)} needs {elements}"
        )
    assert datatype.numpy is not None
    wide = np.asarray(values)
    if datatype.numpy.startswith(("int", "uint")):
        info = np.iinfo(datatype.numpy)
        if wide.size and (wide.min() < info.min or wide.max() > info.max):
            raise InvalidInput(
                f"input {item.name!r}: values outside the {item.datatype} range "
                f"[{info.min}, {info.max}]"
            )
    array = np.ascontiguousarray(wide.astype(datatype.numpy, copy=False))
    return torch.from_numpy(array).reshape(item.shape)


def encode_output(name: str, tensor: torch.Tensor) -> InferOutput:
    """An output tensor -> its raw little-endian bytes (a view of the tensor's memory, copied
    only into the answer) with its protocol datatype."""
    datatype, raw = _output_bytes(name, tensor)
    return InferOutput(name, datatype.name, tuple(tensor.shape), raw)


def write_output(
    name: str, tensor: torch.Tensor, ref: SharedMemoryRef, target: memoryview
) -> InferOutput:
    """An output tensor -> its bytes written into ``target`` (the shared memory ``ref`` points
    at), and an output that carries the reference instead of the bytes."""
    datatype, raw = _output_bytes(name, tensor)
    size = raw.nbytes
    if size > len(target):
        raise InvalidInput(
            f"output {name!r} of shape {list(tensor.shape)} needs {size} bytes, but its "
            f"shared memory in region {ref.region!r} holds only {ref.byte_size}"
        )
    np.frombuffer(target, dtype=np.uint8, count=size)[:] = np.frombuffer(raw, dtype=np.uint8)
    written = SharedMemoryRef(ref.region, size, ref.offset)
    return InferOutput(name, datatype.name, tuple(tensor.shape), b"", written)


def _output_bytes(name: str, tensor: torch.Tensor) -> tuple[Datatype, memoryview]:
    """The tensor's bytes as a view of its memory, copied first only where it is not plain CPU
    memory numpy can read. The plain case takes one torch call: right after a model's run
    every cache is cold, and each torch call is slow then, so the fewer the better."""
    datatype = BY_TORCH.get(tensor.dtype)
    if datatype is None:
        raise TypeError(f"output {name!r} has dtype {tensor.dtype}, which the protocol lacks")
    try:
        array = tensor.numpy()  # no copy; refused for other devices, bf16, or grad
    except (TypeError, RuntimeError):
        array = None
    if array is not None and array.size and array.flags.c_contiguous:
        return datatype, array.data.cast("B")
    plain = tensor.detach().to("cpu").contiguous()
    return datatype, plain.reshape(-1).view(torch.uint8).numpy().data
