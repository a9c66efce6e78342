"""The CUDA backend's codegen stage: every kernel a graph needs, compiled ahead of time for the
target's GPU architecture on this machine (no GPU, no driver), into the kernels layer.

Each fused node gets a ``KernelSpec`` (specs.py) or a reason it runs through ATen. Equal specs
compile once. The compile runs in a subprocess (compile_worker.py) with its environment pinned:
``TRITON_DEFAULT_FP_FUSION=1`` (FMA contraction changes numerics and the kernel hash, and its
default is changing), no line info (the cubin carries no debug PTX), a fresh cache folder, and
per architecture the PTX ISA version a CUDA 12.x/13.0 driver accepts (Triton 3.9 emits PTX 9.4
for sm_90a, which a CUDA 13.0 driver cannot JIT; 9.0 it can).

Every kernel compiled with divisibility hints also compiles without them (``<name>_generic``,
its manifest's ``generic``): the variant a call that breaks a hint runs. The layer holds, per
kernel, ``<name>.<arch>.cubin``, ``<name>.<ptx arch>.ptx`` (the fallback
the driver JIT-compiles on a GPU no cubin fits: from the target's own architecture, or the
newest non-arch-specific one below sm_90a, whose PTX runs nowhere else), ``<name>.py`` (the
template's source) and ``<name>.json`` (its manifest), plus ``manifest.json`` naming what runs
each fused node.
Before anything is written, every cubin is read back (cubin.py): its ELF architecture must be
the target's, its kernel symbol present, its parameter table the spec's parameters plus
Triton's two trailing scratch pointers, its shared memory within the architecture's limit, and
no registers spilled to local memory (``cuobjdump -res-usage``: a spilling kernel is slow enough
to be a bug in its specialisation); the PTX's entry must take the same parameters (ptx.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from hashlib import sha256
from pathlib import Path
from typing import Any

import torch

from cuvil import fused_ops as fused
from cuvil.backends.cuda.cubin import CubinError, read_cubin
from cuvil.backends.cuda.layer import LAYER_FORMAT
from cuvil.backends.cuda.ptx import PtxError, check_entry
from cuvil.backends.cuda.specs import (
    KernelSpec,
    attention_spec,
    epilogue_spec,
    layer_norm_spec,
    rms_norm_spec,
    rope_spec,
    swiglu_spec,
)
from cuvil.dtypes import dtype_name
from cuvil.ir import Graph, Node, Value

PINNED_ENVIRONMENT = {"TRITON_DEFAULT_FP_FUSION": "1", "TRITON_DISABLE_LINE_INFO": "1"}
# Compute capability -> the PTX ISA version asked of Triton (see the module docstring).
PTX_VERSIONS = {80: 88, 86: 88, 87: 88, 89: 88, 90: 90}
# Compute capability -> the one whose PTX the layer keeps as the fallback: its own where the
# cubin is not arch-specific; for sm_90a the newest one below it that is.
PTX_ARCHES = {80: 80, 86: 86, 87: 87, 89: 89, 90: 89}
# Dynamic shared memory a block may opt into, per compute capability (bytes).
SHARED_LIMITS = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448}
PARAM_SIZES = {"i1": 1, "i8": 1, "i16": 2, "i32": 4, "i64": 8, "fp16": 2, "bf16": 2, "fp32": 4}
COMPILE_TIMEOUT_S = 600


class CodegenError(RuntimeError):
    """A kernel failed to compile, or its cubin is not what its spec asks for."""


@dataclass
class KernelPlan:
    """What codegen decided for a graph: the distinct kernels, and per fused node either the
    kernel that runs it or why ATen does."""

    kernels: dict[str, KernelSpec] = field(default_factory=dict)
    nodes: dict[str, dict[str, str]] = field(default_factory=dict)


def _weight_dtype(graph: Graph, weights: Mapping[str, torch.Tensor], arg: object) -> str | None:
    if not isinstance(arg, Value):
        return None
    node = graph.node(arg.node)
    if node.op == "const":
        return dtype_name(weights[str(node.arg("key"))].dtype)
    return graph.type_of(arg).dtype


def _spec_for(
    graph: Graph, node: Node, weights: Mapping[str, torch.Tensor]
) -> KernelSpec | str | None:
    """The node's kernel, the reason it has none, or None for an op that is all fallback."""
    dtype = lambda key: _weight_dtype(graph, weights, node.arg(key))  # noqa: E731
    if node.op == fused.RMS_NORM:
        return rms_norm_spec(graph, node, dtype("weight") or "f32")
    if node.op == fused.LAYER_NORM:
        return layer_norm_spec(graph, node, dtype("weight"), dtype("bias"))
    if node.op == fused.ATTENTION:
        return attention_spec(graph, node)
    if node.op == fused.SWIGLU:
        return swiglu_spec(graph, node, dtype("gate_up_weight") or "f32")
    if node.op == fused.ROPE:
        return rope_spec(graph, node)
    if node.op in (fused.LINEAR, fused.CONV2D):
        return epilogue_spec(graph, node, dtype("weight") or "f32", dtype("bias"))
    return None


