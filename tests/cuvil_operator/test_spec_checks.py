"""Spec checks beyond the schema, each problem naming its field."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from cuvil_operator.spec_checks import check_spec

REPO = Path(__file__).resolve().parents[2]


def _spec(name: str = "minilm-cpu.yaml") -> dict[str, Any]:
    return dict(yaml.safe_load((REPO / "examples" / name).read_text())["spec"])


def _fields(spec: dict[str, Any]) -> list[str]:
    return [problem.field for problem in check_spec(spec)]


def test_valid_examples_pass() -> None:
    for name in ("minilm-cpu.yaml", "resnet50-cpu.yaml", "two-targets.yaml"):
        assert check_spec(_spec(name)) == [], name


def test_invalid_example_names_the_undeclared_dim() -> None:
    (problem,) = check_spec(_spec("invalid.yaml"))
    assert problem.field == "spec.inputs[0].shape[1]"
    assert "'seq'" in problem.message and "dynamicDims" in problem.message


def test_bounds_out_of_order() -> None:
    spec = _spec()
    spec["dynamicDims"]["seq"] = {"min": 64, "max": 8}
    assert _fields(spec) == ["spec.dynamicDims.seq"]


def test_unused_dim_and_zero_size() -> None:
    spec = _spec("resnet50-cpu.yaml")
    spec["dynamicDims"]["unused"] = {"min": 1, "max": 2}
    spec["inputs"][0]["shape"][1] = 0
    assert sorted(_fields(spec)) == ["spec.dynamicDims.unused", "spec.inputs[0].shape[1]"]


def test_output_repository_must_parse() -> None:
    for bad in ("no-host", "127.0.0.1:5000/Models/UPPER", "host/repo:tag", "host/repo@sha256:ab"):
        spec = _spec()
        spec["output"]["repository"] = bad
        assert _fields(spec) == ["spec.output.repository"], bad
    spec = _spec()
    spec["output"]["repository"] = "registry.example.com:443/team/minilm"
    assert check_spec(spec) == []


def test_schema_errors_name_their_field() -> None:
    spec = _spec()
    spec["targets"] = ["cpu-x86_64", "tpu"]
    assert _fields(spec) == ["spec.targets[1]"]
    del spec["output"]
    assert "spec" in _fields(spec)  # the missing field is reported on its parent


def test_fp16_on_cpu_int8_on_cuda_and_pvc_escape() -> None:
    spec = _spec()
    spec["precision"] = "fp16"
    assert _fields(spec) == ["spec.precision"]
    spec["precision"] = "int8"
    assert _fields(spec) == []  # a cpu target: int8 weights
    spec["targets"] = ["cpu-x86_64", "cuda-sm_90"]
    (problem,) = check_spec(spec)
    assert (problem.field, "int8 is for cpu targets" in problem.message) == ("spec.precision", True)
    spec = copy.deepcopy(_spec())
    spec["source"] = {"pvc": {"claimName": "models", "path": "../etc"}}
    assert _fields(spec) == ["spec.source.pvc.path"]
    spec["source"] = {"url": "https://example.com/model.tar"}
    assert _fields(spec) == []  # its form is fine; the push policy's allowlist decides


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("https://user:pw@models.example.com/a.tar", "no credentials"),
        ("https://models.example.com/team-a/../team-b/a.tar", "path segments"),
        ("https://models.example.com/team-a/%2e%2e/team-b/a.tar", "path segments"),
        ("https://models.example.com/team-a/.\\a.tar", "backslashes"),
        ("https://models.example.com/a.tar#md5=00", "only fragment"),
        ("https:///a.tar", "with a host"),
    ],
)
def test_a_url_source_of_the_wrong_form_names_the_field(url: str, message: str) -> None:
    spec = {**_spec(), "source": {"url": url}}
    (problem,) = check_spec(spec)
    assert problem.field == "spec.source.url" and message in problem.message
