"""Bearer-token registries: a token server on loopback issues JWTs the registry verifies."""

from __future__ import annotations

from pathlib import Path

import pytest

from cuvil.artifact import AuthenticationError, push_artifact, push_index
from cuvil.artifact.api import resolve
from cuvil.artifact.files import ArtifactContents
from cuvil.artifact.registry_config import write_docker_config
from tests.cuvil.artifact.conftest import artifact_files
from tests.fixtures.registry import RunningRegistry


def test_token_auth_push_pull_and_wrong_password(
    token_registry: RunningRegistry, tiny_contents: ArtifactContents, tmp_path: Path
) -> None:
    config = token_registry.docker_config
    files = artifact_files(tiny_contents, "cpu-x86_64", name="token")
    base = f"{token_registry.host}/tok/mlp"
    # the first call gets a pull-scoped token, the upload needs push scope: a new token is asked
    pushed = push_artifact(files, base, registry_config=config)
    index = push_index(f"{base}:v1", [pushed], registry_config=config)
    pulled = resolve(f"{base}:v1", cache_dir=tmp_path, registry_config=config)
    assert pulled.digest == pushed.digest and index.tag == "v1"
    assert (pulled.path / "weights.safetensors").read_bytes() == files["weights.safetensors"]

    wrong = write_docker_config(tmp_path / "wrong.json", token_registry.host, "cuvil", "nope")
    with pytest.raises(AuthenticationError, match="rejected the credentials of user 'cuvil'"):
        resolve(f"{base}:v1", cache_dir=tmp_path / "other", registry_config=wrong)
