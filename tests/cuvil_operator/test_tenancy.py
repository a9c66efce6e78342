"""The push policy: repositories per namespace, and who may push with the shared credential.
Pure checks, then ``cuvil-operator`` against kmock refusing on the CR before anything is queued."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cuvil_operator.tenancy import PushPolicy, check_push
from cuvil_worker import contract

from tests.cuvil_operator.conftest import Operator, celery_env, get_mc, wait_for
from tests.fixtures.kube import KubeApi
from tests.fixtures.redis import RedisServer

POLICY = {
    "repositories": {"team-a": ["reg:5000/team-a/"], "*": ["reg:5000/shared/model"]},
    "sharedCredentials": ["team-a"],
}


def _spec(repository: str, secret: str | None = None) -> dict[str, Any]:
    output: dict[str, Any] = {"repository": repository, "tag": "v1"}
    if secret:
        output["pushSecretRef"] = {"name": secret}
    return {"output": output}


def test_repositories_per_namespace_and_the_shared_credential() -> None:
    policy = PushPolicy.from_json(json.dumps(POLICY))
    assert check_push(policy, "team-a", _spec("reg:5000/team-a/bert")) == []
    assert check_push(policy, "team-a", _spec("reg:5000/shared/model")) == []
    (refused,) = check_push(policy, "team-a", _spec("reg:5000/team-a-evil/bert"))
    assert refused.reason == "RepositoryNotAllowed" and "team-a-evil" in refused.message
    assert [r.reason for r in check_push(policy, "team-b", _spec("reg:5000/shared/model"))] == [
        "PushSecretRequired"
    ]
    assert check_push(policy, "team-b", _spec("reg:5000/shared/model", secret="b-push")) == []
    assert check_push(PushPolicy(), "anyone", _spec("anywhere:1/x")) == []


def test_oci_sources_per_namespace() -> None:
    policy = PushPolicy.from_json(json.dumps({"sources": {"team-a": ["reg:5000/team-a/"]}}))
    mine = {**_spec("r:1/x"), "source": {"oci": {"ref": "reg:5000/team-a/src@sha256:ab"}}}
    theirs = {**_spec("r:1/x"), "source": {"oci": {"ref": "reg:5000/team-b/src:v1"}}}
    assert check_push(policy, "team-a", mine) == []
    (refused,) = check_push(policy, "team-a", theirs)
    assert refused.reason == "SourceNotAllowed" and "reg:5000/team-b/src:v1" in refused.message
    assert check_push(policy, "team-b", theirs) == []  # no entry for team-b and none for *


def test_the_operator_refuses_a_repository_outside_the_namespace_set(
    kube_api: KubeApi, redis_server: RedisServer, tmp_path: Path
) -> None:
    policy = {"repositories": {"team-a": ["127.0.0.1:5000/models/team-a/"]}}
    env = {**celery_env(redis_server), **kube_api.env(), "CUVIL_OPERATOR_POLL_INTERVAL": "0.05",
           "CUVIL_OPERATOR_PUSH_POLICY": json.dumps(policy)}  # fmt: skip
    operator = Operator(env, tmp_path / "operator.log").start()
    try:
        kube_api.kubectl("apply", "--validate=false", "-n", "team-a",
                         "-f", "examples/minilm-cpu.yaml")  # fmt: skip

        def refused() -> dict[str, Any] | None:
            obj = get_mc(kube_api, "minilm-cpu", namespace="team-a")
            return obj if (obj or {}).get("status", {}).get("phase") == "Failed" else None

        failed = wait_for(refused, 30, "the refusal")
    finally:
        operator.stop()
    accepted = next(c for c in failed["status"]["conditions"] if c["type"] == "Accepted")
    assert (accepted["status"], accepted["reason"]) == ("False", "RepositoryNotAllowed")
    assert "127.0.0.1:5000/models/minilm" in accepted["message"]
    assert "127.0.0.1:5000/models/team-a/" in accepted["message"]
    app = contract.create_app(redis_server.url(0), redis_server.url(1))
    assert app.backend.client.keys("cuvil:submitted:*") == []
