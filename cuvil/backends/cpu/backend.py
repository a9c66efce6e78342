"""The CPU backend: oneDNN primitives kept across calls, MKL GEMMs and Cuvil's C kernels, each
op's path chosen on the machine that runs it (tactics.py).

Its kernels are built when a model is loaded, on the machine that serves it (primitives and
packed weights depend on the CPU), so it writes no kernels layer into the artifact; preparing
a model for a shape runs it until every per-shape choice its kernels make is settled. The
compiler settles the example shapes' choices and the artifact carries them per CPU family
(kernel_choices.py), so a load on a CPU of that family runs them from its first call.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from cuvil.backends.base import Lowering
from cuvil.backends.cpu import kernel_choices, linear_kernels
from cuvil.backends.cpu.dnnl import describe as describe_dnnl
from cuvil.backends.cpu.int8_weights import describe_int8
from cuvil.backends.cpu.kernels import CPU_KERNELS
from cuvil.backends.cpu.linear_kernels import compute_precision
from cuvil.backends.cpu.native import describe as describe_native
from cuvil.backends.cpu.native_plan import NativePlanRunner
from cuvil.backends.cpu.tactics import trial_length
from cuvil.runtime.kernels import KernelFactory
from cuvil.runtime.plan import PlanRunner
from cuvil.targets import Target

if TYPE_CHECKING:
    from cuvil.ir import Graph
    from cuvil.runtime.model import CompiledModel

SETTLE_RUNS = trial_length(3) + 1  # up to three candidates

LOWERING = Lowering(
    conv_epilogues=frozenset({"add_act", "act", "add", "plain"}),
    # oneDNN's inner product takes an activation or a residual add as its post-op, not both
    linear_epilogues=frozenset({"act", "add", "plain"}),
    channels_last=True,  # oneDNN's convolutions run NHWC
    sibling_linears=True,  # one wider GEMM beats several narrow ones on a few cores
    precisions=("fp32", "bf16", "int8"),
    low_activations=True,  # oneDNN's bf16 convolutions and inner products read and write bf16
)
# a CPU without bf16 GEMMs widens bf16 weights once at load: bf16 values between its fp32
# GEMMs would only add a cast around each of them
FP32_ACTIVATIONS = replace(LOWERING, low_activations=False)


class CpuBackend:
    kernels: Mapping[str, KernelFactory] = CPU_KERNELS
    fallbacks: Mapping[str, str] = {}
    verified_by = "run on this machine's CPU, against eager fp32"
    speed_measured = True

    def __init__(self, target: Target) -> None:
        self.target = target
        self.device = torch.device("cpu")

    @property
    def lowering(self) -> Lowering:
        """bf16 values between the GEMM-like ops of a bf16 compile where the target's GEMMs
        compute bf16. A named target (``cpu-x86_64``, ``cpu-x86_64-amx``) is a fleet the
        artifact may reach on CPUs with bf16 instructions: its values stay bf16 (CPUs without
        them widen at each GEMM). The family alone (``cpu``, ``cuvil.jit``'s default) is the
        compiling machine's own CPU: without bf16 GEMMs there, values stay fp32 between them."""
        if not self.target.variant and not linear_kernels.has_onednn_bf16():
            return FP32_ACTIVATIONS
        return LOWERING

    def check_compile(self) -> None:
        """Any machine compiles for the CPU."""

    def codegen(self, graph: Graph, weights: Mapping[str, torch.Tensor]) -> dict[str, bytes]:
        return {}

    def load_kernels(self, files: Mapping[str, bytes]) -> Mapping[str, KernelFactory]:
        return {}

    def runner(self, model: CompiledModel) -> PlanRunner:
        """The plan run as native schedules once a shape is settled (native_plan.py),
        running the kernel choices the artifact carries for this CPU family."""
        kernel_choices.take_carried(model)
        return NativePlanRunner(model.plan)

    def prepare(self, model: CompiledModel, inputs: Mapping[str, torch.Tensor]) -> int:
        """Run these inputs until every kernel choice they meet is made: from then on, calls at
        this shape give bit-identical results, and run as native schedules where the plan loop
        is built (one more run records them if the last choice was made on the last run).
        Returns the runs made."""
        runs = _settle(model, inputs)
        runner = model.runner
        if isinstance(runner, NativePlanRunner):
            symbols = model.bind(inputs)
            for _ in range(SETTLE_RUNS):  # a choice made on the last run: record a later one
                if runner.has_shape(symbols) or runner.full:
                    break
                model.run(inputs)
                runs += 1
        return runs

    def choose_kernels(
        self, model: CompiledModel, inputs: Mapping[str, torch.Tensor]
    ) -> dict[str, Any]:
        """Settle the choices the example shapes meet, kept per CPU family (kernel_choices.py)."""
        return kernel_choices.choose_at_compile(model, inputs, self.prepare)

    def describe(self, model: CompiledModel) -> dict[str, Any]:
        """The weights' precision and the one the GEMMs compute in (a bf16 or int8 artifact
        runs fp32 GEMMs on a CPU without bf16 instructions), where int8 weights are read as
        int8, the precision values pass between the GEMMs in (``activations``), the path each
        kernel with a choice took, which oneDNN the convolutions and linears call, and whether
        Cuvil's native kernels are offered; which of the choices came from the artifact (made
        at compile time on this CPU family)."""
        dtypes = {tensor.dtype for tensor in model.contents.weights.values()}
        weights = "int8" if torch.int8 in dtypes else "bf16" if torch.bfloat16 in dtypes else "fp32"
        return {
            "backend": "cpu",
            "weights": weights,
            "gemm_compute": compute_precision(torch.bfloat16) if weights != "fp32" else "fp32",
            "int8_gemm": describe_int8() if weights == "int8" else None,
            "activations": _activations(model.graph),
            "tactics": model.plan.kernel_choices(),
            "cpu_family": kernel_choices.cpu_family(),
            "tactics_from_artifact": kernel_choices.from_artifact(model),
            "onednn": describe_dnnl(),
            "winograd": describe_native("winograd"),
            "rowwise": describe_native("rowwise"),
            "pooling": describe_native("pooling"),
            "plan_loop": _describe_runner(model.runner),
        }


def _activations(graph: Graph) -> str:
    """The dtype values pass between the GEMM-like ops in (passes/low_activations.py)."""
    for node in graph.nodes:
        if node.op not in ("const", "input") and any(t.dtype == "bf16" for t in node.types):
            return "bf16"
    return "fp32"


def _settle(model: CompiledModel, inputs: Mapping[str, torch.Tensor]) -> int:
    before = model.plan.kernel_trials()
    for runs in range(1, SETTLE_RUNS + 1):
        model.run(inputs)
        after = model.plan.kernel_trials()
        if not any(before.get(key) != calls for key, calls in after.items()):
            return runs  # no choice this shape meets is still open
        before = after
    return SETTLE_RUNS


def _describe_runner(runner: PlanRunner) -> dict[str, Any]:
    if isinstance(runner, NativePlanRunner):
        return runner.describe()
    return {"status": "Python plan"}
