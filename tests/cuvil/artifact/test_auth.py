"""htpasswd (bcrypt) basic auth with credentials from a docker config file."""

from __future__ import annotations

from pathlib import Path

import pytest

from cuvil.artifact import AuthenticationError, push_artifact, resolve_digest
from cuvil.artifact.api import resolve
from cuvil.artifact.files import ArtifactContents
from cuvil.artifact.registry_config import RegistryConfig, write_docker_config
from tests.cuvil.artifact.conftest import artifact_files
from tests.fixtures.registry import RunningRegistry


def test_right_credentials_push_and_pull(
    auth_registry: RunningRegistry, tiny_contents: ArtifactContents, tmp_path: Path
) -> None:
    files = artifact_files(tiny_contents, "cpu-x86_64")
    pushed = push_artifact(
        files, f"{auth_registry.host}/secure/mlp:v1", registry_config=auth_registry.docker_config
    )
    pulled = resolve(
        f"{auth_registry.host}/secure/mlp:v1",
        cache_dir=tmp_path,
        registry_config=auth_registry.docker_config,
    )
    assert pulled.digest == pushed.digest
    assert (pulled.path / "weights.safetensors").read_bytes() == files["weights.safetensors"]
    # The docker config may name the registry as localhost: the same credentials apply.
    alias = write_docker_config(
        tmp_path / "alias.json",
        auth_registry.host.replace("127.0.0.1", "localhost"),
        auth_registry.username or "",
        auth_registry.password or "",
    )
    assert resolve_digest(pushed.ref, registry_config=alias) == pushed.digest


def test_wrong_password_fails_clearly(
    auth_registry: RunningRegistry, tiny_contents: ArtifactContents, tmp_path: Path
) -> None:
    wrong = write_docker_config(
        tmp_path / "config.json", auth_registry.host, auth_registry.username or "", "nope"
    )
    with pytest.raises(AuthenticationError, match=r"rejected the credentials of user 'cuvil'"):
        push_artifact(
            artifact_files(tiny_contents, "cpu-x86_64"),
            f"{auth_registry.host}/secure/denied:v1",
            registry_config=wrong,
        )
    with pytest.raises(AuthenticationError, match="rejected"):
        resolve(f"{auth_registry.host}/secure/mlp:v1", cache_dir=tmp_path, registry_config=wrong)


def test_missing_credentials_say_so(auth_registry: RunningRegistry, tmp_path: Path) -> None:
    with pytest.raises(AuthenticationError, match="requires credentials"):
        resolve_digest(
            f"{auth_registry.host}/secure/mlp:v1",
            registry_config=RegistryConfig(docker_config=tmp_path / "absent.json"),
        )
