"""TLS: a registry with a certificate from a private CA is trusted only with that CA bundle."""

from __future__ import annotations

from pathlib import Path

import pytest

from cuvil.artifact import RegistryError, push_artifact
from cuvil.artifact.api import resolve
from cuvil.artifact.files import ArtifactContents
from cuvil.artifact.registry_config import RegistryConfig
from tests.cuvil.artifact.conftest import artifact_files
from tests.fixtures.registry import RunningRegistry


def test_ca_bundle_is_required_and_sufficient(
    tls_registry: RunningRegistry, tiny_contents: ArtifactContents, tmp_path: Path
) -> None:
    files = artifact_files(tiny_contents, "cpu-x86_64", name="tls")
    ref = f"{tls_registry.host}/tls/mlp:v1"
    untrusted = RegistryConfig(docker_config=None, plain_http=False)
    with pytest.raises(RegistryError, match=r"TLS failure.*CA bundle"):
        push_artifact(files, ref, registry_config=untrusted)
    trusted = RegistryConfig(docker_config=None, plain_http=False, ca_bundle=tls_registry.ca_bundle)
    pushed = push_artifact(files, ref, registry_config=trusted)
    pulled = resolve(ref, cache_dir=tmp_path, registry_config=trusted)
    assert pulled.digest == pushed.digest
    assert (pulled.path / "config.json").read_bytes() == files["config.json"]
