"""The CUDA backend: Cuvil's own Triton kernels for the fused row-wise ops (RMSNorm, LayerNorm,
RoPE), attention (flash attention with masks, causal, GQA) and the epilogues of GEMMs and
convolutions (bias, activation, residual; SwiGLU's gate), compiled ahead of time for one GPU
architecture on any machine (no GPU, no driver), with the heavy ops (GEMMs, convolutions)
through ATen.

``codegen`` writes the kernels layer (codegen.py): a cubin, PTX, the template's source and a
JSON manifest per kernel, and ``manifest.json`` saying what runs each fused node — a kernel, or
ATen and why. ``load_kernels`` reads it back into the plan's factories. What runs them depends
on the machine (``CUVIL_CUDA_EXECUTOR``: ``auto``, the default, ``gpu`` or ``interpreter``):
- with a CUDA device (``auto`` or ``gpu``), the plan runs on it: each kernel launched through
  the driver API in the image the GPU takes (gpu.py, images.py; an artifact none of whose images
  runs there is refused naming both architectures), ATen's cuBLAS and cuDNN for the rest, and
  one CUDA graph per input shape (graphs.py), captured by ``prepare``;
- without one (or with ``interpreter``), the CPU runs it: Triton's interpreter on CPU tensors
  (interpreter.py) with ATen on the CPU for the rest, which is how a CUDA artifact is verified
  against eager on the machine that compiled it; that proves its numbers, not its speed.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from cuvil import fused_ops as fused
from cuvil.backends.base import Lowering, TargetUnavailableError
from cuvil.backends.kv_cache import KV_CACHE_KERNELS
from cuvil.runtime.kernels import FusedCall, KernelFactory, PreparedKernel
from cuvil.targets import CUDA_ARCHES, Target

if TYPE_CHECKING:
    from cuvil.ir import Graph
    from cuvil.runtime.model import CompiledModel
    from cuvil.runtime.plan import PlanRunner

EPILOGUES = frozenset({"add_act", "act", "add", "plain"})
LOWERING = Lowering(
    # every epilogue shape is one pass over the GEMM's output (templates.bias_act_residual)
    conv_epilogues=EPILOGUES,
    linear_epilogues=EPILOGUES,
    # NCHW: cuDNN takes either layout, and the transposes at the borders would be extra kernels
    channels_last=False,
    sibling_linears=False,  # a merged GEMM's outputs are strided slices the templates copy
    precisions=("fp32", "bf16", "fp16", "tf32"),
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
EXECUTORS = {
    "gpu": "gpu: Cuvil's kernels through the CUDA driver, cuBLAS/cuDNN through ATen, CUDA graphs "
    "per input shape",
    "interpreter": "interpreter: Triton's interpreter on CPU tensors, ATen on the CPU for the rest",
}
EXECUTOR_SETTING = "CUVIL_CUDA_EXECUTOR"
INTERPRETED = (
    "verified on CPU by interpretation: Cuvil's kernels through Triton's interpreter, the "
    "other ops through ATen on the CPU, against eager fp32; speed not measured (no GPU)"
)


def machine_executor() -> str:
    """``gpu`` or ``interpreter``, from ``CUVIL_CUDA_EXECUTOR`` and whether a GPU is visible."""
    setting = os.environ.get(EXECUTOR_SETTING, "auto")
    if setting not in ("auto", *EXECUTORS):
        raise ValueError(f"{EXECUTOR_SETTING}={setting!r}: choose auto, gpu or interpreter")
    if setting == "interpreter":
        return "interpreter"
    if torch.cuda.is_available():
        return "gpu"
    if setting == "gpu":
        raise TargetUnavailableError(f"{EXECUTOR_SETTING}=gpu, but no CUDA device is visible")
    return "interpreter"


def _needs_layer(call: FusedCall) -> PreparedKernel:
    raise ValueError(f"{call.op} runs from the artifact's kernels layer, and it has none")


class CudaBackend:
    # the KV-cache ops of generation run through ATen on any device (backends/kv_cache.py)
    kernels: Mapping[str, KernelFactory] = {
        **{op: _needs_layer for op in TEMPLATED},
        **KV_CACHE_KERNELS,
    }
    fallbacks: Mapping[str, str] = FALLBACKS
    lowering = LOWERING

    def __init__(self, target: Target) -> None:
        self.target = target
        major, minor = target.compute_capability or (0, 0)
        self.compute_capability = 10 * major + minor  # 0 for the bare family name
        self.executor = machine_executor()
        # Speed means something only on a GPU of the target's own architecture: the worker
        # then times the plan there against eager; elsewhere its speed gates are deferred.
        self.speed_measured = False
        if self.executor == "gpu":
            from cuvil.backends.cuda.gpu import device_capability

            self.device = torch.device("cuda", torch.cuda.current_device())
            self.speed_measured = device_capability(self.device) == self.compute_capability
            self.verified_by = (
                f"verified on the GPU ({torch.cuda.get_device_name(self.device)}): Cuvil's "
                "kernels and cuBLAS/cuDNN, against eager fp32 on the CPU"
            )
        else:
            self.device = torch.device("cpu")
            self.verified_by = INTERPRETED

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

        if self.executor == "interpreter":
            return layer_factories(files, self.target.name)
        from cuvil.backends.cuda.gpu import load_gpu_kernels

        return layer_factories(
            files,
            self.target.name,
            lambda manifests, data: dict(load_gpu_kernels(manifests, data, self.device)),
        )

    def runner(self, model: CompiledModel) -> PlanRunner:
        """On a GPU, the plan through CUDA graphs per input shape (graphs.py), with TF32 only
        where the model was compiled at precision tf32."""
        if self.executor == "interpreter":
            return model.plan
        from cuvil.backends.cuda.graphs import GraphedPlan

        return GraphedPlan(model.plan, allow_tf32=model.config.get("precision") == "tf32")

    def prepare(self, model: CompiledModel, inputs: Mapping[str, torch.Tensor]) -> int:
        """On a GPU: capture this shape's CUDA graph (after two warm-up runs). The interpreter
        has no per-shape choices: one run checks the plan at this shape."""
        from cuvil.backends.cuda.graphs import GraphedPlan

        if not isinstance(model.runner, GraphedPlan):
            model.run(inputs)
            return 1
        placed = {name: tensor.to(model.device) for name, tensor in inputs.items()}
        model.runner.try_capture(placed, model.bind(placed))
        return 3

    def choose_kernels(
        self, model: CompiledModel, inputs: Mapping[str, torch.Tensor]
    ) -> dict[str, Any]:
        """The kernels layer fixes every kernel at codegen: nothing is left to choose."""
        return {}

    def describe(self, model: CompiledModel) -> dict[str, Any]:
        """The architecture the cubins are for, what runs each fused node (a kernel of the
        layer, or ATen and why) and what executes the plan on this machine."""
        from cuvil.artifact.kernels_layer import unpack_kernels

        files = unpack_kernels(model.contents.kernels)
        manifest = json.loads(files["manifest.json"]) if "manifest.json" in files else {}
        described = {
            "backend": "cuda",
            "arch": manifest.get("arch"),
            "executor": EXECUTORS[self.executor],
            "verified_by": self.verified_by,
            "kernels": manifest.get("kernels", []),
            "nodes": manifest.get("nodes", {}),
        }
        from cuvil.backends.cuda.graphs import GraphedPlan

        if isinstance(model.runner, GraphedPlan):
            described["device"] = torch.cuda.get_device_name(model.device)
            described["cuda_graphs"] = [str(key) for key in model.runner.shapes]
            described["uncaptured"] = {str(k): v for k, v in model.runner.uncaptured.items()}
        return described
