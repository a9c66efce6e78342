"""Cuvil's own C kernels, compiled on the machine that runs them and loaded with ctypes.

The sources sit next to this file. Each is compiled once per machine with the system's C compiler
(``-O3 -march=native -fopenmp``: the code vectorises for the CPU it will run on) into a cache
directory named by a digest of the source, the flags and the CPU, so an edge node builds its own
copy the first time a model needs it (about a second) and later loads reuse it. OpenMP resolves to
the ``libgomp.so.1`` torch has already loaded, so ``torch.set_num_threads`` sizes both pools.

Where no compiler exists, or ``CUVIL_NATIVE=off``, ``load`` returns None and the kernels that
wanted a native path take another one (``reason`` says why, for reports).

Container images have no compiler, so they are built with one and ``CUVIL_NATIVE_MARCH`` set to a
portable level (``x86-64-v3``: AVX2 and FMA): ``python -m cuvil.backends.cpu.native`` fills the
cache then, and the digest leaves out the CPU, so any node finds the library. Such a library is only
loaded where the CPU has the level's instructions (else None, with the reason), never run into an
illegal instruction.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
from pathlib import Path

import torch  # noqa: F401  loaded first: its libgomp is the one the kernels bind to

from cuvil.runtime.native_build import NativeError, cache_dir, compile_into

SOURCES = Path(__file__).parent
FLAGS = ("-O3", "-fopenmp", "-fPIC", "-shared", "-std=c11")
# portable levels -> the /proc/cpuinfo flags a CPU needs to run code built for them
LEVEL_FLAGS = {
    "x86-64": frozenset(),
    "x86-64-v2": frozenset({"sse4_2", "popcnt", "ssse3"}),
    "x86-64-v3": frozenset({"sse4_2", "popcnt", "avx", "avx2", "fma", "bmi2", "f16c", "movbe"}),
}
_failures: dict[str, str] = {}


def march() -> str:
    """``-march``: ``native`` unless ``CUVIL_NATIVE_MARCH`` names a portable level."""
    level = os.environ.get("CUVIL_NATIVE_MARCH", "native")
    if level != "native" and level not in LEVEL_FLAGS:
        choices = ", ".join(["native", *sorted(LEVEL_FLAGS)])
        raise NativeError(f"CUVIL_NATIVE_MARCH={level!r}: use one of {choices}")
    return level


def _cpuinfo() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return [platform.processor()]
    return sorted({line for line in text.splitlines() if line.startswith(("model name", "flags"))})


def _cpu_flags() -> set[str]:
    return {flag for line in _cpuinfo() if line.startswith("flags") for flag in line.split()[2:]}


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return name
    return None


def build(name: str, *, for_this_cpu: bool = True) -> Path:
    """The shared library for ``<name>.c``, compiled into the cache unless already there.
    ``for_this_cpu=False`` (an image build) compiles for the level whatever the builder's CPU."""
    source = (SOURCES / f"{name}.c").read_bytes()
    level = march()
    flags = (*FLAGS, f"-march={level}")
    identity = "\n".join(_cpuinfo()) if level == "native" else level  # portable: any CPU
    digest = hashlib.sha256(
        b"\0".join([source, " ".join(flags).encode(), identity.encode()])
    ).hexdigest()[:16]
    target = cache_dir() / f"{name}-{digest}.so"
    missing = LEVEL_FLAGS.get(level, frozenset()) - _cpu_flags()
    if missing and for_this_cpu:
        raise NativeError(f"built for {level}, which needs {sorted(missing)} this CPU lacks")
    if target.exists():
        return target
    compiler = _compiler()
    if compiler is None:
        raise NativeError("no C compiler (cc or gcc) on PATH")
    source_path = SOURCES / f"{name}.c"
    compile_into(target, lambda built: [compiler, *flags, str(source_path), "-o", str(built)])
    return target


@functools.cache
def load(name: str) -> ctypes.CDLL | None:
    """The library for ``<name>.c``, or None (why: ``reason(name)``)."""
    if os.environ.get("CUVIL_NATIVE", "on") == "off":
        _failures[name] = "switched off (CUVIL_NATIVE=off)"
        return None
    try:
        return ctypes.CDLL(str(build(name)))
    except (NativeError, OSError) as error:
        _failures[name] = str(error)
        return None


def describe(name: str) -> str:
    """For reports: the library a kernel family runs, or why it is not offered. Loads it."""
    library = load(name)
    if library is None:
        return f"not offered: {reason(name)}"
    return f"native ({library._name})"


def reason(name: str) -> str | None:
    """Why ``load(name)`` returned None, if it did."""
    return _failures.get(name)


def sources() -> list[str]:
    """The names of every native source (``<name>.c`` next to this file)."""
    return sorted(path.stem for path in SOURCES.glob("*.c"))
