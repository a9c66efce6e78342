"""Building native code on the machine that runs it: a C or C++ source compiled once into a
cache directory, under a name that digests what went into it, and renamed into place atomically.

Shared by every part with native code: the CPU backend's kernels (``cuvil.backends.cpu.native``)
and the sidecar's gRPC front end (``cuvil_sidecar.native``).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Callable, Sequence
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
        run_compilers([command(built)])
        os.replace(built, target)


def link_into(
    target: Path, compiler: str, sources: Sequence[Path], flags: Sequence[str], links: Sequence[str]
) -> None:
    """A library of several sources: each compiled to an object on its own, side by side (at
    most one compiler per CPU: the headers of torch make each source take tens of seconds),
    then linked into ``target``; as ``compile_into``, renamed into place when whole."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        objects = [Path(scratch) / f"{i}-{source.stem}.o" for i, source in enumerate(sources)]
        run_compilers(
            [
                [compiler, *flags, "-c", str(source), "-o", str(built)]
                for source, built in zip(sources, objects, strict=True)
            ]
        )
        built = Path(scratch) / target.name
        run_compilers([[compiler, *flags, *map(str, objects), "-o", str(built), *links]])
        os.replace(built, target)


def run_compilers(commands: Sequence[list[str]]) -> None:
    """Runs the compiler commands, as many at once as there are CPUs to run them; the first
    that fails raises ``NativeError`` with its source's name and its message, once all end."""
    slots = max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
    failures: list[str] = []
    for start in range(0, len(commands), slots):
        batch = commands[start : start + slots]
        running = [
            subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for c in batch
        ]
        for arguments, process in zip(batch, running, strict=True):
            _, errors = process.communicate()
            if process.returncode != 0:
                source = next((Path(a).name for a in arguments if a.endswith((".c", ".cc"))), "")
                failures.append(f"compiling {source} failed: {errors.strip()[:500]}")
    if failures:
        raise NativeError(failures[0])
