"""Models built from other transformers configs (the CPU generality suite's), compiled for CUDA
targets on a machine without a GPU: each CUDA plan, run by interpretation, matches eager fp32 at
the example and at other shapes, with every pass kept; and the bundled full-size models compile
for sm_90, sm_80 and sm_87 (Jetson Orin) with cubins of that architecture."""

from __future__ import annotations

import json

import pytest
import torch

import cuvil
from cuvil.artifact.kernels_layer import unpack_kernels
from cuvil.backends.cuda.cubin import read_cubin
from cuvil.models import catalog
from cuvil.verify import compare_output
from tests.cuvil.test_generality import MODELS

TOLERANCE = 1e-4
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", list(MODELS))
def test_model_family_matches_eager_on_cuda_sm_90(name: str) -> None:
    make_model, make_inputs, shapes = MODELS[name]
    torch.manual_seed(0)
    model = make_model().eval()
    compiled = cuvil.jit(model, make_inputs(2, 8), dynamic_shapes=shapes, target="cuda-sm_90")
    assert compiled.report["verification"]["max_relative_to_scale"] <= TOLERANCE
    assert compiled.report["bisection"] is None
    inputs = make_inputs(3, 17)
    with torch.no_grad():
        expected = model(**inputs)
    for key, value in compiled.run(inputs).items():
        reference = expected.get(key)
        if reference is not None:
            error = compare_output(key, value, reference)
            assert error.relative_to_scale <= TOLERANCE, (name, error)


@pytest.mark.parametrize(
    ("name", "target"),
    [
        ("resnet50", "cuda-sm_90"),  # each model once, each architecture once
        ("minilm", "cuda-sm_80"),
        ("tiny_llama", "cuda-sm_87"),
    ],
)
def test_bundled_models_compile_for_each_architecture(name: str, target: str) -> None:
    spec = getattr(catalog, name)()
    example = spec.example_inputs
    if name == "resnet50":  # the same graph at 96x96: a fifth of 224x224's interpreted epilogues
        example = {"pixel_values": torch.randn(2, 3, 96, 96)}
    compiled = cuvil.jit(spec.model, example, dynamic_shapes=spec.dynamic_shapes, target=target)
    assert compiled.report["verification"]["max_relative_to_scale"] <= TOLERANCE
    files = unpack_kernels(compiled.contents.kernels)
    arch = target.removeprefix("cuda-") + ("a" if target.endswith("90") else "")
    top = json.loads(files["manifest.json"])
    assert top["arch"] == arch and top["kernels"]
    for kernel in top["kernels"]:
        assert read_cubin(files[json.loads(files[f"{kernel}.json"])["cubin"]]).arch == arch
