"""The sidecar's native gRPC front end (``frontend.cc``), compiled on first use and loaded with
ctypes.

gRPC C++ takes the HTTP/2 and framing work that grpcio's Python server does in Python; the
handlers stay the Python ones (``native_frontend.py``). The library links the system's gRPC C++
(Debian/Ubuntu: ``apt install libgrpc++-dev libprotobuf-dev pkg-config g++``; gRPC 1.51 is what
Debian 12 ships and what it is tested with) and is cached like Cuvil's C kernels, under a name
that digests the source and the flags, so a node builds it once. ``load`` raises ``NativeError``
saying what is missing; the sidecar then serves with grpcio (``CUVIL_GRPC_FRONTEND=auto``) or
refuses to start (``native``).

Container images build it at image build time (``python -m cuvil_sidecar.native``) and keep only
gRPC's runtime libraries.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from cuvil.runtime.native_build import NativeError, cache_dir, compile_into

SOURCE = Path(__file__).parent / "frontend.cc"
FLAGS = ("-O2", "-std=c++17", "-fPIC", "-shared")
PACKAGES = ("grpc++", "protobuf")
LIBRARIES = ("-lgrpc++_reflection",)

# dispatch(call, method index, request bytes, size, metadata, metadata size, tensors, entries,
# entry count: -1 for a request passed whole, the client's deadline in ns since the epoch or 0)
DISPATCH = ctypes.CFUNCTYPE(
    None,
    ctypes.c_void_p,
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_void_p,
    ctypes.POINTER(ctypes.c_uint64),
    ctypes.c_int64,
    ctypes.c_int64,
)


def _run(command: list[str]) -> str:
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise NativeError(f"{' '.join(command)} failed: {result.stderr.strip()[:500]}")
    return result.stdout.strip()


def _grpc_flags() -> list[str]:
    """Compiler and linker flags for gRPC C++ and protobuf, from pkg-config."""
    if shutil.which("pkg-config") is None:
        raise NativeError("pkg-config is not installed (apt install pkg-config libgrpc++-dev)")
    try:
        flags = _run(["pkg-config", "--cflags", "--libs", *PACKAGES]).split()
    except NativeError:
        raise NativeError(
            "gRPC C++ is not installed (apt install libgrpc++-dev libprotobuf-dev)"
        ) from None
    return [*flags, *LIBRARIES]


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "c++", "g++"):
        if name and shutil.which(name):
            return name
    raise NativeError("no C++ compiler (c++ or g++) on PATH")


def build() -> Path:
    """The front end's shared library, compiled into the cache unless already there. A cached
    library is found without pkg-config or a compiler (images keep only gRPC's runtime)."""
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(b"\0".join([source, " ".join([*FLAGS, *LIBRARIES]).encode()]))
    target = cache_dir() / f"frontend-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    flags = _grpc_flags()
    compiler = _compiler()
    compile_into(target, lambda built: [compiler, *FLAGS, str(SOURCE), "-o", str(built), *flags])
    return target


@functools.cache
def load() -> ctypes.CDLL:
    """The loaded library with its entry points typed; ``NativeError`` says why not."""
    try:
        library = ctypes.CDLL(str(build()))
    except OSError as error:
        raise NativeError(
            f"loading the gRPC front end failed ({error}); if gRPC C++ was upgraded, remove "
            f"the cached frontend-*.so under {cache_dir()} to rebuild it"
        ) from None
    c_void_p, c_char_p, c_size_t, c_int = (
        ctypes.c_void_p,
        ctypes.c_char_p,
        ctypes.c_size_t,
        ctypes.c_int,
    )
    library.cuvil_frontend_add_descriptor.argtypes = [c_char_p, c_char_p, c_size_t]
    library.cuvil_frontend_add_descriptor.restype = c_int
    library.cuvil_frontend_start.argtypes = [
        c_char_p,
        c_char_p,
        c_size_t,
        ctypes.POINTER(c_int),
        ctypes.POINTER(c_int),
        c_size_t,
        c_int,
        c_char_p,
        c_char_p,
        c_char_p,
        c_int,
        DISPATCH,
        c_char_p,
        c_size_t,
    ]
    library.cuvil_frontend_start.restype = c_void_p
    library.cuvil_frontend_port.argtypes = [c_void_p]
    library.cuvil_frontend_port.restype = c_int
    library.cuvil_frontend_set_serving.argtypes = [c_void_p, c_char_p, c_int]
    library.cuvil_frontend_set_serving.restype = None
    library.cuvil_frontend_finish.argtypes = [c_void_p, c_int, c_char_p, c_char_p, c_size_t]
    library.cuvil_frontend_finish.restype = None
    library.cuvil_frontend_write.argtypes = [c_void_p, c_char_p, c_size_t, c_int]
    library.cuvil_frontend_write.restype = c_int
    library.cuvil_frontend_cancelled.argtypes = [c_void_p]
    library.cuvil_frontend_cancelled.restype = c_int
    library.cuvil_frontend_stop.argtypes = [c_void_p, c_int]
    library.cuvil_frontend_stop.restype = None
    library.cuvil_frontend_release.argtypes = [c_void_p]
    library.cuvil_frontend_release.restype = None
    library.cuvil_frontend_free.argtypes = [c_void_p]
    library.cuvil_frontend_free.restype = None
    return library
