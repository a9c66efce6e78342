"""Per-namespace push credentials: each compilation pushes with the Secret its
``spec.output.pushSecretRef`` names, read from its own namespace; the worker has no credential
of its own. kmock as the API, ``cuvil-operator``, real Redis, the htpasswd registry and a real
``cuvil-worker``."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest

from tests.cuvil_operator.compilations import app, apply, mlp_compilation, workers
from tests.cuvil_operator.conftest import Operator, get_mc, wait_for
from tests.fixtures.kube import KubeApi
from tests.fixtures.registry import RunningRegistry, auth_registry

__all__ = ["app", "auth_registry", "workers"]
pytestmark = pytest.mark.slow


def _secret(kube: KubeApi, namespace: str, host: str, user: str, password: str) -> None:
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    config = json.dumps({"auths": {host: {"auth": token}}})
    kube.create("v1", "secrets", {
        "apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/dockerconfigjson",
        "metadata": {"name": "push", "namespace": namespace},
        "data": {".dockerconfigjson": base64.b64encode(config.encode()).decode()},
    })  # fmt: skip


def _done(kube: KubeApi, namespace: str) -> dict[str, Any] | None:
    obj = get_mc(kube, "pushed", namespace=namespace)
    phase = (obj or {}).get("status", {}).get("phase")
    return obj if phase in ("Succeeded", "Failed") else None


def test_each_namespace_pushes_with_its_own_secret(
    kube_api: KubeApi,
    auth_registry: RunningRegistry,
    running_operator: Operator,
    workers: Any,
    tmp_path: Path,
) -> None:
    assert auth_registry.username and auth_registry.password
    _secret(kube_api, "team-good", auth_registry.host, auth_registry.username,
            auth_registry.password)  # fmt: skip
    _secret(kube_api, "team-bad", auth_registry.host, "intruder", "not-the-password")
    worker = workers("no-credentials")
    repositories = {}
    for namespace in ("team-good", "team-bad"):
        obj = mlp_compilation("pushed", auth_registry)
        obj["metadata"]["namespace"] = namespace
        obj["spec"]["output"]["pushSecretRef"] = {"name": "push"}
        repositories[namespace] = obj["spec"]["output"]["repository"]
        apply(kube_api, obj, tmp_path)
    good = wait_for(lambda: _done(kube_api, "team-good"), 120, "team-good's compile")
    bad = wait_for(lambda: _done(kube_api, "team-bad"), 120, "team-bad's compile")
    assert good["status"]["phase"] == "Succeeded", good["status"].get("message")
    assert bad["status"]["phase"] == "Failed"
    pushed = next(c for c in bad["status"]["conditions"] if c["type"] == "Pushed")
    assert (pushed["status"], pushed["reason"]) == ("False", "PushRefused"), pushed
    assert "'intruder'" in pushed["message"], pushed["message"]
    assert auth_registry.manifests(repositories["team-bad"]) == set()
    assert good["status"]["digest"] in auth_registry.manifests(repositories["team-good"])
    for log in (worker.log, running_operator.text()):
        assert auth_registry.password not in log and "not-the-password" not in log
