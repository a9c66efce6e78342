"""The operator's sidecar-injection webhook as a test meets it: ``cuvil-operator`` serving HTTPS
with a self-signed certificate (as the chart's Secret holds one), and AdmissionReview v1 requests
posted to it as the API server sends them.

    from tests.cuvil_operator import webhook_server
    webhook = webhook_server.webhook  # the fixture, in the test module
"""

from __future__ import annotations

import base64
import json
import ssl
import subprocess
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonpatch
import pytest

from tests.cuvil_operator.conftest import Operator, celery_env, wait_for
from tests.fixtures.kube import KubeApi
from tests.fixtures.ports import free_port
from tests.fixtures.redis import RedisServer

SIDECAR_ENV = {"CUVIL_METRICS_PORT": "8002", "OTEL_SERVICE_NAME": "cuvil-sidecar"}


@dataclass
class Webhook:
    url: str
    context: ssl.SSLContext
    operator: Operator

    def review(self, pod: dict[str, Any], namespace: str = "default") -> dict[str, Any]:
        """Post the AdmissionReview the API server sends for a pod a ReplicaSet creates."""
        gvr = {"group": "", "version": "v1", "resource": "pods"}
        review = {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": str(uuid.uuid4()),
                "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": gvr,
                "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
                "requestResource": gvr,
                "namespace": namespace,
                "operation": "CREATE",
                "userInfo": {
                    "username": "system:serviceaccount:kube-system:replicaset-controller",
                    "groups": ["system:serviceaccounts", "system:authenticated"],
                },
                "object": pod,
                "oldObject": None,
                "dryRun": False,
                "options": {"kind": "CreateOptions", "apiVersion": "meta.k8s.io/v1"},
            },
        }
        request = urllib.request.Request(
            f"{self.url}/sidecar",
            data=json.dumps(review).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=30, context=self.context) as response:
            answer: dict[str, Any] = json.loads(response.read())
        assert answer["kind"] == "AdmissionReview"
        assert answer["response"]["uid"] == review["request"]["uid"]
        return dict(answer["response"])


def _self_signed(folder: Path) -> Path:
    """tls.crt and tls.key for 127.0.0.1, as the chart's Secret holds them."""
    folder.mkdir()
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(folder / "tls.key"), "-out", str(folder / "tls.crt")],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return folder


def _listening(url: str, context: ssl.SSLContext) -> bool:
    try:
        urllib.request.urlopen(url + "/", timeout=2, context=context)
    except urllib.error.HTTPError:
        return True  # kopf answers GET with 405: it is up
    except OSError:
        return False
    return True


def _start(kube: KubeApi, redis: RedisServer, tmp_path: Path, **settings: str) -> Iterator[Webhook]:
    certs = _self_signed(tmp_path / "webhook-tls")
    port = free_port()
    env = {
        **celery_env(redis),
        **kube.env(),
        "CUVIL_OPERATOR_POLL_INTERVAL": "0.05",
        "CUVIL_WEBHOOK_LISTEN": f"127.0.0.1:{port}",
        "CUVIL_WEBHOOK_CERT_DIR": str(certs),
        "CUVIL_INJECT_IMAGE": "registry.example.com/cuvil-sidecar:0.1.0",
        "CUVIL_INJECT_ENV": json.dumps(SIDECAR_ENV),
        **settings,
    }
    operator = Operator(env, tmp_path / "operator.log").start()
    context = ssl.create_default_context(cafile=str(certs / "tls.crt"))
    url = f"https://127.0.0.1:{port}"
    try:
        wait_for(lambda: _listening(url, context), 60, "the webhook server")
        yield Webhook(url, context, operator)
    finally:
        operator.stop()
        print(operator.text()[-6000:])  # shown on failure


@pytest.fixture
def webhook(kube_api: KubeApi, redis_server: RedisServer, tmp_path: Path) -> Iterator[Webhook]:
    """Injecting sidecars that drain for 60 s after SIGTERM (their pods' grace follows)."""
    injected = {**SIDECAR_ENV, "CUVIL_EXIT_TIMEOUT_S": "60"}
    yield from _start(kube_api, redis_server, tmp_path, CUVIL_INJECT_ENV=json.dumps(injected))


@pytest.fixture
def admitting_webhook(
    kube_api: KubeApi, redis_server: RedisServer, tmp_path: Path
) -> Iterator[Webhook]:
    yield from _start(kube_api, redis_server, tmp_path, CUVIL_INJECT_UNSERVED="admit")


def build_pod(**annotations: str) -> dict[str, Any]:
    """A pod as a ReplicaSet sends it: generateName, no name, no namespace yet."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"generateName": "app-7d9f-", "annotations": annotations},
        "spec": {"containers": [{"name": "app", "image": "example/app:1"}]},
    }


def patched_pod(pod: dict[str, Any], response: dict[str, Any]) -> dict[str, Any]:
    assert response["allowed"] is True, response
    assert response["patchType"] == "JSONPatch"
    ops = json.loads(base64.b64decode(response["patch"]))
    return dict(jsonpatch.apply_patch(pod, ops))
