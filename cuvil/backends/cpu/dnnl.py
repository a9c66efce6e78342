"""oneDNN's C API through ctypes: primitives built once and kept, for kernels that ATen rebuilds.

Why not only ATen: ``torch.ops.mkldnn._convolution_pointwise`` builds oneDNN's primitive
descriptor on every call, which costs more than the arithmetic of a small convolution and is
paid once for every convolution of every image. Here a primitive is created once per input
shape and executed with the tensors' data pointers bound in place, which is what ONNX Runtime
and OpenVINO do natively.

The library is ``libdnnl.so.3`` from the ``onednn-cpu-gomp`` wheel (oneDNN 3.2, GNU OpenMP: it
shares the libgomp that torch loads, so ``torch.set_num_threads`` governs both). oneDNN keeps its
C ABI stable within a major version; the enum values below are those of 3.x's headers. Where the
library is missing (``CUVIL_DNNL=off``, another platform) ``load()`` returns None and the kernels
fall back to ATen's oneDNN calls, which compute the same thing more slowly.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch  # loaded first: its libgomp must be the one libdnnl binds to

LIBRARY_NAME = "libdnnl.so.3"
MAX_DIMS = 12

# enum values of oneDNN 3.x (dnnl_types.h, dnnl_common_types.h)
ENGINE_CPU = 1
STREAM_IN_ORDER = 1
FORWARD_INFERENCE = 96
CONVOLUTION_DIRECT = 1
BF16, F32 = 2, 3  # dnnl_data_type_t
DATA_TYPES = {torch.float32: F32, torch.bfloat16: BF16}
FORMAT_ANY = 1
QUERY_IMPL_INFO = 8
QUERY_EXEC_ARG_MD = 255
BINARY_ADD = 0x1FFF0
ARG_SRC, ARG_SRC_1, ARG_DST, ARG_WEIGHTS, ARG_BIAS, ARG_SCRATCHPAD = 1, 2, 17, 33, 41, 80
SCRATCHPAD_USER = 1
POST_OP_ARG_BASE = 32768

# activation name in the IR -> (eltwise algorithm, alpha, beta)
ELTWISE: dict[str, tuple[int, float, float]] = {
    "relu": (0x20, 0.0, 0.0),
    "tanh": (0x21, 0.0, 0.0),
    "sigmoid": (0x29, 0.0, 0.0),
    "gelu_tanh": (0x2B, 0.0, 0.0),
    "silu": (0x2C, 1.0, 0.0),
    "relu6": (0x2E, 0.0, 6.0),
    "gelu": (0x31, 0.0, 0.0),
    "hardswish": (0x34, 1.0 / 6.0, 0.5),
}

Handle = ctypes.c_void_p
Dims = ctypes.c_int64 * MAX_DIMS


class DnnlError(RuntimeError):
    """A oneDNN call returned a status other than success."""


class ExecArg(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_int), ("memory", Handle)]


def post_op_source(index: int) -> int:
    """The argument id of post-op ``index``'s second input (a binary post-op's tensor)."""
    return POST_OP_ARG_BASE * (index + 1) | ARG_SRC_1


def _dims(values: Sequence[int]) -> Any:
    dims = Dims()
    for i, value in enumerate(values):
        dims[i] = int(value)
    return dims


class _Version(ctypes.Structure):
    _fields_ = [
        ("major", ctypes.c_int),
        ("minor", ctypes.c_int),
        ("patch", ctypes.c_int),
        ("hash", ctypes.c_char_p),
        ("cpu_runtime", ctypes.c_uint),
        ("gpu_runtime", ctypes.c_uint),
    ]


class Dnnl:
    """One loaded library with its CPU engine; objects it creates are plain handles.

    Primitives run from several threads at once (the sidecar's workers), so what a run writes
    besides its output lives per thread: a stream, and one scratchpad buffer that every
    primitive run on that thread borrows (runs on one thread never overlap). oneDNN's own
    scratchpad is one global buffer, unsafe across threads, hence ``SCRATCHPAD_USER``.
    """

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        lib.dnnl_primitive_desc_query_md.restype = Handle
        lib.dnnl_primitive_desc_query_md.argtypes = [Handle, ctypes.c_int, ctypes.c_int]
        lib.dnnl_memory_desc_get_size.restype = ctypes.c_size_t
        lib.dnnl_memory_desc_get_size.argtypes = [Handle]
        lib.dnnl_memory_desc_equal.argtypes = [Handle, Handle]
        lib.dnnl_memory_set_data_handle.argtypes = [Handle, Handle]
        lib.dnnl_primitive_execute.argtypes = [Handle, Handle, ctypes.c_int, Handle]
        lib.dnnl_version.restype = ctypes.POINTER(_Version)
        self.engine = self._create(lib.dnnl_engine_create, ENGINE_CPU, 0)
        self.local = threading.local()

    def version(self) -> str:
        found = self.lib.dnnl_version().contents
        return f"{found.major}.{found.minor}.{found.patch}"

    def check(self, status: int, what: str) -> None:
        if status != 0:
            raise DnnlError(f"oneDNN {what} failed with status {status}")

    def _create(self, function: Any, *args: Any) -> Handle:
        handle = Handle()
        self.check(function(ctypes.byref(handle), *args), function.__name__)
        return handle

    def strided_desc(
        self, shape: Sequence[int], strides: Sequence[int], dtype: torch.dtype = torch.float32
    ) -> Handle:
        return self._create(
            self.lib.dnnl_memory_desc_create_with_strides,
            len(shape),
            _dims(shape),
            DATA_TYPES[dtype],
            _dims(strides),
        )

    def any_desc(self, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> Handle:
        """A descriptor whose layout the primitive chooses (its blocked weight format)."""
        return self._create(
            self.lib.dnnl_memory_desc_create_with_tag,
            len(shape),
            _dims(shape),
            DATA_TYPES[dtype],
            FORMAT_ANY,
        )

    def attributes(
        self, residual: Handle | None, activation: str, accumulate: bool = False
    ) -> Handle:
        """Post-ops: ``+ residual`` (binary add, post-op 0), or with ``accumulate`` a sum into
        what the output buffer already holds, then the activation."""
        post_ops = self._create(self.lib.dnnl_post_ops_create)
        if accumulate:
            self.check(
                self.lib.dnnl_post_ops_append_sum(post_ops, ctypes.c_float(1.0), 0, 0), "sum"
            )
        elif residual is not None:
            self.check(
                self.lib.dnnl_post_ops_append_binary(post_ops, BINARY_ADD, residual), "binary"
            )
        if activation != "none":
            algorithm, alpha, beta = ELTWISE[activation]
            self.check(
                self.lib.dnnl_post_ops_append_eltwise(
                    post_ops, algorithm, ctypes.c_float(alpha), ctypes.c_float(beta)
                ),
                "eltwise post-op",
            )
        attr = self._create(self.lib.dnnl_primitive_attr_create)
        self.check(self.lib.dnnl_primitive_attr_set_post_ops(attr, post_ops), "post-ops")
        self.check(self.lib.dnnl_primitive_attr_set_scratchpad_mode(attr, SCRATCHPAD_USER), "mode")
        self.lib.dnnl_post_ops_destroy(post_ops)
        return attr

    def convolution(
        self,
        src: Handle,
        weights: Handle,
        bias: Handle | None,
        dst: Handle,
        stride: Sequence[int],
        dilation: Sequence[int],
        padding: Sequence[int],
        attr: Handle,
    ) -> Handle:
        """A forward-inference convolution's primitive descriptor (dilation as in torch)."""
        return self._create(
            self.lib.dnnl_convolution_forward_primitive_desc_create,
            self.engine,
            FORWARD_INFERENCE,
            CONVOLUTION_DIRECT,
            src,
            weights,
            bias,
            dst,
            _dims(stride),
            _dims([d - 1 for d in dilation]),
            _dims(padding),
            _dims(padding),
            attr,
        )

    def inner_product(
        self, src: Handle, weights: Handle, bias: Handle | None, dst: Handle, attr: Handle
    ) -> Handle:
        """A forward-inference inner product's primitive descriptor: rows times weight^T."""
        return self._create(
            self.lib.dnnl_inner_product_forward_primitive_desc_create,
            self.engine,
            FORWARD_INFERENCE,
            src,
            weights,
            bias,
            dst,
            attr,
        )

    def reorder(self, source: Handle, target: Handle) -> Handle:
        return self._create(
            self.lib.dnnl_reorder_primitive_desc_create,
            source,
            self.engine,
            target,
            self.engine,
            None,
        )

    def primitive(self, descriptor: Handle) -> Handle:
        return self._create(self.lib.dnnl_primitive_create, descriptor)

    def argument_desc(self, descriptor: Handle, argument: int) -> Handle:
        """The memory descriptor the primitive wants for one argument (owned by ``descriptor``)."""
        query = self.lib.dnnl_primitive_desc_query_md
        return Handle(query(descriptor, QUERY_EXEC_ARG_MD, argument))

    def implementation(self, descriptor: Handle) -> str:
        name = ctypes.c_char_p()
        self.check(
            self.lib.dnnl_primitive_desc_query(descriptor, QUERY_IMPL_INFO, 0, ctypes.byref(name)),
            "query",
        )
        return (name.value or b"").decode()

    def size(self, desc: Handle) -> int:
        return int(self.lib.dnnl_memory_desc_get_size(desc))

    def same(self, a: Handle, b: Handle) -> bool:
        return bool(self.lib.dnnl_memory_desc_equal(a, b))

    def clone(self, desc: Handle) -> Handle:
        return self._create(self.lib.dnnl_memory_desc_clone, desc)

    def memory(self, desc: Handle, pointer: int | None) -> Handle:
        return self._create(self.lib.dnnl_memory_create, desc, self.engine, Handle(pointer))

    def arguments(self, pairs: Sequence[tuple[int, Handle]]) -> Any:
        return (ExecArg * len(pairs))(*(ExecArg(arg, memory) for arg, memory in pairs))

    def scratchpad(self, size: int) -> int:
        """The address of this thread's scratchpad, at least ``size`` bytes."""
        buffer = getattr(self.local, "scratchpad", None)
        if buffer is None or buffer.numel() < size:
            buffer = self.local.scratchpad = torch.empty(size, dtype=torch.uint8)
        return int(buffer.data_ptr())

    def stream(self) -> Handle:
        """This thread's stream."""
        stream = getattr(self.local, "stream", None)
        if stream is None:
            stream = self.local.stream = self._create(
                self.lib.dnnl_stream_create, self.engine, STREAM_IN_ORDER
            )
        return stream

    def execute(self, primitive: Handle, arguments: Any, stream: Handle | None = None) -> None:
        stream = stream if stream is not None else self.stream()
        status = self.lib.dnnl_primitive_execute(primitive, stream, len(arguments), arguments)
        self.check(status, "execute")

    def destroy(self, kind: str, *handles: Handle) -> None:
        """Frees handles of one kind: ``primitive``, ``primitive_desc``, ``memory``,
        ``memory_desc`` or ``primitive_attr``."""
        function = getattr(self.lib, f"dnnl_{kind}_destroy")
        for handle in handles:
            function(handle)


def _candidates() -> list[Path]:
    configured = os.environ.get("CUVIL_DNNL_LIBRARY")
    if configured:
        return [Path(configured)]
    return [
        Path(prefix) / "lib" / LIBRARY_NAME
        for prefix in dict.fromkeys((sys.prefix, sys.base_prefix))
    ]


def describe() -> str:
    """Which oneDNN the convolution and linear kernels call, for reports."""
    dnnl = load()
    if dnnl is None:
        return "ATen's oneDNN calls (libdnnl not loaded)"
    return f"oneDNN {dnnl.version()} kept primitives ({LIBRARY_NAME})"


@functools.cache
def load() -> Dnnl | None:
    """The library, or None where it is absent or switched off (``CUVIL_DNNL=off``)."""
    if os.environ.get("CUVIL_DNNL", "on") == "off" or not sys.platform.startswith("linux"):
        return None
    for path in _candidates():
        if path.exists():
            return Dnnl(ctypes.CDLL(str(path)))
    return None
