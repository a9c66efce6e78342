"""Calling a native schedule from Python in one CPython call (native/fast_call.cc).

A schedule's TorchScript ``run`` method costs several microseconds before the schedule starts (a
stack built, a schema matched, the list converted to IValues and back): as much as the whole of
a one-linear model's eager call. The library here gives each schedule a builtin function that
unpacks the tensors, releases the GIL, runs the schedule and wraps its outputs, nothing else.

It includes CPython's and torch's Python headers, so it builds where ``Python.h`` is (a
``python3-dev`` package, or any Python built from source); it is compiled once per torch version
and source into the native cache (runtime/native_build.py), like the plan loop, and loaded with
ctypes. Where it cannot be built, or ``CUVIL_FAST_CALL=off``, ``caller`` returns the schedule's
own ``run`` method and ``reason()`` says why.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sysconfig
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from cuvil.backends.cpu import plan_loop
from cuvil.runtime.native_build import NativeError

SOURCE = Path(__file__).parent / "native" / "fast_call.cc"
Caller = Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]


def _python_include() -> Path:
    include = Path(sysconfig.get_paths()["include"])
    if not (include / "Python.h").exists():
        raise NativeError(f"no Python.h in {include} (install python3-dev)")
    return include


def build() -> Path:
    """The library in the native cache, compiled there unless already present."""
    include = f"-I{_python_include()}"
    return plan_loop.build_against_torch("fast_call", (SOURCE,), (include,), ("-ltorch_python",))


@functools.cache
def _library() -> tuple[Any, int] | str:
    """The loaded library's caller factory and plan_loop's run function, or why not."""
    if os.environ.get("CUVIL_FAST_CALL", "on") == "off":
        return "switched off (CUVIL_FAST_CALL=off)"
    if not plan_loop.load():
        return f"no plan loop: {plan_loop.reason()}"
    try:
        library = ctypes.PyDLL(str(build()))
        run = ctypes.CDLL(str(plan_loop.loaded_path())).cuvil_schedule_run
    except (NativeError, OSError, AttributeError) as error:
        return str(error)
    factory = library.cuvil_schedule_caller
    factory.argtypes = (ctypes.c_void_p, ctypes.c_void_p)
    factory.restype = ctypes.py_object
    address = ctypes.cast(run, ctypes.c_void_p).value
    assert address is not None
    return factory, address


def caller(schedule: Any) -> Caller:
    """The fastest way to run ``schedule`` on a sequence of tensors: its builtin function where
    the library is there, else its own ``run`` method."""
    library = _library()
    if isinstance(library, str):
        return schedule.run
    factory, run = library
    return factory(run, schedule.address())


def reason() -> str | None:
    """Why ``caller`` gives the TorchScript method, if it does."""
    library = _library()
    return library if isinstance(library, str) else None
