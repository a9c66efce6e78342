"""The sidecar-injection webhook as the API server meets it: ``cuvil-operator`` serving HTTPS with
a mounted certificate, AdmissionReview v1 requests posted to it, the JSON patch it answers applied
to the pod and checked by ``kubernetes-validate --strict``. The compilation comes from the real
flow (kmock, Redis, the stub Celery worker)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from cuvil_operator.injection import CONTAINER_NAME

from tests.cuvil_operator import webhook_server
from tests.cuvil_operator.conftest import StubWorker, get_mc, wait_for
from tests.cuvil_operator.webhook_server import Webhook, build_pod, patched_pod
from tests.fixtures.kube import KubeApi
from tests.fixtures.redis import RedisServer
from tests.fixtures.validate import validate_strict

webhook, admitting_webhook = webhook_server.webhook, webhook_server.admitting_webhook


def _validate_strict(pod: dict[str, Any], tmp_path: Path) -> None:
    named = {**pod, "metadata": {**pod["metadata"], "name": "app-7d9f-x2k4q"}}
    named["metadata"].pop("generateName")
    manifest = tmp_path / "pod.yaml"
    manifest.write_text(yaml.safe_dump(named))
    checked = validate_strict(manifest)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def _succeeded(kube: KubeApi, redis: RedisServer, name: str = "minilm-two-targets") -> Any:
    from cuvil_worker import contract

    contract.create_app(redis.url(0), redis.url(1)).backend.client.set(
        "cuvil-stub:stage-seconds", "0.1"
    )
    kube.kubectl("apply", "--validate=false", "-f", "examples/two-targets.yaml")
    done = wait_for(
        lambda: (
            (get_mc(kube, name) or {}).get("status", {}).get("phase") == "Succeeded"
            and get_mc(kube, name)
        ),
        60,
        "Succeeded",
    )
    return done["status"]


def test_an_annotated_pod_gets_the_pinned_sidecar_over_https(
    kube_api: KubeApi,
    redis_server: RedisServer,
    stub_worker: StubWorker,
    webhook: Webhook,
    tmp_path: Path,
) -> None:
    status = _succeeded(kube_api, redis_server)
    pod = build_pod(**{"cuvil.dev/model": "minilm-two-targets", "cuvil.dev/cpu": "2"})
    patched = patched_pod(pod, webhook.review(pod))
    sidecar = next(c for c in patched["spec"]["containers"] if c["name"] == CONTAINER_NAME)
    env = {e["name"]: e["value"] for e in sidecar["env"] if "value" in e}
    assert env["CUVIL_MODEL"] == status["index"]["ref"]
    assert env["CUVIL_MODEL"].endswith("@" + status["digest"])
    assert env["CUVIL_TORCH_THREADS"] == "2"
    assert env["OTEL_SERVICE_NAME"] == "cuvil-sidecar"
    assert patched["spec"]["containers"][0] == pod["spec"]["containers"][0]
    assert patched["metadata"]["annotations"]["cuvil.dev/injected"] == env["CUVIL_MODEL"]
    assert env["CUVIL_EXIT_TIMEOUT_S"] == "60"  # and the pod's grace is raised to cover it
    assert patched["spec"]["terminationGracePeriodSeconds"] == 70
    _validate_strict(patched, tmp_path)

    # The admitted pods are counted where the compilation says it is served.
    for name, ready in (("app-1", "True"), ("app-2", "False")):
        created = {**patched, "metadata": {**patched["metadata"], "name": name,
                                           "namespace": "default"}}  # fmt: skip
        created["metadata"]["labels"] = {"cuvil.dev/model": "minilm-two-targets"}
        kube_api.create("v1", "pods", created)
        kube_api.request(
            "PATCH", kube_api.path("v1", "pods", "default", name) + "/status",
            {"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": ready}]}},
            content_type="application/merge-patch+json",
        )  # fmt: skip
    serving = [{"ref": env["CUVIL_MODEL"], "pods": 2, "ready": 1}]
    wait_for(
        lambda: (
            (get_mc(kube_api, "minilm-two-targets") or {}).get("status", {}).get("serving")
            == serving
        ),
        30,
        "status.serving to count the pods",
    )

    # The compilation is looked up in the pod's own namespace (the request's, not the pod's).
    response = webhook.review(build_pod(**{"cuvil.dev/model": "minilm-two-targets"}), "team-a")
    assert response["allowed"] is False
    assert "does not exist in the pod's namespace" in response["status"]["message"]

    # A named target pins that target's own manifest.
    pod = build_pod(**{"cuvil.dev/model": "minilm-two-targets", "cuvil.dev/target": "cpu-x86_64"})
    sidecar = patched_pod(pod, webhook.review(pod))["spec"]["containers"][1]
    artifact = next(a for a in status["artifacts"] if a["target"] == "cpu-x86_64")
    assert {"name": "CUVIL_MODEL", "value": artifact["ref"]} in sidecar["env"]

    # The label the chart's objectSelector matches names the compilation as well.
    pod = build_pod()
    pod["metadata"]["labels"] = {"cuvil.dev/model": "minilm-two-targets"}
    patched = patched_pod(pod, webhook.review(pod))
    assert patched["metadata"]["annotations"]["cuvil.dev/injected"] == status["index"]["ref"]
    # A pod naming no compilation passes as it is.
    response = webhook.review(build_pod(team="a"))
    assert response["allowed"] is True and "patch" not in response


def test_a_pod_naming_a_missing_or_unfinished_compilation_is_refused(
    kube_api: KubeApi, redis_server: RedisServer, webhook: Webhook
) -> None:
    response = webhook.review(build_pod(**{"cuvil.dev/model": "nope"}))
    assert response["allowed"] is False and "patch" not in response
    assert response["status"]["code"] == 403
    assert "ModelCompilation nope does not exist" in response["status"]["message"]
    # queued, with no worker to run it: not servable yet
    kube_api.kubectl("apply", "--validate=false", "-f", "examples/minilm-cpu.yaml")
    wait_for(lambda: (get_mc(kube_api, "minilm-cpu") or {}).get("status"), 30, "a status")
    response = webhook.review(build_pod(**{"cuvil.dev/model": "minilm-cpu"}))
    assert response["allowed"] is False
    assert "has no artifact to serve yet (phase Pending)" in response["status"]["message"]
    # a malformed annotation is refused whatever the setting, naming it
    response = webhook.review(build_pod(**{"cuvil.dev/model": "m", "cuvil.dev/cpu": "lots"}))
    assert response["status"]["code"] == 400 and "cuvil.dev/cpu" in response["status"]["message"]


def test_admit_setting_lets_the_pod_through_unchanged_with_a_warning(
    kube_api: KubeApi, admitting_webhook: Webhook
) -> None:
    response = admitting_webhook.review(build_pod(**{"cuvil.dev/model": "nope"}))
    assert response["allowed"] is True and "patch" not in response
    assert any("does not exist" in w for w in response["warnings"]), response
