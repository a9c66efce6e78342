"""The CUDA backend's compile side on this machine (no GPU): per bundled model and architecture,
the compile's stage seconds, each kernel's compile seconds and cubin size, and the verification
error of the CPU interpretation against eager. Prints one JSON document.

    .venv/bin/python benchmarks/cuda_codegen.py [--archs sm_80,sm_90] [--models mlp,minilm,...]

Speed on a GPU is not measured here: there is none.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from typing import Any

import torch

import cuvil
from cuvil.artifact.kernels_layer import unpack_kernels
from cuvil.backends.cuda.backend import FALLBACKS
from cuvil.backends.cuda.codegen import generate_layer
from cuvil.models import catalog


def measure(name: str, arch: str) -> dict[str, Any]:
    spec = getattr(catalog, name)()
    compiled = cuvil.jit(
        spec.model, spec.example_inputs, dynamic_shapes=spec.dynamic_shapes, target=f"cuda-{arch}"
    )
    files, seconds = generate_layer(  # again, for the per-kernel seconds the stage does not keep
        compiled.graph, compiled.contents.weights, int(arch[3:]), FALLBACKS, f"cuda-{arch}"
    )
    layer = unpack_kernels(compiled.contents.kernels)
    top = json.loads(layer["manifest.json"])
    kernels = {}
    for kernel in top["kernels"]:
        manifest = json.loads(layer[f"{kernel}.json"])
        kernels[kernel] = {
            "compile_seconds": seconds[kernel],
            "cubin_bytes": len(layer[manifest["cubin"]]),
            "num_warps": manifest["num_warps"],
            "shared": manifest["shared"],
        }
    nodes = top["nodes"].values()
    return {
        "model": name,
        "arch": top["arch"],
        "stages": {stage["name"]: stage["seconds"] for stage in compiled.report["stages"]},
        "verification": compiled.report["verification"]["max_relative_to_scale"],
        "kernels": kernels,
        "nodes_on_kernels": sum("kernel" in entry for entry in nodes),
        "nodes_on_aten": sum("aten" in entry for entry in nodes),
        "layer_bytes": sum(len(data) for data in files.values()),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archs", default="sm_80,sm_90")
    parser.add_argument("--models", default="mlp,tiny_llama,minilm,resnet18")
    args = parser.parse_args()
    runs = []
    for name in args.models.split(","):
        for arch in args.archs.split(","):
            print(f"{name} {arch}", file=sys.stderr)
            runs.append(measure(name, arch))
    document = {
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": torch.get_num_threads(),
        "runs": runs,
    }
    print(json.dumps(document, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
