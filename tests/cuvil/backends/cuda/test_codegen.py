"""The CUDA codegen stage on a machine without a GPU: every architecture Cuvil targets compiles,
each cubin's ELF says the target's architecture and its parameter table is the manifest's
(plus Triton's two scratch pointers), the layer is reproducible and one kernel's manifest is
golden, and a bad cubin, a failed compile or an aborting compiler fail the codegen only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cuvil
from cuvil.artifact.kernels_layer import unpack_kernels
from cuvil.backends.cuda import codegen
from cuvil.backends.cuda.backend import FALLBACKS
from cuvil.backends.cuda.codegen import (
    CodegenError,
    check_cubin,
    check_resources,
    generate_layer,
    plan_kernels,
    run_compiler,
)
from cuvil.backends.cuda.cubin import read_cubin
from cuvil.backends.cuda.driver import parameter_bytes
from cuvil.backends.cuda.ptx import PtxError, check_entry, entry_params
from cuvil.backends.cuda.specs import KernelSpec
from cuvil.fused_ops import RMS_NORM
from cuvil.targets import CUDA_ARCHES
from tests.cuvil.backends.cuda.models import NormBlock
from tests.cuvil.backends.cuda.nodes import one_node

GOLDEN = Path(__file__).parent / "golden"
GOLDEN_RMS_NORM = GOLDEN / "rms_norm_f32_n64.sm_90.json"
TEMPLATES = {"rms_norm_rows", "layer_norm_rows", "bias_act_residual", "rope_rows"}
TEMPLATES |= {"attention_blocks"}
PTX_BYTES = {"u64": 8, "b64": 8, "s64": 8, "u32": 4, "b32": 4, "s32": 4, "f32": 4}


def _rms_norm_graph() -> tuple[object, dict[str, torch.Tensor]]:
    constants = {"weight": torch.zeros(64), "eps": 1e-6}
    graph, weights, _ = one_node(RMS_NORM, {"input": torch.zeros(4, 64)}, constants, (4, 64))
    return graph, weights


@pytest.fixture(scope="module")
def rms_norm_layers() -> dict[int, dict[str, bytes]]:
    """The one-kernel layer, for sm_80 and sm_90."""
    graph, weights = _rms_norm_graph()
    return {
        cc: generate_layer(graph, weights, cc, FALLBACKS, f"cuda-sm_{cc}")[0] for cc in (80, 90)
    }  # type: ignore[arg-type]


@pytest.mark.parametrize("arch", CUDA_ARCHES)
def test_every_cubin_is_built_for_the_target_architecture(arch: str) -> None:
    model, x = NormBlock().eval(), torch.randn(2, 5, 48)
    compiled = cuvil.jit(model, (x,), target=f"cuda-{arch}")
    assert compiled.report["verification"]["max_relative_to_scale"] <= 1e-4
    files = unpack_kernels(compiled.contents.kernels)
    top = json.loads(files["manifest.json"])
    expected_arch = f"{arch}a" if arch == "sm_90" else arch
    assert top["arch"] == expected_arch and top["target"] == f"cuda-{arch}"
    manifests = [json.loads(files[f"{name}.json"]) for name in top["kernels"]]
    assert {manifest["template"] for manifest in manifests} == TEMPLATES
    for manifest in manifests:
        info = read_cubin(files[manifest["cubin"]])
        assert info.arch == expected_arch and manifest["cubin"].endswith(f".{expected_arch}.cubin")
        params = info.kernels[manifest["symbol"]]
        assert [param.offset for param in params] == [p["offset"] for p in manifest["params"]]
        values = [p for p in manifest["spec"]["params"] if p[1] != "constexpr"]
        assert len(params) == len(values) + 2  # Triton's global and profile scratch pointers
        assert [p["name"] for p in manifest["params"][-2:]] == ["global_scratch", "profile_scratch"]
        assert [param.size for param in params[-2:]] == [8, 8]
        assert manifest["resources"]["local"] == manifest["resources"]["stack"] == 0
        assert manifest["launch"]["ptx_version"] == codegen.PTX_VERSIONS[int(arch[3:])]
        assert files[manifest["source"]].decode().startswith(f"def {manifest['template']}(")
        ptx_arch = f"sm_{codegen.PTX_ARCHES[int(arch[3:])]}"  # not arch-specific: a fallback
        assert (
            manifest["ptx_arch"] == ptx_arch
            and f".target {ptx_arch}\n" in files[manifest["ptx"]].decode()
        )


def test_one_kernel_manifest_is_golden(rms_norm_layers: dict[int, dict[str, bytes]]) -> None:
    files = rms_norm_layers[90]
    name = min(json.loads(files["manifest.json"])["kernels"])  # the specialised one
    if os.environ.get("CUVIL_WRITE_GOLDEN"):
        manifest = json.loads(files[f"{name}.json"])
        GOLDEN_RMS_NORM.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    assert json.loads(files[f"{name}.json"]) == json.loads(GOLDEN_RMS_NORM.read_text()), (
        f"the manifest of {name} changed; if that is meant, write it to {GOLDEN_RMS_NORM}"
    )


@pytest.fixture(scope="module")
def block_layer() -> dict[str, bytes]:
    """The layer of a block with every template but SwiGLU's, for sm_80."""
    torch.manual_seed(0)
    graph_model, x = NormBlock().eval(), torch.randn(2, 5, 48)
    return unpack_kernels(cuvil.jit(graph_model, (x,), target="cuda-sm_80").contents.kernels)


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_each_templates_kernel_is_golden(block_layer: dict[str, bytes], template: str) -> None:
    """Manifest and source of the first kernel of each template, against golden/ (set
    CUVIL_WRITE_GOLDEN=1 to rewrite them when a change is meant)."""
    manifests = [
        json.loads(block_layer[f"{name}.json"])
        for name in json.loads(block_layer["manifest.json"])["kernels"]
    ]
    manifest = min((m for m in manifests if m["template"] == template), key=lambda m: m["name"])
    source = block_layer[manifest["source"]].decode()
    golden_manifest = GOLDEN / f"{template}.sm_80.json"
    golden_source = GOLDEN / f"{template}.source.txt"
    if os.environ.get("CUVIL_WRITE_GOLDEN"):
        golden_manifest.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        golden_source.write_text(source)
    assert manifest == json.loads(golden_manifest.read_text()), f"{template}'s manifest changed"
    assert source == golden_source.read_text(), f"{template}'s source changed"


