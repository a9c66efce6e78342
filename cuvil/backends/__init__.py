"""Backends: one folder each, one line each in ``BACKENDS``.

``backend_for(target)`` is the only place a target's family picks the code that runs it. The
table names each backend's module and class, imported when a target of its family is first
asked for, so a machine never imports a backend it does not use.
"""

from __future__ import annotations

import importlib
from functools import cache

from cuvil.backends.base import Backend, Lowering, TargetUnavailableError
from cuvil.targets import Target, parse_target

# target family -> "module:class" of its backend
BACKENDS: dict[str, str] = {
    "cpu": "cuvil.backends.cpu.backend:CpuBackend",
    "cuda": "cuvil.backends.cuda.backend:CudaBackend",
}

__all__ = ["BACKENDS", "Backend", "Lowering", "TargetUnavailableError", "backend_for"]


def backend_for(target: str | Target) -> Backend:
    """The backend that compiles for and runs ``target`` (a name or a parsed Target)."""
    parsed = parse_target(target) if isinstance(target, str) else target
    return _backend(parsed)


@cache
def _backend(target: Target) -> Backend:
    location = BACKENDS.get(target.family)
    if location is None:
        raise TargetUnavailableError(
            f"target {target.name!r}: this build of Cuvil has no {target.family} backend "
            f"(backends: {sorted(BACKENDS)})"
        )
    module, _, name = location.partition(":")
    backend: Backend = getattr(importlib.import_module(module), name)(target)
    return backend
