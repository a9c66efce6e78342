"""Whole models compiled for ``cuda-sm_90`` on a machine without a GPU: the compile's verify
stage runs the CUDA plan by interpretation against eager fp32 (within 1e-4 of the output scale;
bf16 within its budget), the plan keeps doing so at other shapes, and an artifact's kernels layer
survives save and load (and a tampered or foreign one is refused)."""

from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch
from torch.export import Dim

import cuvil
from cuvil.artifact.kernels_layer import pack_kernels, unpack_kernels
from cuvil.backends.cuda.layer import LayerError
from cuvil.models import catalog, tiny_llama
from cuvil.precisions import PRECISIONS
from cuvil.runtime.model import CompiledModel
from tests.cuvil.backends.cuda.models import NormMLP
from tests.cuvil.backends.cuda.nodes import relative_to_scale

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def mlp() -> tuple[torch.nn.Module, CompiledModel]:
    torch.manual_seed(0)
    model = NormMLP().eval()
    batch = {"x": {0: Dim("batch", min=1, max=64)}}
    return model, cuvil.jit(model, (torch.randn(4, 32),), target="cuda-sm_90", dynamic_shapes=batch)


def test_an_mlp_with_layer_norm_is_verified_by_interpretation(
    mlp: tuple[torch.nn.Module, CompiledModel],
) -> None:
    model, compiled = mlp
    verification = compiled.report["verification"]
    assert verification["max_relative_to_scale"] <= TOLERANCE
    assert verification["method"].startswith("verified on CPU by interpretation")
    assert "speed not measured" in verification["method"]
    assert compiled.report["bisection"] is None  # no pass had to go
    nodes = compiled.execution()["nodes"]
    kernels = {name: entry["kernel"] for name, entry in nodes.items() if "kernel" in entry}
    assert sum(name.startswith("layer_norm") for name in kernels) == 2
    assert sum(entry["op"] == "cuvil.linear" for entry in nodes.values()) == 3
    x = torch.randn(7, 32)  # another batch than the example's
    with torch.no_grad():
        assert relative_to_scale(compiled(x), model(x)) <= TOLERANCE


def test_the_kernels_layer_survives_save_and_load(
    mlp: tuple[torch.nn.Module, CompiledModel], tmp_path: Path
) -> None:
    _, compiled = mlp
    path = compiled.save(tmp_path / "mlp.cuvil")
    with tarfile.open(path) as tar:
        assert "kernels.tar" in tar.getnames()
    loaded = cuvil.load(path)
    assert unpack_kernels(loaded.contents.kernels) == unpack_kernels(compiled.contents.kernels)
    assert loaded.execution()["kernels"] == compiled.execution()["kernels"]
    x = torch.randn(3, 32)
    torch.testing.assert_close(loaded(x), compiled(x), rtol=0, atol=0)
    assert loaded.prepare({"x": x}) == 1


def test_a_tampered_or_foreign_kernels_layer_is_refused(
    mlp: tuple[torch.nn.Module, CompiledModel],
) -> None:
    _, compiled = mlp
    files = unpack_kernels(compiled.contents.kernels)
    cubin = next(name for name in files if name.endswith(".cubin"))
    flipped = bytearray(files[cubin])
    flipped[100] ^= 0xFF
    tampered = files | {cubin: bytes(flipped)}
    contents = compiled.contents
    with pytest.raises(LayerError, match="does not match its manifest"):
        CompiledModel(
            type(contents)(
                contents.config, contents.graph, contents.weights, kernels=pack_kernels(tampered)
            )
        )
    manifest = next(name for name in files if name.endswith(".json") and name != "manifest.json")
    missing = {name: data for name, data in files.items() if name != manifest}
    with pytest.raises(LayerError, match=f"no manifest {manifest}"):
        CompiledModel(
            type(contents)(
                contents.config, contents.graph, contents.weights, kernels=pack_kernels(missing)
            )
        )
    foreign = contents.config | {"target": "cuda-sm_80"}
    with pytest.raises(LayerError, match="is for cuda-sm_90, not cuda-sm_80"):
        CompiledModel(
            type(contents)(foreign, contents.graph, contents.weights, kernels=contents.kernels)
        )


def test_a_machine_without_triton_says_what_a_cuda_artifact_needs(
    mlp: tuple[torch.nn.Module, CompiledModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a)
    )
    with pytest.raises(
        LayerError, match=r"Triton is not installed \(pip install 'cuvil\[cuda\]'\)"
    ):
        CompiledModel(mlp[1].contents)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_low_precision_stays_within_its_budget(precision: str) -> None:
    torch.manual_seed(1)
    model, x = NormMLP().eval(), torch.randn(4, 32)
    compiled = cuvil.jit(model, (x,), target="cuda-sm_90", precision=precision)
    error = compiled.report["verification"]["max_relative_to_scale"]
    assert 0 < error <= PRECISIONS[precision].budget
    files = unpack_kernels(compiled.contents.kernels)
    epilogues = [
        name for name in files if name.startswith("linear_epilogue") and name.endswith(".json")
    ]
    pointer = f'"*{precision}"'.encode()
    assert epilogues and all(pointer in files[name] for name in epilogues)  # GEMMs in it


def test_the_tiny_llama_is_verified_by_interpretation() -> None:
    spec = tiny_llama()
    compiled = cuvil.jit(
        spec.model, spec.example_inputs, dynamic_shapes=spec.dynamic_shapes, target="cuda-sm_90"
    )
    assert compiled.report["verification"]["max_relative_to_scale"] <= TOLERANCE
    nodes = compiled.execution()["nodes"]
    assert (
        sum("kernel" in entry and entry["op"] == "cuvil.rms_norm" for entry in nodes.values()) == 5
    )
    ids = torch.randint(0, 2048, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = spec.model(input_ids=ids).logits
    got = next(iter(compiled.run({"input_ids": ids}).values()))
    assert relative_to_scale(got, want) <= TOLERANCE


# bundled model -> the fused ops its CUDA plan must run as Cuvil kernels
BUNDLED = {
    "minilm": {"cuvil.layer_norm", "cuvil.attention", "cuvil.linear"},
    "resnet18": {"cuvil.conv2d"},  # cuDNN's convolutions, Cuvil's epilogues; a plain classifier
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BUNDLED))
def test_bundled_models_are_verified_by_interpretation(name: str) -> None:
    spec = getattr(catalog, name)()
    compiled = cuvil.jit(
        spec.model, spec.example_inputs, dynamic_shapes=spec.dynamic_shapes, target="cuda-sm_90"
    )
    assert compiled.report["verification"]["max_relative_to_scale"] <= TOLERANCE
    assert compiled.report["bisection"] is None
    nodes = compiled.execution()["nodes"].values()
    assert {entry["op"] for entry in nodes if "kernel" in entry} == BUNDLED[name]


def test_cuvil_inspect_lists_the_kernels_per_architecture(
    mlp: tuple[torch.nn.Module, CompiledModel], tmp_path: Path
) -> None:
    _, compiled = mlp
    path = compiled.save(tmp_path / "mlp.cuvil")
    done = subprocess.run(
        [sys.executable, "-m", "cuvil_cli.main", "inspect", str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    kernels = compiled.execution()["kernels"]
    assert f"kernels for sm_90a ({len(kernels)}):" in done.stdout
    assert f"PTX fallback for sm_89 ({len(kernels)}):" in done.stdout
    assert all(name in done.stdout for name in kernels)
    assert "verified on CPU by interpretation" in done.stdout
