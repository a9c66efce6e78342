"""Reading the CUDA kernels layer back into the plan: for each fused node, the factory that the
layer's ``manifest.json`` names — a compiled kernel (launched on the GPU, gpu.py, or run by
Triton's interpreter on the CPU, interpreter.py) or the op's ATen implementation.

The layer is checked before it is trusted: its format and target must be this backend's, every
kernel a node names must have its manifest, cubin and PTX, and their digests must match the
manifest. Nothing in the layer is executed: the kernels run from the templates of this Cuvil,
and a manifest whose template source digest differs is refused (interpreter.py).
"""

from __future__ import annotations

import importlib.util
import json
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from hashlib import sha256
from typing import Any

from cuvil import fused_ops as fused
from cuvil.backends.cuda.aten_ops import ATEN_KERNELS
from cuvil.backends.cuda.launches import LAUNCHES, Launcher
from cuvil.runtime.kernels import FusedCall, KernelFactory, PreparedKernel

LAYER_FORMAT = "cuvil.cuda.kernels.v1"


class LayerError(ValueError):
    """A kernels layer this backend cannot run."""


def read_manifests(
    files: Mapping[str, bytes], target: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the layer's manifest, kernel name -> its manifest), checked against the files."""
    if "manifest.json" not in files:
        raise LayerError("the kernels layer has no manifest.json")
    top = json.loads(files["manifest.json"])
    if top.get("format") != LAYER_FORMAT:
        raise LayerError(f"kernels layer format {top.get('format')!r}, expected {LAYER_FORMAT!r}")
    if top.get("target") != target:
        raise LayerError(f"the kernels layer is for {top.get('target')}, not {target}")
    kernels: dict[str, Any] = {}
    for name in top["kernels"]:
        if f"{name}.json" not in files:
            raise LayerError(f"kernel {name}: the layer has no manifest {name}.json")
        manifest = json.loads(files[f"{name}.json"])
        cubin = files.get(manifest["cubin"])
        if cubin is None or sha256(cubin).hexdigest() != manifest["cubin_sha256"]:
            raise LayerError(f"kernel {name}: its cubin is missing or does not match its manifest")
        ptx = files.get(manifest.get("ptx", ""))
        if ptx is None or sha256(ptx).hexdigest() != manifest.get("ptx_sha256"):
            raise LayerError(f"kernel {name}: its PTX is missing or does not match its manifest")
        kernels[name] = manifest
    return top, kernels


class GuardedLauncher:
    """A kernel and its generic variant: the specialised one where the call keeps every
    divisibility guard it was compiled under, the generic one where it breaks one."""

    def __init__(self, specialised: Launcher, generic: Launcher, div16: Iterable[str]) -> None:
        self.specialised, self.generic, self.div16 = specialised, generic, tuple(div16)
        self.calls: Counter[str] = Counter()

    def launch(
        self, grid: tuple[int, ...], args: Mapping[str, Any], reach: Mapping[str, int]
    ) -> None:
        if all(divisible_by_16(args[name]) for name in self.div16):
            self.calls["specialised"] += 1
            self.specialised.launch(grid, args, reach)
        else:
            self.calls["generic"] += 1
            self.generic.launch(grid, args, reach)


def divisible_by_16(value: Any) -> bool:
    """A pointer argument's address (a tensor's data), or an integer's value."""
    number = value.data_ptr() if hasattr(value, "data_ptr") else int(value)
    return number % 16 == 0


def interpreted_kernels(
    manifests: Mapping[str, Mapping[str, Any]], files: Mapping[str, bytes], target: str
) -> dict[str, Launcher]:
    """Every kernel run by Triton's interpreter on the CPU (interpreter.py)."""
    if manifests and importlib.util.find_spec("triton") is None:
        raise LayerError(
            f"this {target} artifact runs its kernels by Triton's interpreter on the CPU, and "
            "Triton is not installed (pip install 'cuvil[cuda]')"
        )
    from cuvil.backends.cuda.interpreter import Interpreted

    return {name: Interpreted(manifest) for name, manifest in manifests.items()}


LoadKernels = Callable[[Mapping[str, Mapping[str, Any]], Mapping[str, bytes]], dict[str, Launcher]]


def layer_factories(
    files: Mapping[str, bytes], target: str, load: LoadKernels | None = None
) -> dict[str, KernelFactory]:
    """Factories for every fused op, each looking its node up in the layer; ``load`` gives the
    launcher of each kernel (default: the interpreter)."""
    top, kernels = read_manifests(files, target)
    nodes: dict[str, dict[str, str]] = top["nodes"]
    if load is None:
        executors = interpreted_kernels(kernels, files, target)
    else:
        executors = load(kernels, files) if kernels else {}

    def factory(call: FusedCall) -> PreparedKernel:
        entry = nodes.get(call.node)
        if entry is None or entry["op"] != call.op:
            raise LayerError(f"the kernels layer says nothing of %{call.node} ({call.op})")
        if "kernel" not in entry:
            return ATEN_KERNELS[call.op](call)
        manifest = kernels[entry["kernel"]]
        launcher = executors[entry["kernel"]]
        if manifest.get("generic") in executors:
            launcher = GuardedLauncher(
                launcher, executors[manifest["generic"]], manifest["guards"]["div16"]
            )
        return LAUNCHES[manifest["template"]](call, manifest, launcher)

    return {op: factory for op in fused.FUSED_OPS}
