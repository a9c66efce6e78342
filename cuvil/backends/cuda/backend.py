"""The CUDA backend: Cuvil's own Triton kernels for the fused row-wise ops (RMSNorm, LayerNorm,
RoPE), attention (flash attention with masks, causal, GQA) and the epilogues of GEMMs and
convolutions (bias, activation, residual; SwiGLU's gate), compiled ahead of time for one GPU
architecture on any machine (no GPU, no driver), with the heavy ops (GEMMs, convolutions)
through ATen.

``codegen`` writes the kernels layer (codegen.py): a cubin, the template's source and a JSON
manifest per kernel, and ``manifest.json`` saying what runs each fused node — a kernel, or ATen
and why. ``load_kernels`` reads it back into the plan's factories. What runs the kernels is the
CPU executor: Triton's interpreter on CPU tensors (interpreter.py) with ATen on the CPU for the
rest, so a CUDA artifact is verified against eager on the machine that compiled it; that
proves its numbers, not its speed. The driver-API launcher for the cubins (driver.py) is not
wired into the plan yet, nor are CUDA graphs per shape bucket: the plan runs on the CPU even
where a GPU is present, and ``describe`` and a warning say so.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from cuvil import fused_ops as fused
from cuvil.backends.base import Lowering, TargetUnavailableError
from cuvil.runtime.kernels import FusedCall, KernelFactory, PreparedKernel
from cuvil.targets import CUDA_ARCHES, Target

if TYPE_CHECKING:
    from cuvil.ir import Graph
    from cuvil.runtime.model import CompiledModel

EPILOGUES = frozenset({"add_act", "act", "add", "plain"})
LOWERING = Lowering(
    # every epilogue shape is one pass over the GEMM's output (templates.bias_act_residual)
    conv_epilogues=EPILOGUES,
    linear_epilogues=EPILOGUES,
    # NCHW: cuDNN takes either layout, and the transposes at the borders would be extra kernels
    channels_last=False,
    sibling_linears=False,  # a merged GEMM's outputs are strided slices the templates copy
    precisions=("fp32", "bf16", "fp16"),
)
TEMPLATED = (
    fused.RMS_NORM,
    fused.LAYER_NORM,
    fused.LINEAR,
    fused.SWIGLU,
    fused.ROPE,
    fused.ATTENTION,
    fused.CONV2D,
)
# Every fused op has a template; what a template does not take runs through ATen (aten_ops.py).
FALLBACKS: dict[str, str] = {}
log = logging.getLogger("cuvil.backends.cuda")
EXECUTOR = "interpreter: Triton's interpreter on CPU tensors, ATen on the CPU for the rest"


def _needs_layer(call: FusedCall) -> PreparedKernel:
    raise ValueError(f"{call.op} runs from the artifact's kernels layer, and it has none")


class CudaBackend:
    kernels: Mapping[str, KernelFactory] = {op: _needs_layer for op in TEMPLATED}
    fallbacks: Mapping[str, str] = FALLBACKS
    lowering = LOWERING
    verified_by = (
        "verified on CPU by interpretation: Cuvil's kernels through Triton's interpreter, the "
        "other ops through ATen on the CPU, against eager fp32; speed not measured (no GPU)"
    )
    speed_measured = False  # the interpreter's time says nothing of a GPU's

    def __init__(self, target: Target) -> None:
        self.target = target
        major, minor = target.compute_capability or (0, 0)
        self.compute_capability = 10 * major + minor  # 0 for the bare family name
        self.device = torch.device("cpu")  # the executor: see the module docstring

    def check_compile(self) -> None:
        """Compiling needs an architecture Cuvil builds for and Triton (the ``cuda`` extra),
        never a GPU."""
        if self.target.variant not in CUDA_ARCHES:
            raise TargetUnavailableError(
                f"target {self.target.name!r}: the CUDA backend compiles for one architecture, "
                f"cuda-<arch> with arch in {list(CUDA_ARCHES)}"
            )
        if importlib.util.find_spec("triton") is None:
            raise TargetUnavailableError(
                f"target {self.target.name}: compiling for CUDA needs Triton "
                "(pip install 'cuvil[cuda]'); no GPU is needed"
            )

    def codegen(self, graph: Graph, weights: Mapping[str, torch.Tensor]) -> dict[str, bytes]:
        from cuvil.backends.cuda.codegen import generate_layer

        files, _ = generate_layer(
            graph, weights, self.compute_capability, FALLBACKS, self.target.name
        )
        return files

    def load_kernels(self, files: Mapping[str, bytes]) -> Mapping[str, KernelFactory]:
        if not files:
            return {}
        from cuvil.backends.cuda.layer import layer_factories

        if torch.cuda.is_available():
            log.warning(
                "%s: the plan runs by interpretation on the CPU; launching its cubins on this "
                "machine's GPU is not built yet",
                self.target.name,
            )
        return layer_factories(files, self.target.name)

    def prepare(self, model: CompiledModel, inputs: Mapping[str, torch.Tensor]) -> int:
        """The interpreter has no per-shape choices: one run checks the plan at this shape."""
        model.run(inputs)
        return 1

    def describe(self, model: CompiledModel) -> dict[str, Any]:
        """The architecture the cubins are for, what runs each fused node (a kernel of the
        layer, or ATen and why) and what executes the plan on this machine."""
        from cuvil.artifact.kernels_layer import unpack_kernels

        files = unpack_kernels(model.contents.kernels)
        manifest = json.loads(files["manifest.json"]) if "manifest.json" in files else {}
        return {
            "backend": "cuda",
            "arch": manifest.get("arch"),
            "executor": EXECUTOR,
            "verified_by": self.verified_by,
            "kernels": manifest.get("kernels", []),
            "nodes": manifest.get("nodes", {}),
        }
