"""Artifact files: tar and directory forms hold the same data, nothing is pickled, and any
modified byte is refused by digest before anything is parsed."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest
import torch

import cuvil
from cuvil.artifact.files import ArtifactError, read_artifact, read_files


@pytest.fixture(scope="module")
def compiled():  # type: ignore[no-untyped-def]
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2)
    ).eval()
    return cuvil.jit(
        model, (torch.randn(2, 6),), dynamic_shapes={"input": {0: cuvil.Dim("batch", max=8)}}
    )


def test_tar_and_directory_forms_load_the_same_model(compiled, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    tar_path = compiled.save(tmp_path / "m.cuvil")
    dir_path = compiled.save(tmp_path / "m_dir", directory=True)
    assert tarfile.is_tarfile(tar_path) and dir_path.is_dir()
    assert read_files(tar_path) == read_files(dir_path)
    x = torch.randn(4, 6)
    torch.testing.assert_close(cuvil.load(tar_path)(x), cuvil.load(dir_path)(x))
    torch.testing.assert_close(cuvil.load(tar_path)(x), compiled(x))


def test_saving_twice_gives_identical_bytes(compiled, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    first = compiled.save(tmp_path / "a.cuvil").read_bytes()
    second = compiled.save(tmp_path / "b.cuvil").read_bytes()
    assert first == second


def test_files_are_data_not_pickles(compiled, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    files = read_files(compiled.save(tmp_path / "m.cuvil"))
    assert set(files) == {"config.json", "graph.json", "weights.safetensors", "golden.safetensors"}
    json.loads(files["config.json"])
    json.loads(files["graph.json"])
    for data in files.values():
        assert not data.startswith(b"\x80")  # the pickle protocol marker
    header_size = int.from_bytes(files["weights.safetensors"][:8], "little")
    header = json.loads(files["weights.safetensors"][8 : 8 + header_size])
    assert {"0.weight", "0.bias", "2.weight", "2.bias"} <= set(header)


@pytest.mark.parametrize("member", ["graph.json", "weights.safetensors", "config.json"])
def test_a_modified_file_is_refused(compiled, tmp_path: Path, member: str) -> None:  # type: ignore[no-untyped-def]
    path = compiled.save(tmp_path / "m", directory=True)
    data = bytearray((path / member).read_bytes())
    if member == "config.json":
        config = json.loads(data)
        config["files"]["weights.safetensors"]["digest"] = "sha256:" + "0" * 64
        data = bytearray(json.dumps(config).encode())
    else:
        data[len(data) // 2] ^= 0xFF
    (path / member).write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="digest"):
        read_artifact(path)


def test_missing_and_foreign_members_are_refused(compiled, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path = compiled.save(tmp_path / "m", directory=True)
    (path / "weights.safetensors").unlink()
    with pytest.raises(ArtifactError, match=r"missing weights\.safetensors"):
        read_artifact(path)
    odd = tmp_path / "odd.cuvil"
    with tarfile.open(odd, "w") as tar:
        tar.add(__file__, arcname="evil.py")
    with pytest.raises(ArtifactError, match="unexpected member"):
        read_artifact(odd)