def test_the_ptx_fallback_takes_the_manifests_parameters(block_layer: dict[str, bytes]) -> None:
    for name in json.loads(block_layer["manifest.json"])["kernels"]:
        manifest = json.loads(block_layer[f"{name}.json"])
        ptx = block_layer[manifest["ptx"]].decode()
        assert ".target sm_80" in ptx and ".version 8.8" in ptx
        declared = entry_params(ptx, manifest["ptx_symbol"])
        packed = [parameter_bytes(param["type"]) for param in manifest["params"]]
        assert packed == [PTX_BYTES[kind] for kind in declared]  # what the launcher packs
        wrong = manifest | {"params": [*manifest["params"][:-1], {"name": "x", "type": "fp32"}]}
        with pytest.raises(PtxError, match=r"is fp32 in the manifest and \.u64 in the PTX"):
            check_entry(ptx, manifest["ptx_symbol"], wrong)


def test_the_kernels_layer_is_reproducible(rms_norm_layers: dict[int, dict[str, bytes]]) -> None:
    graph, weights = _rms_norm_graph()
    again, seconds = generate_layer(graph, weights, 90, FALLBACKS, "cuda-sm_90")  # type: ignore[arg-type]
    assert again == rms_norm_layers[90] and len(seconds) == 2  # the kernel, its generic twin


