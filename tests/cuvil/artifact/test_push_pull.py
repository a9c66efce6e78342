"""Push and pull against the real Debian docker-registry on loopback."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
import torch

from cuvil.artifact import (
    NoMatchingTargetError,
    NotFoundError,
    pull_artifact,
    push_artifact,
    push_index,
    resolve_digest,
)
from cuvil.artifact import media_types as mt
from cuvil.artifact.api import resolve
from cuvil.artifact.describe import describe_reference
from cuvil.artifact.files import ArtifactContents
from cuvil.artifact.registry_config import RegistryConfig
from cuvil.runtime.model import load
from tests.cuvil.artifact.conftest import artifact_files, machine_target
from tests.fixtures.registry import RunningRegistry

NO_CREDENTIALS = RegistryConfig(docker_config=None)


def _manifest(registry: RunningRegistry, repository: str, reference: str) -> dict:
    request = urllib.request.Request(
        f"{registry.url}/v2/{repository}/manifests/{reference}",
        headers={"Accept": f"{mt.OCI_INDEX}, {mt.OCI_MANIFEST}"},
    )
    with urllib.request.urlopen(request, timeout=5) as response:
        return json.loads(response.read())


def _push_two_targets(
    registry: RunningRegistry, contents: ArtifactContents, repository: str
) -> tuple[dict[str, dict[str, bytes]], list, object]:
    files = {t: artifact_files(contents, t) for t in ("cpu-x86_64", "cuda-sm_90")}
    base = f"{registry.host}/{repository}"
    pushed = [push_artifact(f, base, registry_config=NO_CREDENTIALS) for f in files.values()]
    index = push_index(f"{base}:v1", pushed, registry_config=NO_CREDENTIALS)
    return files, pushed, index


def test_two_target_index_pull_by_tag_and_digest(
    registry: RunningRegistry, tiny_contents: ArtifactContents, tmp_path: Path
) -> None:
    files, pushed, index = _push_two_targets(registry, tiny_contents, "models/mlp")

    stored = _manifest(registry, "models/mlp", "v1")
    assert stored["mediaType"] == mt.OCI_INDEX
    assert sorted(e["annotations"][mt.ANNOTATION_TARGET] for e in stored["manifests"]) == [
        "cpu-x86_64",
        "cuda-sm_90",
    ]
    for result in pushed:
        manifest = _manifest(registry, "models/mlp", result.digest)
        assert manifest["artifactType"] == mt.ARTIFACT_TYPE
        assert manifest["config"]["mediaType"] == mt.CONFIG
        assert manifest["annotations"][mt.ANNOTATION_TARGET] == result.target

    # The probe picks this machine's entry: the CPU one on x86_64, the CUDA one on sm_90.
    mine = machine_target(files)
    by_tag = resolve(f"{registry.host}/models/mlp:v1", cache_dir=tmp_path / "cache")
    assert by_tag.downloaded and by_tag.digest == pushed[list(files).index(mine)].digest
    for name, data in files[mine].items():
        assert (by_tag.path / name).read_bytes() == data
    gpu = resolve(index.ref, cache_dir=tmp_path / "cache", target="cuda-sm_90")
    assert gpu.digest == pushed[1].digest
    assert (gpu.path / mt.CONFIG_FILE).read_bytes() == files["cuda-sm_90"][mt.CONFIG_FILE]

    # By the manifest's own digest, into a fresh cache, then as a tar that load() opens.
    by_digest = resolve(pushed[0].ref, cache_dir=tmp_path / "other", target="cpu-x86_64")
    assert by_digest.downloaded
    assert (by_digest.path / mt.WEIGHTS_FILE).read_bytes() == files["cpu-x86_64"][mt.WEIGHTS_FILE]
    tar = pull_artifact(
        index.ref, tmp_path / "mlp.cuvil", cache_dir=tmp_path / "cache", target="cpu-x86_64"
    )
    model = load(tar)
    assert model(torch.randn(3, 8)).shape == (3, 4)
    assert resolve_digest(f"{registry.host}/models/mlp:v1") == index.digest

    with pytest.raises(NoMatchingTargetError, match=r"cpu-x86_64.*cuda-sm_90"):
        resolve(index.ref, cache_dir=tmp_path / "cache", target="cuda-sm_80")


def test_repush_gives_the_same_digests(
    registry: RunningRegistry, tiny_contents: ArtifactContents
) -> None:
    first = _push_two_targets(registry, tiny_contents, "models/again")
    second = _push_two_targets(registry, tiny_contents, "models/again")
    assert [p.digest for p in first[1]] == [p.digest for p in second[1]]
    assert first[2].digest == second[2].digest  # type: ignore[attr-defined]


def test_describe_lists_targets(registry: RunningRegistry, tiny_contents: ArtifactContents) -> None:
    _, pushed, index = _push_two_targets(registry, tiny_contents, "models/described")
    described = describe_reference(f"{registry.host}/models/described:v1")
    assert described["digest"] == index.digest  # type: ignore[attr-defined]
    assert {t["target"] for t in described["targets"]} == {"cpu-x86_64", "cuda-sm_90"}
    mine = machine_target({"cpu-x86_64": {}, "cuda-sm_90": {}})
    assert described["selected"] == pushed[["cpu-x86_64", "cuda-sm_90"].index(mine)].digest
    single = describe_reference(pushed[1].ref)
    assert single["config"]["target"] == "cuda-sm_90"
    assert set(single["files"]) >= {mt.CONFIG_FILE, mt.GRAPH_FILE, mt.WEIGHTS_FILE}


def test_missing_tag_is_not_found(registry: RunningRegistry, tmp_path: Path) -> None:
    with pytest.raises(NotFoundError):
        resolve(f"{registry.host}/models/none:v9", cache_dir=tmp_path)
