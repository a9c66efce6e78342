"""The compile subprocess: ``python -m cuvil.backends.cuda.compile_worker OUT_DIR`` reads a JSON
request on stdin (``arch``, ``options``, ``ptx_arch``, ``ptx_options``, ``kernels``: KernelSpec
JSON), compiles each kernel with ``triton.compile`` for that architecture, writes
``OUT_DIR/<name>.cubin`` and ``OUT_DIR/<name>.ptx`` (the PTX of ``ptx_arch``: the same compile's
where the architectures agree, a second compile where the cubin's is arch-specific, sm_90a),
and prints one JSON line per kernel (its symbol, launch metadata, registers and spills,
template source, compile seconds) or a failure.

It runs apart from the compiler because LLVM aborts the whole process on some bad options (a
PTX version the target does not take), and Triton never needs a driver here: the target is
given, so nothing asks for a GPU. It imports Triton, the templates and the specs, never torch:
its start-up is most of what a compile's codegen stage costs. The environment that pins
numerics and output (fp-fusion, line info, the cache folder) is set by the parent (codegen.py).
"""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia import compiler as nvidia
from triton.compiler import ASTSource

from cuvil.backends.cuda.specs import KernelSpec
from cuvil.backends.cuda.templates import TEMPLATES, template_source

DIVISIBLE = [["tt.divisibility", 16]]
# Launch metadata a manifest keeps from Triton's (all of it is plain JSON there).
LAUNCH_FIELDS = (
    "num_warps",
    "num_ctas",
    "num_stages",
    "shared",
    "global_scratch_size",
    "global_scratch_align",
    "profile_scratch_size",
    "profile_scratch_align",
    "launch_cooperative_grid",
    "launch_pdl",
    "ptx_version",
    "enable_fp_fusion",
)


# ptxas release -> the newest PTX ISA it assembles (CUDA's release notes)
PTXAS_PTX = {
    (12, 0): 80, (12, 1): 81, (12, 2): 82, (12, 3): 83, (12, 4): 84, (12, 5): 85, (12, 6): 85,
    (12, 8): 87, (12, 9): 88,
}  # fmt: skip


def ptx_cap(ptxas: str) -> int:
    """The newest PTX version this ptxas takes: a Triton whose bundled ptxas is older than the
    one Cuvil pins options for (Triton 3.6 ships ptxas 12.8, PTX 8.7) gets its newest."""
    major, minor = (int(part) for part in ptxas.split(".")[:2])
    if major >= 13:
        return 90
    return PTXAS_PTX.get((major, minor), 80)


def capped(options: dict[str, Any], ptxas: str) -> dict[str, Any]:
    if "ptx_version" not in options:
        return options
    return {**options, "ptx_version": min(int(options["ptx_version"]), ptx_cap(ptxas))}


@functools.cache
def ptxas_version(arch: int) -> str:
    """``13.4`` for the ptxas Triton runs for this architecture."""
    tool = nvidia.get_ptxas(arch).path
    text = subprocess.check_output([tool, "--version"], text=True)
    release = text.rsplit("release ", 1)[-1]
    return release.split(",", 1)[0].strip()


def resource_usage(cubin: Path, symbol: str) -> dict[str, int]:
    """Registers, stack and local memory (spills) per thread, from ``cuobjdump -res-usage``
    (bundled with Triton, runs without a GPU)."""
    text = subprocess.check_output(
        [knobs.nvidia.cuobjdump.path, "-res-usage", str(cubin)], text=True
    )
    found = re.search(
        rf"Function {re.escape(symbol)}:\s*REG:(\d+) STACK:(\d+) \S+ LOCAL:(\d+)", text
    )
    if found is None:
        raise RuntimeError(f"cuobjdump reports no resources for {symbol}: {text[-500:]}")
    registers, stack, local = (int(group) for group in found.groups())
    return {"registers": registers, "stack": stack, "local": local}


def _compile(spec: KernelSpec, arch: int, options: dict[str, Any]) -> Any:
    function = triton.jit(TEMPLATES[spec.template])
    names = [name for name, _ in spec.params]
    signature = dict(spec.params)
    attrs = {(names.index(name),): DIVISIBLE for name in spec.div16}
    source = ASTSource(function, signature, dict(spec.constexprs), attrs)
    return triton.compile(
        source,
        target=GPUTarget("cuda", arch, 32),
        options={**options, "num_warps": spec.num_warps, "num_stages": spec.num_stages},
    )


def compile_one(spec: KernelSpec, request: dict[str, Any], out: Path) -> dict[str, Any]:
    arch, ptx_arch = int(request["arch"]), int(request["ptx_arch"])
    start = time.perf_counter()
    compiled = _compile(spec, arch, capped(request["options"], ptxas_version(arch)))
    fallback = compiled
    if ptx_arch != arch:
        fallback = _compile(spec, ptx_arch, capped(request["ptx_options"], ptxas_version(ptx_arch)))
    seconds = time.perf_counter() - start
    path = out / f"{spec.name}.cubin"
    path.write_bytes(compiled.asm["cubin"])
    (out / f"{spec.name}.ptx").write_text(fallback.asm["ptx"])
    metadata = compiled.metadata._asdict()
    return {
        "name": spec.name,
        "symbol": compiled.name,
        "ptx_symbol": fallback.name,
        "ptx_version": fallback.metadata.ptx_version,
        "ptx_shared": fallback.metadata.shared,
        "resources": resource_usage(path, compiled.name),
        "launch": {key: metadata.get(key) for key in LAUNCH_FIELDS},
        "source": template_source(spec.template),
        "compile_seconds": round(seconds, 4),
    }


def main() -> int:
    out = Path(sys.argv[1])
    request = json.load(sys.stdin)
    arch = int(request["arch"])
    print(json.dumps({"triton": triton.__version__, "ptxas": ptxas_version(arch)}), flush=True)
    for data in request["kernels"]:
        spec = KernelSpec.from_json(data)
        try:
            result = compile_one(spec, request, out)
        except Exception as error:  # reported to the parent, which refuses the compile
            result = {"name": spec.name, "error": f"{type(error).__name__}: {error}"[:2000]}
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
