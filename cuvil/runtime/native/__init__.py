"""Cuvil's own C kernels, compiled on the machine that runs them and loaded with ctypes.

The sources sit next to this file. Each is compiled once per machine with the system's C compiler
(``-O3 -march=native -fopenmp``: the code vectorises for the CPU it will run on) into a cache
directory named by a digest of the source, the flags and the CPU, so an edge node builds its own
copy the first time a model needs it (about a second) and later loads reuse it. OpenMP resolves to
the ``libgomp.so.1`` torch has already loaded, so ``torch.set_num_threads`` sizes both pools.

Where no compiler exists, or ``CUVIL_NATIVE=off``, ``load`` returns None and the kernels that
wanted a native path take another one (``reason`` says why, for reports).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch  # noqa: F401  loaded first: its libgomp is the one the kernels bind to

SOURCES = Path(__file__).parent
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11")
_failures: dict[str, str] = {}


class NativeError(RuntimeError):
    """A native kernel could not be built or loaded."""


def cache_dir() -> Path:
    configured = os.environ.get("CUVIL_NATIVE_CACHE")
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "cuvil" / "native"


def _cpu_identity() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return name
    return None


def build(name: str) -> Path:
    """The shared library for ``<name>.c``, compiled into the cache unless already there."""
    source = (SOURCES / f"{name}.c").read_bytes()
    compiler = _compiler()
    if compiler is None:
        raise NativeError("no C compiler (cc or gcc) on PATH")
    digest = hashlib.sha256(
        b"\0".join([source, " ".join(FLAGS).encode(), _cpu_identity().encode()])
    ).hexdigest()[:16]
    target = cache_dir() / f"{name}-{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        result = subprocess.run(
            [compiler, *FLAGS, str(SOURCES / f"{name}.c"), "-o", str(built)],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            raise NativeError(f"compiling {name}.c failed: {result.stderr.strip()[:500]}")
        os.replace(built, target)  # atomic: concurrent builders all end with a whole file
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


def reason(name: str) -> str | None:
    """Why ``load(name)`` returned None, if it did."""
    return _failures.get(name)