def test_a_cubin_that_is_not_what_its_spec_says_is_refused(
    rms_norm_layers: dict[int, dict[str, bytes]],
) -> None:
    graph, weights = _rms_norm_graph()
    (spec,) = plan_kernels(graph, weights, FALLBACKS).kernels.values()  # type: ignore[arg-type]
    cubin = next(data for name, data in rms_norm_layers[80].items() if name.endswith(".cubin"))
    assert read_cubin(cubin).arch == "sm_80"
    check_cubin(spec, cubin, "rms_norm_rows", "sm_80", 0, 80)
    with pytest.raises(CodegenError, match="for sm_80, the target is sm_90a"):
        check_cubin(spec, cubin, "rms_norm_rows", "sm_90a", 0, 90)
    fewer = KernelSpec(**{**spec.__dict__, "params": spec.params[1:]})
    with pytest.raises(CodegenError, match="parameters are"):
        check_cubin(fewer, cubin, "rms_norm_rows", "sm_80", 0, 80)
    with pytest.raises(CodegenError, match="no kernel 'other'"):
        check_cubin(spec, cubin, "other", "sm_80", 0, 80)
    with pytest.raises(CodegenError, match="shared memory"):
        check_cubin(spec, cubin, "rms_norm_rows", "sm_80", 200_000, 80)
    with pytest.raises(CodegenError, match="not an ELF64"):
        check_cubin(spec, b"#!/bin/sh\n" * 10, "rms_norm_rows", "sm_80", 0, 80)


def test_a_kernel_that_fails_to_compile_is_named(tmp_path: Path) -> None:
    graph, weights = _rms_norm_graph()
    (spec,) = plan_kernels(graph, weights, FALLBACKS).kernels.values()  # type: ignore[arg-type]
    bad = KernelSpec(**{**spec.__dict__, "num_warps": 3})  # not a power of two
    with pytest.raises(CodegenError, match=f"failed to compile for sm_90: .*{bad.name}"):
        run_compiler([bad], 90, tmp_path)


def test_an_aborting_compiler_fails_the_codegen_not_the_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    graph, weights = _rms_norm_graph()
    (spec,) = plan_kernels(graph, weights, FALLBACKS).kernels.values()  # type: ignore[arg-type]
    monkeypatch.setitem(codegen.PTX_VERSIONS, 90, 78)  # PTX 7.8 has no sm_90a: LLVM aborts
    with pytest.raises(CodegenError, match=r"exited [1-9][0-9]*: LLVM ERROR: PTX version 7\.8"):
        run_compiler([spec], 90, tmp_path)


def test_a_kernel_that_spills_registers_is_refused(tmp_path: Path) -> None:
    graph, weights = _rms_norm_graph()
    (spec,) = plan_kernels(graph, weights, FALLBACKS).kernels.values()  # type: ignore[arg-type]
    # 16384 fp32 values a row on one warp: 512 per thread, more than the registers hold
    wide = KernelSpec(
        **{
            **spec.__dict__,
            "constexprs": {"N": 16384, "BLOCK_N": 16384, "BLOCK_M": 1},
            "num_warps": 1,
        }
    )
    _, results = run_compiler([wide], 80, tmp_path)
    resources = results[wide.name]["resources"]
    assert resources["stack"] > 0  # ptxas spills to the stack frame
    with pytest.raises(CodegenError, match="spills registers"):
        check_resources(wide, resources)
    check_resources(spec, {"registers": 18, "stack": 0, "local": 0})


def test_the_compile_subprocess_imports_no_torch() -> None:
    """Its start-up is most of a compile's codegen time: Triton and the templates only."""
    probe = "import sys, cuvil.backends.cuda.compile_worker; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


@pytest.mark.parametrize(
    ("ptxas", "asked", "given"),
    [("13.4", 90, 90), ("12.9", 88, 88), ("12.8", 90, 87), ("12.8", 88, 87), ("12.4", 88, 84)],
)
def test_the_ptx_version_is_capped_at_what_the_bundled_ptxas_takes(
    ptxas: str, asked: int, given: int
) -> None:
    """Triton 3.6 (the H200 image's) bundles ptxas 12.8, which refuses PTX 9.0 and 8.8."""
    from cuvil.backends.cuda.compile_worker import capped

    assert capped({"ptx_version": asked, "x": 1}, ptxas) == {"ptx_version": given, "x": 1}
