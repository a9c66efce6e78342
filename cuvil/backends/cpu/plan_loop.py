"""The native plan loop's library (native/plan_loop.cc, with Cuvil's kernels as dispatcher ops
from native/kernel_ops.cc, packed_gemm.cc, block_attention.cc, cached_attention.cc,
bf16_weights.cc and int8_weights.cc): built on
first use, loaded into torch.

It is C++ against torch's own headers and libraries (a TorchScript custom class and op, no
Python binding code, so it builds in seconds of compiler time), compiled once per torch version
and source into the native cache (runtime/native_build.py) and loaded with
``torch.ops.load_library``. It is built without ``-march``, so one build serves every x86 CPU:
decode attention is cloned per level (``target_clones``: x86-64-v3 and the baseline, one picked
when the library loads), and block attention and the bf16-weight GEMM are built for
x86-64-v4 and v3 (16-lane and 8-lane code), one picked per call (CPUs with neither hand block
attention's calls to ATen). It is built with ``-fopenmp``: ATen's
``at::parallel_for`` is a header template whose OpenMP region compiles to a serial loop
without it; the library binds to the ``libgomp.so.1`` torch has already loaded, so
``torch.set_num_threads`` sizes its regions as it does torch's. Where no C++ compiler exists,
the build fails, or ``CUVIL_NATIVE_PLAN=off``, ``load()`` returns None and ``reason()`` says
why; models then run the Python plan.

The kept oneDNN primitives are executed through libdnnl's C functions, whose addresses are
handed to the library once (libdnnl is loaded by ctypes, local to it); each primitive step
carries its own engine.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch

from cuvil.backends.cpu.dnnl import load as load_dnnl
from cuvil.runtime.native_build import NativeError, cache_dir, link_into

NATIVE = Path(__file__).parent / "native"
SOURCES = tuple(
    NATIVE / name
    for name in (
        "plan_loop.cc",
        "kernel_ops.cc",
        "packed_gemm.cc",
        "block_attention.cc",
        "cached_attention.cc",
        "bf16_weights.cc",
        "int8_weights.cc",
    )
)
HEADERS = (
    NATIVE / "vector_math.h",
    NATIVE / "eight_lanes.h",
    NATIVE / "block_attention.h",
)  # included by the sources: part of the build's digest
FLAGS = ("-O2", "-std=c++17", "-fPIC", "-shared", "-w")
_failure: list[str] = []
_loaded: list[Path] = []  # a process registers the library's ops once: a second one would abort


def compiler_name() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++"):
        if name and shutil.which(name):
            return name
    return None


def torch_flags() -> list[str]:
    root = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-I{root / 'include'}",
        f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
    ]


def link_flags() -> list[str]:
    lib = Path(torch.__file__).parent / "lib"
    return [f"-L{lib}", "-lc10", "-ltorch_cpu", "-ltorch", f"-Wl,-rpath,{lib}"]


def build() -> Path:
    """The library in the native cache, compiled there unless already present."""
    return build_against_torch("plan_loop", SOURCES, ("-fopenmp",), headers=HEADERS)


def build_against_torch(
    name: str,
    sources: Sequence[Path],
    flags: Sequence[str] = (),
    links: Sequence[str] = (),
    headers: Sequence[Path] = (),
) -> Path:
    """A C++ library against torch's headers and libraries (``flags`` and ``links`` added), in
    the native cache under a digest of its sources, the ``headers`` they include, its flags and
    torch's version; compiled there unless already present."""
    flags = (*FLAGS, *torch_flags(), *flags)
    parts = [source.read_bytes() for source in (*sources, *headers)]
    parts.append(" ".join(flags).encode())
    parts.append(torch.__version__.encode())
    digest = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    target = cache_dir() / f"{name}-{digest}.so"
    if target.exists():
        return target
    compiler = compiler_name()
    if compiler is None:
        raise NativeError("no C++ compiler (c++ or g++) on PATH")
    link_into(target, compiler, sources, flags, [*link_flags(), *links])
    return target


@functools.cache
def load() -> bool:
    """Whether ``torch.ops.cuvil_native`` is there (built and loaded now if need be)."""
    if os.environ.get("CUVIL_NATIVE_PLAN", "on") == "off":
        _failure.append("switched off (CUVIL_NATIVE_PLAN=off)")
        return False
    try:
        path = build()
        if not _loaded:
            torch.ops.load_library(str(path))
            _loaded.append(path)
    except (NativeError, OSError, RuntimeError) as error:
        _failure.append(str(error))
        return False
    _give_dnnl()
    return True


def _give_dnnl() -> None:
    dnnl = load_dnnl()
    if dnnl is None:
        return
    names = (
        "dnnl_memory_create",
        "dnnl_memory_set_data_handle",
        "dnnl_primitive_execute",
        "dnnl_stream_create",
        "dnnl_memory_destroy",
    )
    addresses = [
        int(ctypes.cast(getattr(dnnl.lib, name), ctypes.c_void_p).value or 0) for name in names
    ]
    torch.ops.cuvil_native.set_dnnl(addresses)


def loaded_path() -> Path:
    """The library ``load()`` loaded into this process."""
    return _loaded[0]


def reason() -> str | None:
    """Why ``load()`` returned False, if it did."""
    return _failure[-1] if _failure else None
