"""Building the CPU backend's kernels straight from their factories, as a plan would."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from cuvil.backends.cpu.kept_primitives import KeptPrimitives, KeptWithFallback
from cuvil.backends.cpu.native_calls import OpCall, Result
from cuvil.runtime.kernels import FusedCall, KernelFactory, PreparedKernel


def prepare(
    factory: KernelFactory,
    constants: Mapping[str, Any],
    runtime: Sequence[str] = ("input",),
    *,
    input_sizes: tuple[int | None, ...] | None = None,
    donated: bool = False,
) -> PreparedKernel:
    """``factory``'s kernel for a node with these constants and run-time arguments."""
    sizes = {"input": input_sizes} if input_sizes is not None else {}
    call = FusedCall("cuvil.test", "node", constants, tuple(runtime), sizes, donated)
    return factory(call)


def kept_of(kernel: PreparedKernel) -> KeptPrimitives | None:
    """The kept oneDNN primitives a kernel runs on, if it runs on them (not ATen's call)."""
    owner = getattr(kernel.run, "__self__", None)
    return owner.kept if isinstance(owner, KeptWithFallback) else None


def run_native(calls: Sequence[Any]) -> Any:
    """A native form's calls run one by one in Python, ``Result(i)`` standing for the i-th's
    result; the last one's result."""
    results: list[Any] = []
    for call in calls:
        assert isinstance(call, OpCall)
        args = [results[a.index] if isinstance(a, Result) else a for a in call.args]
        results.append(call.op(*args, **call.kwargs))
    return results[-1]