def plan_kernels(
    graph: Graph, weights: Mapping[str, torch.Tensor], fallbacks: Mapping[str, str]
) -> KernelPlan:
    plan = KernelPlan()
    for node in graph.nodes:
        if not node.op.startswith("cuvil."):
            continue
        found = _spec_for(graph, node, weights)
        if isinstance(found, KernelSpec):
            plan.kernels[found.name] = found
            plan.nodes[node.name] = {"op": node.op, "kernel": found.name}
        else:
            reason = found or fallbacks.get(node.op, "no kernel template")
            plan.nodes[node.name] = {"op": node.op, "aten": reason}
    return plan


def run_compiler(
    specs: Iterable[KernelSpec], compute_capability: int, out: Path
) -> tuple[dict[str, str], dict[str, dict[str, Any]]]:
    """Compile in a subprocess; (compiler versions, kernel name -> its result)."""
    ptx_arch = PTX_ARCHES[compute_capability]
    request = {
        "arch": compute_capability,
        "options": {"ptx_version": PTX_VERSIONS[compute_capability]},
        "ptx_arch": ptx_arch,
        "ptx_options": {"ptx_version": PTX_VERSIONS[ptx_arch]},
        "kernels": [spec.to_json() for spec in specs],
    }
    environment = {
        **os.environ,
        **PINNED_ENVIRONMENT,
        "TRITON_CACHE_DIR": str(out / "triton-cache"),
    }
    environment.pop("TRITON_INTERPRET", None)
    done = subprocess.run(
        [sys.executable, "-m", "cuvil.backends.cuda.compile_worker", str(out)],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        env=environment,
        timeout=COMPILE_TIMEOUT_S,
    )
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise CodegenError(
            f"the Triton compile for sm_{compute_capability} exited {done.returncode}: "
            f"{done.stderr.strip()[-2000:]}"
        )
    versions, results = lines[0], {line["name"]: line for line in lines[1:]}
    failed = {name: r["error"] for name, r in results.items() if "error" in r}
    if failed:
        raise CodegenError(f"kernels failed to compile for sm_{compute_capability}: {failed}")
    return versions, results


def check_resources(spec: KernelSpec, resources: dict[str, int]) -> None:
    if resources["stack"] or resources["local"]:
        raise CodegenError(
            f"{spec.name}: spills registers ({resources['local']} B local, "
            f"{resources['stack']} B stack per thread at {resources['registers']} registers)"
        )


def check_cubin(
    spec: KernelSpec, cubin: bytes, symbol: str, arch: str, shared: int, cc: int
) -> dict[str, Any]:
    """The cubin's own view of the kernel, refused unless it matches the spec and the target."""
    try:
        info = read_cubin(cubin)
    except CubinError as error:
        raise CodegenError(f"{spec.name}: {error}") from None
    if info.arch != arch:
        raise CodegenError(f"{spec.name}: the cubin is for {info.arch}, the target is {arch}")
    params = info.kernels.get(symbol)
    if params is None:
        raise CodegenError(f"{spec.name}: the cubin has no kernel {symbol!r}")
    expected = [8 if kind.startswith("*") else PARAM_SIZES[kind] for _, kind in spec.runtime_params]
    if [param.size for param in params] != expected:
        raise CodegenError(
            f"{spec.name}: the cubin's parameters are {[p.size for p in params]} bytes, "
            f"the spec's {expected}"
        )
    if shared > SHARED_LIMITS[cc]:
        raise CodegenError(
            f"{spec.name}: {shared} B of shared memory, sm_{cc} has {SHARED_LIMITS[cc]}"
        )
    return {"abi_version": info.abi_version, "offsets": [param.offset for param in params]}


