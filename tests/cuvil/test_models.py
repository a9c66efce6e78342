"""The issue's four models compile, survive save -> load in a fresh process (without the model's
code), match eager fp32 at several shapes inside their ranges, and refuse shapes outside them."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import cuvil
from cuvil.ir_text import parse_graph, print_graph
from cuvil.models import ModelSpec, minilm, mlp, resnet50, tiny_llama
from cuvil.runtime.signature import InputError
from cuvil.verify import compare_output

REPO = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-4  # max abs error relative to the output's scale


def _ids(b: int, s: int) -> torch.Tensor:
    return torch.randint(1000, 20000, (b, s))


def _text(b: int, s: int) -> dict[str, torch.Tensor]:
    mask = torch.ones(b, s, dtype=torch.int64)
    mask[0, s // 2 :] = 0  # padding in the first row
    return {"input_ids": _ids(b, s), "attention_mask": mask}


# model -> (factory, inputs at several shapes inside the ranges, inputs outside them)
MODELS: dict[
    str, tuple[Callable[[], ModelSpec], list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
] = {
    "mlp": (mlp, [{"x": torch.randn(b, 784)} for b in (1, 7, 64)], {"x": torch.randn(65, 784)}),
    "resnet50": (
        resnet50,
        [{"pixel_values": torch.randn(b, 3, 224, 224)} for b in (1, 3)],
        {"pixel_values": torch.randn(33, 3, 224, 224)},
    ),
    "minilm": (minilm, [_text(1, 8), _text(3, 37), _text(2, 512)], _text(33, 16)),
    "tiny_llama": (
        tiny_llama,
        [{"input_ids": _ids(1, s) % 2048} for s in (2, 33, 128)],
        {"input_ids": _ids(1, 513) % 2048},
    ),
}


@pytest.fixture(scope="module", params=list(MODELS))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    factory, shapes, outside = MODELS[request.param]
    torch.manual_seed(0)
    spec = factory()
    compiled = cuvil.jit(
        spec.model, spec.example_inputs, dynamic_shapes=spec.dynamic_shapes, name=spec.name
    )
    path = compiled.save(tmp_path_factory.mktemp(request.param) / f"{request.param}.cuvil")
    return request.param, spec, compiled, path, shapes, outside


def _eager(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        result = model(**inputs)
    if isinstance(result, torch.Tensor):
        return {"output": result}
    return {key: value for key, value in result.items() if isinstance(value, torch.Tensor)}


@pytest.mark.slow
def test_compiled_matches_eager_in_a_fresh_process(case, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    name, spec, compiled, path, shapes, _ = case
    assert compiled.report["verification"]["max_relative_to_scale"] <= TOLERANCE
    inputs = {f"case{i}.{k}": v for i, shape in enumerate(shapes) for k, v in shape.items()}
    save_file(inputs, tmp_path / "in.safetensors")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.cuvil.fresh_process_runner",
            str(path),
            str(tmp_path / "in.safetensors"),
            str(tmp_path / "out.safetensors"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1])["model_code_modules"] == []
    outputs = load_file(tmp_path / "out.safetensors")
    for i, shape in enumerate(shapes):
        for out_name, expected in _eager(spec.model, shape).items():
            if out_name not in compiled.signature.output_names:
                continue
            error = compare_output(out_name, outputs[f"case{i}.{out_name}"], expected)
            assert error.relative_to_scale <= TOLERANCE, (name, i, error)


@pytest.mark.slow
def test_outside_the_declared_range_is_refused(case) -> None:  # type: ignore[no-untyped-def]
    _, _, compiled, _, _, outside = case
    with pytest.raises(InputError, match="outside its declared range"):
        compiled.run(outside)


@pytest.mark.slow
def test_wrong_dtype_is_refused(case) -> None:  # type: ignore[no-untyped-def]
    _, _, compiled, _, shapes, _ = case
    wrong = {k: (v.float() if v.dtype == torch.int64 else v.double()) for k, v in shapes[0].items()}
    with pytest.raises(InputError, match="dtype"):
        compiled.run(wrong)


@pytest.mark.slow
def test_ir_text_round_trips(case) -> None:  # type: ignore[no-untyped-def]
    _, _, compiled, path, _, _ = case
    assert parse_graph(print_graph(compiled.graph)) == compiled.graph
    assert cuvil.load(path).graph == compiled.graph
