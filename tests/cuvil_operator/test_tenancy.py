"""The push policy: repositories per namespace, who may push with the shared credential, and
the sources (OCI prefixes, URL allowlist) a namespace may compile from. Pure checks, then
``cuvil-operator`` against kmock refusing on the CR before anything is queued, and compiling a
URL source inside the allowlist with a real worker fetching it from a loopback HTTP server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cuvil_operator.tenancy import PushPolicy, check_push
from cuvil_worker import contract

from tests.cuvil_operator.compilations import apply, mlp_compilation, workers
from tests.cuvil_operator.conftest import Operator, celery_env, get_mc, wait_for
from tests.cuvil_worker.test_sources import TEXT_INPUTS, tiny_bert
from tests.fixtures.http_files import bundle_members, served, write_tar
from tests.fixtures.kube import KubeApi
from tests.fixtures.redis import RedisServer
from tests.fixtures.registry import RunningRegistry, registry

__all__ = ["registry", "served", "tiny_bert", "workers"]

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


def test_url_sources_only_under_the_namespace_allowlist() -> None:
    allowed = ["https://models.example.com/team-a/", "https://other.example.com:8443/one.tar"]
    policy = PushPolicy.from_json(json.dumps({"urls": {"team-a": allowed}}))

    def refused(namespace: str, url: str) -> list[str]:
        spec = {**_spec("r:1/x"), "source": {"url": url}}
        return [f"{r.reason} {r.field}" for r in check_push(policy, namespace, spec)]

    assert refused("team-a", "https://models.example.com/team-a/bert.tar.gz") == []
    assert (
        refused("team-a", "HTTPS://Models.Example.com/team-a/bert.tar.gz#sha256=" + "a" * 64) == []
    )
    assert refused("team-a", "https://other.example.com:8443/one.tar") == []
    for outside in (
        "https://models.example.com/team-b/bert.tar.gz",
        "https://models.example.com/team-a-evil/bert.tar.gz",
        "http://models.example.com/team-a/bert.tar.gz",  # not the scheme allowed
        "https://models.example.com:444/team-a/bert.tar.gz",
        "https://models.example.com.evil.org/team-a/bert.tar.gz",
        "https://other.example.com:8443/one.tar/more",
    ):
        assert refused("team-a", outside) == ["SourceNotAllowed spec.source.url"], outside
    # No entry for a namespace (and none for "*"): no URL at all.
    (refusal,) = check_push(policy, "team-b", {**_spec("r:1/x"), "source": {"url": allowed[0]}})
    assert "may not compile from https://models.example.com/team-a/" in refusal.message
    assert "(allowed: no URL)" in refusal.message


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


def test_a_url_source_compiles_inside_the_allowlist_and_is_refused_outside_it(
    kube_api: KubeApi,
    redis_server: RedisServer,
    registry: RunningRegistry,
    workers: Any,
    served: tuple[str, Path],
    tiny_bert: Path,
    tmp_path: Path,
) -> None:
    base, www = served
    (www / "team-a").mkdir()
    write_tar(www / "team-a" / "tiny-bert.tar.gz", bundle_members(tiny_bert, folder="tiny-bert"))
    policy = {"urls": {"team-a": [f"{base}/team-a/"]}}
    env = {**celery_env(redis_server), **kube_api.env(), "CUVIL_OPERATOR_POLL_INTERVAL": "0.05",
           "CUVIL_OPERATOR_PUSH_POLICY": json.dumps(policy)}  # fmt: skip
    compilations = {
        "inside": mlp_compilation("inside", registry, **TEXT_INPUTS,
                                  source={"url": f"{base}/team-a/tiny-bert.tar.gz"}),
        "outside": mlp_compilation("outside", registry, **TEXT_INPUTS,
                                   source={"url": f"{base}/team-b/tiny-bert.tar.gz"}),
    }  # fmt: skip
    operator = Operator(env, tmp_path / "operator.log").start()
    try:
        workers("urls")
        for obj in compilations.values():
            obj["metadata"]["namespace"] = "team-a"
            apply(kube_api, obj, tmp_path)

        def ended(name: str) -> dict[str, Any] | None:
            obj = get_mc(kube_api, name, namespace="team-a")
            phase = (obj or {}).get("status", {}).get("phase")
            return obj if phase in ("Succeeded", "Failed") else None

        outside = wait_for(lambda: ended("outside"), 30, "the refusal")
        inside = wait_for(lambda: ended("inside"), 180, "the URL compile")
    finally:
        operator.stop()
    accepted = next(c for c in outside["status"]["conditions"] if c["type"] == "Accepted")
    assert (accepted["status"], accepted["reason"]) == ("False", "SourceNotAllowed")
    assert (
        f"spec.source.url: namespace team-a may not compile from {base}/team-b/"
        in (accepted["message"])
    )
    assert inside["status"]["phase"] == "Succeeded", inside["status"].get("message")
    (artifact,) = inside["status"]["artifacts"]
    repository = compilations["inside"]["spec"]["output"]["repository"]
    assert artifact["digest"] in registry.manifests(repository)
