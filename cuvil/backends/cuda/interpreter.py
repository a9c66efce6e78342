"""Cuvil's kernels run on the CPU through Triton's interpreter: how a CUDA plan is verified on a
machine without a GPU (the numbers of the templates the cubins were compiled from, on CPU
tensors; speed is not measured this way).

Two gaps of the interpreter (Triton 3.9) are closed for the length of each launch:
``triton.language.extra.libdevice`` functions are bodiless stubs there (they return None), so
the ones the templates call map to numpy; and ``tl.dot`` on bf16 multiplies the raw 16-bit
storage, so bf16 operands widen to fp32 first. Both patches apply under one lock and are undone
after the launch, so nothing else in the process sees them.

Triton decides when it is imported whether its own library functions (``tl.sum``, ``tl.max``,
written in Triton) are interpreted, from ``TRITON_INTERPRET``; torch imports Triton early where
it is installed, so that cannot be relied on. Each launch therefore swaps the library's
compiled functions for interpreted twins of the same source, as ``TRITON_INTERPRET=1`` would
have made them, and swaps them back after.

The interpreter runs in this process: an out-of-bounds access there can corrupt memory or
crash the process rather than fail, so every launch is guarded. Callers pass tensors whose
rows are contiguous (launches.py makes them so), and ``Interpreted.launch`` checks the guards
the cubin was compiled under (16-divisible pointers and sizes) and that the storage of every
tensor the kernel indexes holds the elements its grid reaches from it, before anything runs.
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import numpy as np
import torch
import triton.experimental.gluon  # noqa: F401  (imported by launches; not while patched)
import triton.language as tl
from triton.language.extra import libdevice
from triton.runtime import interpreter as triton_interpreter
from triton.runtime.interpreter import InterpretedFunction, TensorHandle
from triton.runtime.jit import JITFunction

from cuvil.backends.cuda.templates import TEMPLATES, template_digest

_LOCK = threading.Lock()
_erf = np.vectorize(math.erf, otypes=[np.float64])
# libdevice function -> its numpy twin (computed in the operand's own precision)
NUMPY_LIBDEVICE: dict[str, Callable[..., Any]] = {
    "tanh": np.tanh,
    "erf": lambda x: _erf(x).astype(x.dtype),
    "exp": np.exp,
    "log": np.log,
    "sqrt": np.sqrt,
    "rsqrt": lambda x: (1.0 / np.sqrt(x)).astype(x.dtype),
    "pow": np.power,
}


class GuardError(ValueError):
    """A launch whose arguments break what the kernel was compiled for."""


def _numpy_function(function: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **_: Any) -> Any:
        tensors = [arg for arg in args if isinstance(arg, tl.tensor)]
        first = tensors[0]
        values = [arg.handle.data if isinstance(arg, tl.tensor) else arg for arg in args]
        result = np.asarray(function(*values)).astype(first.handle.data.dtype)
        return tl.tensor(TensorHandle(result, first.handle.dtype.scalar), first.type)

    return call


def _widened_dot(original: Callable[..., Any]) -> Callable[..., Any]:
    def widen(handle: TensorHandle) -> TensorHandle:
        if handle.dtype.scalar == tl.bfloat16:  # bf16 is held as its uint16 bit patterns
            wide = (handle.data.astype(np.uint32) << 16).view(np.float32)
            return TensorHandle(wide, tl.float32)
        return handle

    def create_dot(self: Any, a: TensorHandle, b: TensorHandle, *rest: Any) -> Any:
        return original(self, widen(a), widen(b), *rest)

    return create_dot


_TWINS: dict[int, InterpretedFunction] = {}


def _library_functions() -> list[tuple[ModuleType, str, JITFunction]]:
    """(module, name, function) for every compiled function of Triton's language modules."""
    found = []
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("triton.language"):
            continue
        for attribute, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                found.append((module, attribute, value))
    return found


def _twin(function: JITFunction) -> InterpretedFunction:
    if id(function) not in _TWINS:
        _TWINS[id(function)] = InterpretedFunction(function.fn)
    return _TWINS[id(function)]


@contextmanager
def interpreter_patches() -> Iterator[None]:
    """Triton's library interpreted, libdevice functions in numpy and bf16 ``tl.dot`` widened,
    for as long as the block runs."""
    builder = triton_interpreter.InterpreterBuilder
    saved_dot = builder.create_dot
    saved = {name: getattr(libdevice, name) for name in NUMPY_LIBDEVICE}
    with _LOCK:
        library = _library_functions()
        try:
            for module, attribute, function in library:
                setattr(module, attribute, _twin(function))
            for name, numpy_function in NUMPY_LIBDEVICE.items():
                setattr(libdevice, name, _numpy_function(numpy_function))
            builder.create_dot = _widened_dot(saved_dot)
            yield
        finally:
            builder.create_dot = saved_dot
            for name, function in saved.items():
                setattr(libdevice, name, function)
            for module, attribute, function in library:
                setattr(module, attribute, function)


class Interpreted:
    """One kernel of the layer, run by the interpreter with the manifest's constexprs."""

    def __init__(self, manifest: Mapping[str, Any]) -> None:
        template = str(manifest["template"])
        if template not in TEMPLATES:
            raise GuardError(f"kernel {manifest['name']}: no template {template!r} in this Cuvil")
        if manifest["source_sha256"] != template_digest(template):
            raise GuardError(
                f"kernel {manifest['name']} was compiled from another version of template "
                f"{template!r}: recompile the artifact with this Cuvil"
            )
        self.name = str(manifest["name"])
        self.function = InterpretedFunction(TEMPLATES[template])
        self.constexprs = dict(manifest["constexprs"])
        self.div16 = frozenset(manifest["guards"]["div16"])
        self.params = [param["name"] for param in manifest["params"]][:-2]  # scratch pointers

    def check(self, args: Mapping[str, Any], reach: Mapping[str, int]) -> None:
        """Refuse a launch that breaks a guard or would index past a tensor (``reach``: the
        elements the grid touches per pointer argument)."""
        if set(args) != set(self.params):
            raise GuardError(
                f"{self.name}: arguments {sorted(args)}, the kernel takes {self.params}"
            )
        for name in self.div16:
            value = args[name]
            number = value.data_ptr() if isinstance(value, torch.Tensor) else int(value)
            if number % 16:
                raise GuardError(f"{self.name}: {name} = {number} is not divisible by 16")
        for name, elements in reach.items():
            tensor = args[name]
            end = (tensor.storage_offset() + elements) * tensor.element_size()
            if tensor.device.type != "cpu" or end > tensor.untyped_storage().nbytes():
                raise GuardError(
                    f"{self.name}: {name} must be a CPU tensor whose storage holds at least "
                    f"{elements} elements from its first, not {tuple(tensor.shape)} on "
                    f"{tensor.device}"
                )

    def launch(
        self, grid: tuple[int, ...], args: Mapping[str, Any], reach: Mapping[str, int]
    ) -> None:
        self.check(args, reach)
        if not math.prod(grid):
            return
        with interpreter_patches():
            self.function[grid](**args, **self.constexprs)