def target_arch(compute_capability: int) -> str:
    """The architecture Triton builds: arch-specific (``sm_90a``) from 9.0 on."""
    return f"sm_{compute_capability}{'a' if compute_capability >= 90 else ''}"


def kernel_manifest(
    spec: KernelSpec,
    result: dict[str, Any],
    checked: dict[str, Any],
    arch: str,
    versions: dict[str, str],
    cubin: bytes,
    source: str,
    ptx: bytes,
) -> dict[str, Any]:
    launch = result["launch"]
    ptx_arch = PTX_ARCHES[int(arch[3:5])]
    return {
        "name": spec.name,
        "template": spec.template,
        "symbol": result["symbol"],
        "arch": arch,
        "params": [
            {"name": name, "type": kind, "offset": offset}
            for (name, kind), offset in zip(spec.runtime_params, checked["offsets"], strict=True)
        ],
        "constexprs": spec.constexprs,
        "guards": {"div16": list(spec.div16), "contiguous_rows": True},
        "grid": spec.grid,
        "block": [32 * int(launch["num_warps"]), 1, 1],
        "num_warps": launch["num_warps"],
        "num_stages": launch["num_stages"],
        "shared": launch["shared"],
        "resources": result["resources"],
        "launch": launch,
        "cubin": f"{spec.name}.{arch}.cubin",
        "cubin_sha256": sha256(cubin).hexdigest(),
        "elf_abi_version": checked["abi_version"],
        "ptx": f"{spec.name}.sm_{ptx_arch}.ptx",
        "ptx_arch": f"sm_{ptx_arch}",
        "ptx_symbol": result["ptx_symbol"],
        "ptx_version": result["ptx_version"],
        "ptx_shared": result["ptx_shared"],
        "ptx_sha256": sha256(ptx).hexdigest(),
        "source": f"{spec.name}.py",
        "source_sha256": sha256(source.encode()).hexdigest(),
        "compiler": {**versions, **{k.lower(): v for k, v in PINNED_ENVIRONMENT.items()}},
        "spec": spec.to_json(),
    }


def generate_layer(
    graph: Graph,
    weights: Mapping[str, torch.Tensor],
    compute_capability: int,
    fallbacks: Mapping[str, str],
    target: str,
) -> tuple[dict[str, bytes], dict[str, float]]:
    """The kernels layer's files, and the compile seconds per kernel (for reports). Triton
    is imported only by the compile subprocess, which also reports each template's source."""
    plan = plan_kernels(graph, weights, fallbacks)
    if not plan.nodes:
        return {}, {}
    arch = target_arch(compute_capability)
    files: dict[str, bytes] = {}
    seconds: dict[str, float] = {}
    manifests: dict[str, dict[str, Any]] = {}
    versions: dict[str, str] = {}
    generics = {spec.name: spec.generic() for spec in plan.kernels.values() if spec.div16}
    every = {**plan.kernels, **{g.name: g for g in generics.values()}}
    if every:
        with tempfile.TemporaryDirectory(prefix="cuvil-cuda-") as folder:
            versions, results = run_compiler(every.values(), compute_capability, Path(folder))
            for name, spec in sorted(every.items()):
                result = results[name]
                cubin = (Path(folder) / f"{name}.cubin").read_bytes()
                source = str(result["source"])
                checked = check_cubin(
                    spec,
                    cubin,
                    result["symbol"],
                    arch,
                    int(result["launch"]["shared"]),
                    compute_capability,
                )
                check_resources(spec, result["resources"])
                ptx = (Path(folder) / f"{name}.ptx").read_bytes()
                manifest = kernel_manifest(
                    spec, result, checked, arch, versions, cubin, source, ptx
                )
                if name in generics:
                    manifest["generic"] = generics[name].name
                try:
                    check_entry(ptx.decode(), manifest["ptx_symbol"], manifest)
                except PtxError as error:
                    raise CodegenError(str(error)) from None
                files[manifest["cubin"]] = cubin
                files[manifest["ptx"]] = ptx
                files[manifest["source"]] = source.encode()
                files[f"{name}.json"] = json.dumps(manifest, indent=1, sort_keys=True).encode()
                manifests[name] = manifest
                seconds[name] = float(result["compile_seconds"])
    top = {
        "format": LAYER_FORMAT,
        "target": target,
        "arch": arch,
        "compiler": versions,
        "kernels": sorted(manifests),
        "nodes": plan.nodes,
    }
    files["manifest.json"] = json.dumps(top, indent=1, sort_keys=True).encode()
    return files, seconds
