"""``cuvil push``, ``cuvil pull``, ``cuvil compile -o REF`` and ``cuvil inspect REF``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cuvil_cli.main import main

from cuvil.artifact import media_types as mt
from cuvil.artifact.files import ArtifactContents
from tests.cuvil.artifact.conftest import artifact_files, machine_target
from tests.fixtures.registry import RunningRegistry


@pytest.fixture(autouse=True)
def _no_home_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CUVIL_REGISTRY_CONFIG", str(tmp_path / "none.json"))
    monkeypatch.setenv("CUVIL_CACHE_DIR", str(tmp_path / "cache"))


def _write(files: dict[str, bytes], folder: Path) -> Path:
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return folder


def test_push_targets_inspect_and_pull(
    registry: RunningRegistry,
    tiny_contents: ArtifactContents,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    cpu = _write(artifact_files(tiny_contents, "cpu-x86_64", name="cli"), tmp_path / "cpu")
    gpu = _write(artifact_files(tiny_contents, "cuda-sm_90", name="cli"), tmp_path / "gpu")
    ref = f"{registry.host}/cli/mlp:v1"
    assert main(["push", str(cpu), str(gpu), ref, "--json"]) == 0
    pushed = json.loads(capsys.readouterr().out)
    assert [p["target"] for p in pushed] == ["cpu-x86_64", "cuda-sm_90", None]

    assert main(["inspect", ref]) == 0
    shown = capsys.readouterr().out
    mine = machine_target({"cpu-x86_64": {}, "cuda-sm_90": {}})
    assert pushed[2]["digest"] in shown and f"*target {mine}" in shown
    assert "target cuda-sm_90" in shown and "target cpu-x86_64" in shown

    assert main(["pull", ref, "-o", str(tmp_path / "out"), "--target", "cpu-x86_64"]) == 0
    assert "downloaded" in capsys.readouterr().out
    assert (tmp_path / "out" / mt.CONFIG_FILE).read_bytes() == (cpu / mt.CONFIG_FILE).read_bytes()

    assert main(["pull", f"{registry.host}/cli/none:v1", "-o", str(tmp_path / "x")]) == 2
    assert "HTTP 404" in capsys.readouterr().err


def test_compile_to_a_registry_then_inspect_with_ir(
    registry: RunningRegistry, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ref = f"{registry.host}/cli/compiled:v1"
    assert main(["compile", "cuvil.models:mlp", "-o", ref, "--json"]) == 0
    artifact = json.loads(capsys.readouterr().out)["artifact"]
    assert artifact.startswith(f"{registry.host}/cli/compiled@sha256:")
    assert main(["inspect", ref, "--ir"]) == 0
    shown = capsys.readouterr().out
    assert "signature:" in shown and artifact.split("@")[1] in shown


def test_push_to_a_local_layout(
    tiny_contents: ArtifactContents, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cpu = _write(artifact_files(tiny_contents, "cpu-x86_64"), tmp_path / "cpu")
    assert main(["push", str(cpu), f"oci:{tmp_path / 'layout'}:v1"]) == 0
    assert "pushed cpu-x86_64" in capsys.readouterr().out
    assert main(["inspect", f"{tmp_path / 'layout'}:v1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["target"] == "cpu-x86_64"
