"""The seam every backend implements, and the typed values that cross it.

A backend turns a planned graph into something that runs on one kind of device. What differs
from one target to another lives behind ``Backend``: which fused ops it implements (a factory
per ``cuvil.*`` op of ``cuvil.fused_ops``), the lowering choices the pass pipeline makes for it
(``Lowering``), the artifact's kernels layer it writes at compile time (``codegen``) and reads
back at load (``load_kernels``), what runs the plan's calls (``runner``), how a loaded model is
prepared for a shape before it serves (``prepare``), which kernel choices it makes at compile
time and carries in the artifact (``choose_kernels``), and what it reports about what runs
(``describe``). The generic runtime (``cuvil.runtime``) asks a backend, never a device type.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from cuvil.targets import Target

if TYPE_CHECKING:  # annotations only: the seam itself imports no torch (compile_worker.py)
    import torch

    from cuvil.ir import Graph
    from cuvil.runtime.kernels import KernelFactory
    from cuvil.runtime.model import CompiledModel
    from cuvil.runtime.plan import PlanRunner


@dataclass(frozen=True)
class Lowering:
    """The target-dependent part of the pass pipeline, as data: what the backend's kernels take.
    Epilogue shapes: ``add_act`` (activation of layer + residual), ``act``, ``add``, ``plain``."""

    conv_epilogues: frozenset[str]  # the epilogue shapes a fused convolution takes
    linear_epilogues: frozenset[str]  # … and a fused linear
    channels_last: bool  # run convolution chains channels-last (transposes at the borders)
    sibling_linears: bool  # linears reading one input merged into one GEMM
    precisions: tuple[str, ...]  # the precisions it compiles
    # bf16 values kept between its bf16 GEMM-like ops (passes/low_activations.py)
    low_activations: bool = False


class Backend(Protocol):
    """One kind of device. Instances are made by ``cuvil.backends.backend_for(target)``."""

    target: Target
    device: torch.device
    # fused op -> factory; also ATen ops the backend runs with its own kernel (CPU max-pool)
    kernels: Mapping[str, KernelFactory]
    fallbacks: Mapping[str, str]  # fused op without a kernel of its own -> why, and what runs it

    @property
    def lowering(self) -> Lowering:
        """The choices the pass pipeline makes for this target."""
        ...

    verified_by: str  # how the compiler's verify stage ran this target's plan (for the report)
    speed_measured: bool  # whether timing its plan here measures the target's own speed

    def check_compile(self) -> None:
        """Raise ``TargetUnavailableError`` when this machine cannot compile for the target."""
        ...

    def codegen(self, graph: Graph, weights: Mapping[str, torch.Tensor]) -> dict[str, bytes]:
        """The artifact's kernels layer (file name -> bytes), empty when there is none."""
        ...

    def load_kernels(self, files: Mapping[str, bytes]) -> Mapping[str, KernelFactory]:
        """Factories from a kernels layer, for the plan of a loaded model."""
        ...

    def runner(self, model: CompiledModel) -> PlanRunner:
        """What runs a loaded model's calls: its plan, or a wrapper of the backend's."""
        ...

    def prepare(self, model: CompiledModel, inputs: Mapping[str, torch.Tensor]) -> int:
        """Make a loaded model ready to serve inputs of this shape; returns the runs made."""
        ...

    def choose_kernels(
        self, model: CompiledModel, inputs: Mapping[str, torch.Tensor]
    ) -> dict[str, Any]:
        """At compile time, make the per-shape kernel choices the example inputs meet; returns
        the config entries that carry them in the artifact (empty when there are none)."""
        ...

    def describe(self, model: CompiledModel) -> dict[str, Any]:
        """What runs on this machine, for reports (``CompiledModel.execution()``)."""
        ...


class TargetUnavailableError(RuntimeError):
    """The target is valid, but this machine or this build of Cuvil cannot serve it."""
