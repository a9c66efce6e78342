"""Fixtures for the OCI tests: a real registry (with and without auth) and tiny artifacts."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from cuvil.artifact import media_types as mt
from cuvil.artifact.files import ArtifactContents, encode_files
from tests.fixtures.registry import (  # noqa: F401
    auth_registry,
    registry,
    tls_registry,
    token_registry,
)


@pytest.fixture(scope="session")
def tiny_contents() -> ArtifactContents:
    """A small MLP compiled once per session (a few seconds)."""
    import cuvil

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    batch = cuvil.Dim("batch", min=1, max=8)
    compiled = cuvil.jit(model, (torch.randn(2, 8),), dynamic_shapes={"input": {0: batch}})
    return compiled.contents


def artifact_files(
    contents: ArtifactContents, target: str, *, name: str = "mlp", bump: float = 0.0
) -> dict[str, bytes]:
    """The files of ``contents`` relabelled for ``target``; ``bump`` makes the weights unique."""
    config = {**contents.config, "target": target, "name": name}
    weights = {key: value + bump for key, value in contents.weights.items()} if bump else None
    changed = dataclasses.replace(contents, config=config, weights=weights or contents.weights)
    files = encode_files(changed)
    assert json.loads(files[mt.CONFIG_FILE])["target"] == target
    return files


def machine_target(offered: dict[str, object]) -> str:
    """The target of ``offered`` this machine's probe ranks first (skips when it runs none)."""
    from cuvil.artifact import probe_targets

    found = [target for target in probe_targets() if target in offered]
    if not found:
        pytest.skip(f"this machine ({probe_targets()}) runs none of {sorted(offered)}")
    return found[0]
