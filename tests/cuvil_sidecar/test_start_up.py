"""Start and stay up, with the real Debian docker-registry: a sidecar given a tag starts from its
node cache while the registry is down (its log says so), and a sidecar whose first load fails
(the registry down, the tag never pulled here) keeps trying with backoff and becomes ready by
itself once the registry is back with the artifact."""

from __future__ import annotations

from pathlib import Path

import tritonclient.grpc as grpcclient

from cuvil.artifact import push_artifact
from tests.cuvil_sidecar.conftest import Sidecar
from tests.cuvil_sidecar.test_forged import readiness
from tests.fixtures.registry import RunningRegistry, _require_binary

ENVIRONMENT = {"CUVIL_GRPC_FRONTEND": "grpcio", "CUVIL_START_RETRY_MAX_S": "2"}


def _registry(folder: Path) -> RunningRegistry:
    _require_binary()
    running = RunningRegistry(folder)
    running.start()
    return running


def test_a_tag_starts_from_the_node_cache_while_the_registry_is_down(
    mlp_artifact: Path, tmp_path: Path
) -> None:
    registry = _registry(tmp_path / "registry")
    ref = f"{registry.host}/startup/mlp:v1"
    cache = str(tmp_path / "cache")
    try:
        pushed = push_artifact(mlp_artifact, ref)
        first = Sidecar(ref, tmp_path / "first.log", CUVIL_CACHE_DIR=cache, **ENVIRONMENT)
        try:
            first.wait_ready(grpcclient.InferenceServerClient(first.url))
        finally:
            first.stop()
    finally:
        registry.stop()
    again = Sidecar(ref, tmp_path / "again.log", CUVIL_CACHE_DIR=cache, **ENVIRONMENT)
    try:
        again.wait_ready(grpcclient.InferenceServerClient(again.url), timeout_s=120)
        log = again.log()
    finally:
        again.stop()
    assert f"last resolved to {pushed.digest} on this node" in log, log[-3000:]


def test_a_failed_first_load_is_tried_again_until_it_serves(
    mlp_artifact: Path, tmp_path: Path
) -> None:
    registry = RunningRegistry(tmp_path / "registry")  # not started: the registry is down
    ref = f"{registry.host}/startup/later:v1"
    sidecar = Sidecar(ref, tmp_path / "sidecar.log", CUVIL_CACHE_DIR=str(tmp_path / "c"),
                      **ENVIRONMENT)  # fmt: skip
    client = grpcclient.InferenceServerClient(sidecar.url)
    try:
        sidecar.wait_until(lambda: "next try in" in readiness(sidecar)[1], 60)
        assert not client.is_server_ready()
        _require_binary()
        registry.start()
        push_artifact(mlp_artifact, ref)
        sidecar.wait_ready(client, timeout_s=120)
        log = sidecar.log()
    finally:
        sidecar.stop()
        registry.stop()
    assert log.count("the first load failed; trying again") >= 1, log[-3000:]
