"""Forged artifacts (digests recorded again, so every digest check passes) are refused by
``cuvil.load`` and ``cuvil run`` in under a second, naming what is wrong: an op off the allowlist
(``aten.from_file`` reading /etc/passwd), a shape expression outside the grammar (``9**9**9``),
and artifacts that ask for more than the load limits allow."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from cuvil_cli.main import main

import cuvil
from cuvil.artifact import media_types as mt
from cuvil.artifact.errors import ArtifactError
from cuvil.artifact.files import ArtifactContents, decode_files, read_files, write_artifact
from cuvil.artifact.limits import LoadLimits
from cuvil.artifact.plain_tar import write_plain_tar  # noqa: F401 (forge writes tars)
from cuvil.runtime.model import CompiledModel
from tests.fixtures.forged import FORGERIES, forge, reseal, write_files


@pytest.fixture(scope="module")
def genuine(tiny_contents: ArtifactContents, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_artifact(tiny_contents, tmp_path_factory.mktemp("genuine") / "mlp.cuvil")


def test_the_genuine_artifact_loads(genuine: Path) -> None:
    assert cuvil.load(genuine).name


@pytest.mark.parametrize("forgery", list(FORGERIES))
def test_cuvil_load_refuses_a_forgery_in_under_a_second(
    forgery: str, genuine: Path, tmp_path: Path
) -> None:
    edit, named = FORGERIES[forgery]
    forged = forge(genuine, tmp_path / f"{forgery}.cuvil", edit)
    started = time.perf_counter()
    with pytest.raises(ArtifactError) as refused:
        cuvil.load(forged)
    assert time.perf_counter() - started < 1.0
    assert named in str(refused.value)


@pytest.mark.parametrize("forgery", list(FORGERIES))
def test_cuvil_run_refuses_a_forgery_in_under_a_second(
    forgery: str, genuine: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    edit, named = FORGERIES[forgery]
    forged = forge(genuine, tmp_path / f"{forgery}.cuvil", edit)
    started = time.perf_counter()
    assert main(["run", str(forged)]) == 2
    assert time.perf_counter() - started < 1.0
    captured = capsys.readouterr()
    assert named in captured.err and "root:" not in captured.out


def _forged_load(genuine: Path, tmp_path: Path, edit: Any, **limits: int) -> str:
    forged = forge(genuine, tmp_path / "forged.cuvil", edit)
    with pytest.raises(ArtifactError) as refused:
        decode_files(read_files(forged), str(forged), LoadLimits(**limits))
    return str(refused.value)


def _symbols(graph: dict[str, Any], maximum: int | None) -> None:
    for symbol in graph["symbols"]:
        symbol["max"] = maximum


def test_a_tensor_that_could_outgrow_the_limit_is_refused(genuine: Path, tmp_path: Path) -> None:
    message = _forged_load(genuine, tmp_path, lambda g: _symbols(g, 10**12))
    assert "more than the limit" in message and "batch" in message


def test_a_symbol_without_an_upper_bound_is_refused(genuine: Path, tmp_path: Path) -> None:
    assert "unbounded" in _forged_load(genuine, tmp_path, lambda g: _symbols(g, None))


def test_the_tensor_limit_is_configurable(genuine: Path, tmp_path: Path) -> None:
    message = _forged_load(genuine, tmp_path, lambda g: None, max_tensor_bytes=64)
    assert "more than the limit 64" in message


def test_too_many_nodes_are_refused_before_parsing(genuine: Path, tmp_path: Path) -> None:
    def flood(graph: dict[str, Any]) -> None:
        graph["nodes"] = graph["nodes"] + [{"bad": "node"}] * 50

    assert "more than the limit 20" in _forged_load(genuine, tmp_path, flood, max_nodes=20)


def _full(graph: dict[str, Any], size: list[int]) -> None:
    graph["nodes"].append(
        {
            "name": "big",
            "op": "aten.full.default",
            "args": [["size", size], ["fill_value", 1.0]],
            "types": [{"dtype": "f32", "shape": [1], "layout": "contiguous"}],
        }
    )


def test_a_size_argument_past_the_limit_is_refused(genuine: Path, tmp_path: Path) -> None:
    message = _forged_load(genuine, tmp_path, lambda g: _full(g, [10**6, 10**6]))
    assert "size argument size" in message and "aten.full.default" in message


def test_sizes_the_config_declares_must_be_the_files(genuine: Path) -> None:
    files = read_files(genuine)
    config = json.loads(files[mt.CONFIG_FILE])
    config["files"][mt.WEIGHTS_FILE]["size"] += 1
    files[mt.CONFIG_FILE] = json.dumps(config).encode()
    with pytest.raises(ArtifactError, match="config declares"):
        decode_files(files)


def test_a_const_must_match_its_weight(tiny_contents: ArtifactContents, tmp_path: Path) -> None:
    key = next(iter(tiny_contents.weights))
    weights = dict(tiny_contents.weights) | {key: tiny_contents.weights[key][:1]}
    contents = ArtifactContents(tiny_contents.config, tiny_contents.graph, weights)
    with pytest.raises(ArtifactError, match="weights file holds"):
        cuvil.load(write_artifact(contents, tmp_path / "mismatch.cuvil"))


def test_golden_data_larger_than_the_model_is_refused(genuine: Path, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save

    files = read_files(genuine)
    files[mt.GOLDEN_FILE] = save({"input.input": torch.zeros(2**20)})  # 4 MiB
    forged = write_files(reseal(files), tmp_path / "golden.cuvil")
    with pytest.raises(ArtifactError, match="golden data"):
        decode_files(read_files(forged), limits=LoadLimits(golden_allowance_bytes=1024))
    assert isinstance(CompiledModel(decode_files(read_files(forged))), CompiledModel)
