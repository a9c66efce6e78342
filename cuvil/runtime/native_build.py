"""Building native code on the machine that runs it: a C or C++ source compiled once into a
cache directory, under a name that digests what went into it, and renamed into place atomically.

Shared by every part with native code: the CPU backend's kernels (``cuvil.backends.cpu.native``)
and the sidecar's gRPC front end (``cuvil_sidecar.native``).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path


class NativeError(RuntimeError):
    """A native kernel could not be built or loaded."""


def cache_dir() -> Path:
    configured = os.environ.get("CUVIL_NATIVE_CACHE")
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "cuvil" / "native"


def compile_into(target: Path, command: Callable[[Path], list[str]]) -> None:
    """Runs the compiler ``command(output)`` on a scratch output beside ``target`` and renames
    it into place: atomic, so concurrent builders all end with a whole file."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        arguments = command(built)
        result = subprocess.run(arguments, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            source = next((Path(a).name for a in arguments if a.endswith((".c", ".cc"))), "")
            raise NativeError(f"compiling {source} failed: {result.stderr.strip()[:500]}")
        os.replace(built, target)
