"""Launching a compiled kernel of the layer on a GPU through the CUDA driver API (``libcuda``),
with ctypes: what the GPU runtime needs besides torch — no Triton, no compiler, no CUDA toolkit.

A kernel's arguments are packed from its manifest, never from Python's types: pointers as
8-byte addresses, ``i32`` as 4 bytes, ``fp32`` scalars as 4-byte floats (two stock launchers
pass them as doubles, which a kernel reads as garbage), then Triton's two trailing scratch
pointers (null: the templates need no scratch; a manifest that asks for some is refused).
``pack_arguments`` is pure and checked on the CPU against the manifest's parameter offsets.

``DriverKernel`` loads one image of a kernel once (``cuModuleLoadData`` takes a cubin, or PTX
that the driver JIT-compiles; images.py chooses), sets the dynamic shared-memory limit where a
kernel needs more than 48 KB, and launches on the stream it is given (torch's current stream,
so a CUDA-graph capture records it). Modules live in the device's primary context, the one
torch uses; ``Driver.ensure_context`` makes it current on a thread that has none yet.
"""

from __future__ import annotations

import ctypes
import struct
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
DEFAULT_SHARED_LIMIT = 48 * 1024
SCRATCH = ("global_scratch", "profile_scratch")
# manifest type -> (ctypes type, struct format) of a kernel parameter
SCALARS: dict[str, tuple[type[Any], str]] = {
    "i32": (ctypes.c_int32, "<i"),
    "i64": (ctypes.c_int64, "<q"),
    "fp32": (ctypes.c_float, "<f"),
}
POINTER = (ctypes.c_uint64, "<Q")


class DriverError(RuntimeError):
    """The driver refused a call, or a launch does not fit its kernel."""


def _address(value: Any) -> int:
    return int(value.data_ptr()) if hasattr(value, "data_ptr") else int(value)


@dataclass(frozen=True)
class PackedArguments:
    """The values a launch passes (kept alive for the call) and the ``void**`` array of them."""

    values: tuple[ctypes._SimpleCData[Any], ...]
    pointers: ctypes.Array[ctypes.c_void_p]

    def image(self, offsets: list[int], size: int) -> bytes:
        """The parameter area as the driver builds it: each value copied to its offset."""
        area = bytearray(size)
        for value, offset in zip(self.values, offsets, strict=True):
            data = ctypes.string_at(ctypes.addressof(value), ctypes.sizeof(value))
            area[offset : offset + len(data)] = data
        return bytes(area)


def pack_arguments(manifest: Mapping[str, Any], args: Mapping[str, Any]) -> PackedArguments:
    """The kernel's parameters from ``args`` (tensors or addresses for pointers, numbers for
    scalars), in the manifest's order and types, with the two scratch pointers last."""
    values: list[ctypes._SimpleCData[Any]] = []
    launch = manifest.get("launch", {})
    if launch.get("global_scratch_size") or launch.get("profile_scratch_size"):
        raise DriverError(f"{manifest['name']}: kernels that need scratch memory are not launched")
    for param in manifest["params"]:
        name, kind = param["name"], param["type"]
        if name in SCRATCH:
            values.append(ctypes.c_uint64(0))
        elif kind.startswith("*"):
            values.append(ctypes.c_uint64(_address(args[name])))
        elif kind in SCALARS:
            values.append(SCALARS[kind][0](args[name]))
        else:
            raise DriverError(f"{manifest['name']}: parameter {name} of type {kind}")
    pointers = (ctypes.c_void_p * len(values))(
        *(ctypes.cast(ctypes.pointer(value), ctypes.c_void_p) for value in values)
    )
    return PackedArguments(tuple(values), pointers)


def parameter_bytes(kind: str) -> int:
    return struct.calcsize(POINTER[1] if kind.startswith("*") else SCALARS[kind][1])


class Driver:
    """The few driver-API calls a launch needs, from ``libcuda.so.1`` (or ``library``)."""

    def __init__(self, library: str = "libcuda.so.1") -> None:
        try:
            self.lib = ctypes.CDLL(library)
        except OSError as error:
            raise DriverError(f"no CUDA driver ({library}): {error}") from None
        self.check("cuInit", self.lib.cuInit(0))
        self._threads = threading.local()

    def check(self, call: str, status: int) -> None:
        if status:
            message = ctypes.c_char_p()
            self.lib.cuGetErrorString(status, ctypes.byref(message))
            text = message.value.decode() if message.value else "unknown error"
            raise DriverError(f"{call} failed with {status}: {text}")

    def ensure_context(self, ordinal: int = 0) -> None:
        """Make device ``ordinal``'s primary context current on this thread, if none is."""
        local = self._threads
        if getattr(local, "ready", False):
            return
        lib, context = self.lib, ctypes.c_void_p()
        self.check("cuCtxGetCurrent", lib.cuCtxGetCurrent(ctypes.byref(context)))
        if not context.value:
            device = ctypes.c_int()
            self.check("cuDeviceGet", lib.cuDeviceGet(ctypes.byref(device), ordinal))
            status = lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device)
            self.check("cuDevicePrimaryCtxRetain", status)
            self.check("cuCtxSetCurrent", lib.cuCtxSetCurrent(context))
        local.ready = True

    def version(self) -> int:
        """The driver's CUDA version, e.g. 13000 for 13.0."""
        found = ctypes.c_int()
        self.check("cuDriverGetVersion", self.lib.cuDriverGetVersion(ctypes.byref(found)))
        return found.value


class DriverKernel:
    """One image of a kernel of the layer (its cubin unless told otherwise), loaded into the
    current context, launched from its manifest."""

    def __init__(
        self,
        driver: Driver,
        manifest: Mapping[str, Any],
        image: bytes,
        *,
        symbol: str | None = None,
        shared: int | None = None,
    ) -> None:
        self.driver, self.manifest = driver, manifest
        self._image = ctypes.create_string_buffer(image)  # NUL-terminated, as PTX must be
        self.module, self.function = ctypes.c_void_p(), ctypes.c_void_p()
        lib = driver.lib
        driver.check(
            "cuModuleLoadData", lib.cuModuleLoadData(ctypes.byref(self.module), self._image)
        )
        name = str(symbol or manifest["symbol"]).encode()
        status = lib.cuModuleGetFunction(ctypes.byref(self.function), self.module, name)
        driver.check("cuModuleGetFunction", status)
        self.shared = int(manifest["shared"] if shared is None else shared)
        if self.shared > DEFAULT_SHARED_LIMIT:
            attribute = CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            status = lib.cuFuncSetAttribute(self.function, attribute, self.shared)
            driver.check("cuFuncSetAttribute", status)
        self.block = tuple(int(size) for size in manifest["block"])

    def launch(
        self,
        grid: tuple[int, ...],
        args: Mapping[str, Any],
        reach: Mapping[str, int],
        stream: int = 0,
    ) -> None:
        """Launch over ``grid`` on ``stream`` (``reach`` is the interpreter's bounds check; on
        the GPU the templates' masks keep each access inside its row)."""
        packed = pack_arguments(self.manifest, args)
        x, y, z = (*grid, 1, 1)[:3]
        status = self.driver.lib.cuLaunchKernel(
            self.function,
            ctypes.c_uint(x),
            ctypes.c_uint(y),
            ctypes.c_uint(z),
            *(ctypes.c_uint(size) for size in self.block),
            ctypes.c_uint(self.shared),
            ctypes.c_void_p(stream),
            packed.pointers,
            None,
        )
        self.driver.check("cuLaunchKernel", status)
