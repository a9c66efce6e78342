"""The node cache against the real registry: tampering, outages, concurrency, offline loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cuvil.artifact import (
    DigestMismatchError,
    RegistryUnavailableError,
    push_artifact,
)
from cuvil.artifact import media_types as mt
from cuvil.artifact.api import resolve
from cuvil.artifact.cache import NodeCache
from cuvil.artifact.files import ArtifactContents
from cuvil.artifact.manifests import sha256_digest
from cuvil.artifact.registry_config import RegistryConfig
from cuvil.runtime.model import load
from tests.cuvil.artifact.conftest import artifact_files
from tests.fixtures.registry import RunningRegistry

NO_CREDENTIALS = RegistryConfig(docker_config=None)
REPO_ROOT = Path(__file__).resolve().parents[3]


def _tamper(path: Path) -> None:
    os.chmod(path, 0o644)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_tampered_cache_entry_is_refused_and_fetched_again(
    registry: RunningRegistry, tiny_contents: ArtifactContents, tmp_path: Path
) -> None:
    files = artifact_files(tiny_contents, "cpu-x86_64", name="cache-tamper")
    pushed = push_artifact(
        files, f"{registry.host}/cache/tamper:v1", registry_config=NO_CREDENTIALS
    )
    first = resolve(pushed.ref, cache_dir=tmp_path)
    _tamper(first.path / mt.WEIGHTS_FILE)

    again = resolve(pushed.ref, cache_dir=tmp_path)  # detected, dropped, downloaded again
    assert again.downloaded
    assert (again.path / mt.WEIGHTS_FILE).read_bytes() == files[mt.WEIGHTS_FILE]

    _tamper(again.path / mt.GRAPH_FILE)
    registry.stop()
    try:
        with pytest.raises(RegistryUnavailableError):
            resolve(pushed.ref, cache_dir=tmp_path)
    finally:
        registry.start()
    assert not NodeCache(tmp_path).entry_path(pushed.digest).exists()  # nothing corrupt kept


def test_tampered_blob_served_by_registry_is_refused(
    registry: RunningRegistry, tiny_contents: ArtifactContents, tmp_path: Path
) -> None:
    files = artifact_files(tiny_contents, "cpu-x86_64", name="served-tamper", bump=0.5)
    pushed = push_artifact(
        files, f"{registry.host}/cache/served:v1", registry_config=NO_CREDENTIALS
    )
    blob = registry.blob_data_path(sha256_digest(files[mt.WEIGHTS_FILE]))
    original = blob.read_bytes()
    try:
        _tamper(blob)
        with pytest.raises(DigestMismatchError, match="refused"):
            resolve(pushed.ref, cache_dir=tmp_path / "cache")
    finally:
        blob.write_bytes(original)
    assert not NodeCache(tmp_path / "cache").entry_path(pushed.digest).exists()
    assert resolve(pushed.ref, cache_dir=tmp_path / "cache").downloaded


def test_stopped_registry_is_a_retryable_error_then_the_same_call_succeeds(
    registry: RunningRegistry, tiny_contents: ArtifactContents, tmp_path: Path
) -> None:
    files = artifact_files(tiny_contents, "cpu-x86_64", name="outage")
    push_artifact(files, f"{registry.host}/cache/outage:v1", registry_config=NO_CREDENTIALS)
    ref = f"{registry.host}/cache/outage:v1"
    registry.stop()
    try:
        started = time.monotonic()
        with pytest.raises(RegistryUnavailableError, match=r"unavailable.*retryable") as caught:
            resolve(ref, cache_dir=tmp_path, registry_config=NO_CREDENTIALS)
        assert caught.value.retryable and isinstance(caught.value, ConnectionError)
        assert time.monotonic() - started < 10
    finally:
        registry.start()
    assert resolve(ref, cache_dir=tmp_path, registry_config=NO_CREDENTIALS).downloaded


def test_cached_digest_loads_offline(
    registry: RunningRegistry, tiny_contents: ArtifactContents, tmp_path: Path
) -> None:
    files = artifact_files(tiny_contents, "cpu-x86_64", name="offline")
    pushed = push_artifact(
        files, f"{registry.host}/cache/offline:v1", registry_config=NO_CREDENTIALS
    )
    tag_ref = f"{registry.host}/cache/offline:v1"
    assert resolve(tag_ref, cache_dir=tmp_path).downloaded
    registry.stop()
    try:
        by_digest = resolve(pushed.ref, cache_dir=tmp_path)
        by_tag = resolve(tag_ref, cache_dir=tmp_path)
    finally:
        registry.start()
    assert not by_digest.downloaded and by_digest.path == by_tag.path
    assert by_tag.offline
    model = load(by_digest.path)
    assert model(torch.randn(2, 8)).shape == (2, 4)


WORKER = """
import json, sys, time
from pathlib import Path
from cuvil.artifact.api import resolve
go = Path(sys.argv[3])
Path(sys.argv[3] + "-ready-" + sys.argv[4]).touch()
while not go.exists():
    time.sleep(0.01)
result = resolve(sys.argv[1], cache_dir=sys.argv[2])
print(json.dumps({"path": str(result.path), "downloaded": result.downloaded}))
"""


def test_two_processes_pulling_at_once_download_once(
    registry: RunningRegistry, tiny_contents: ArtifactContents, tmp_path: Path
) -> None:
    files = artifact_files(tiny_contents, "cpu-x86_64", name="concurrent", bump=1.5)
    pushed = push_artifact(
        files, f"{registry.host}/cache/concurrent:v1", registry_config=NO_CREDENTIALS
    )
    go = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "CUVIL_REGISTRY_CONFIG": "/nonexistent"}
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, pushed.ref, str(tmp_path / "cache"), str(go), str(n)],
            stdout=subprocess.PIPE,
            env=env,
        )
        for n in range(2)
    ]
    deadline = time.monotonic() + 120
    while not all(Path(f"{go}-ready-{n}").exists() for n in range(2)):
        assert time.monotonic() < deadline, "workers did not start"
        time.sleep(0.05)
    # Hold the digest's lock while both start: both then race for it the moment it is free
    # (without the cache's locking, both would download while we hold it).
    with NodeCache(tmp_path / "cache").lock(pushed.digest):
        go.touch()
        time.sleep(1.0)
    results = [json.loads(worker.communicate(timeout=120)[0]) for worker in workers]
    assert all(worker.returncode == 0 for worker in workers)
    assert results[0]["path"] == results[1]["path"]
    assert sorted(r["downloaded"] for r in results) == [False, True]
    weights = sha256_digest(files[mt.WEIGHTS_FILE])
    assert len(registry.requests(rf'"GET /v2/cache/concurrent/blobs/{weights}')) == 1
    assert Path(results[0]["path"], mt.WEIGHTS_FILE).read_bytes() == files[mt.WEIGHTS_FILE]
