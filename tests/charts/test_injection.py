"""The chart's sidecar-injection webhook: its configuration, Service, certificate, and the
operator settings that serve it (operator/cuvil_operator/webhook.py reads them)."""

from __future__ import annotations

import base64
import subprocess
from pathlib import Path
from typing import Any

import yaml
from cuvil_operator.injection import InjectionSettings, read_request
from cuvil_operator.webhook import WEBHOOK_ID, WebhookSettings

from tests.charts.conftest import CHART, NAMESPACE, ROOT, Render
from tests.fixtures.validate import validate_strict

INJECTION = CHART / "ci" / "injection-values.yaml"


def _one(manifests: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [m for m in manifests if m["kind"] == kind and name in (None, m["metadata"]["name"])]
    assert len(found) == 1, [m["metadata"]["name"] for m in found]
    return found[0]


def _operator_env(manifests: list[dict[str, Any]]) -> dict[str, str]:
    deployment = _one(manifests, "Deployment", "cuvil-operator")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def _grants_pods(manifests: list[dict[str, Any]]) -> bool:
    return any(
        "pods" in rule["resources"]
        for m in manifests
        if m["kind"] in ("Role", "ClusterRole")
        for rule in m["rules"]
    )


def test_off_by_default(render: Render) -> None:
    manifests = render()
    assert not [m for m in manifests if m["kind"] == "MutatingWebhookConfiguration"]
    assert "CUVIL_WEBHOOK_LISTEN" not in _operator_env(manifests)
    assert not _grants_pods(manifests)


def test_on_the_operator_may_watch_pods_to_count_where_models_are_served(render: Render) -> None:
    assert _grants_pods(render(INJECTION))


def test_webhook_configuration_selects_labelled_pods_and_reaches_the_operator(
    render: Render,
) -> None:
    manifests = render(INJECTION)
    config = _one(manifests, "MutatingWebhookConfiguration")
    (hook,) = config["webhooks"]
    assert hook["sideEffects"] == "None" and hook["admissionReviewVersions"] == ["v1"]
    assert hook["failurePolicy"] == "Ignore" and hook["timeoutSeconds"] == 3
    assert hook["rules"] == [
        {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
         "resources": ["pods"], "scope": "Namespaced"}
    ]  # fmt: skip
    assert hook["objectSelector"] == {
        "matchExpressions": [{"key": "cuvil.dev/model", "operator": "Exists"}]
    }
    selector = hook["namespaceSelector"]
    assert selector["matchLabels"] == {"cuvil.dev/injection": "enabled"}
    assert {"key": "kubernetes.io/metadata.name", "operator": "NotIn",
            "values": [NAMESPACE, "kube-system"]} in selector["matchExpressions"]  # fmt: skip
    # the Service the API server calls leads to the operator's webhook port, at kopf's path
    service = hook["clientConfig"]["service"]
    assert service["path"] == f"/{WEBHOOK_ID}" and service["namespace"] == NAMESPACE
    svc = _one(manifests, "Service", service["name"])
    assert svc["spec"]["ports"][0]["port"] == service["port"] == 443
    deployment = _one(manifests, "Deployment", "cuvil-operator")
    pod = deployment["spec"]["template"]
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    port = next(p for p in container["ports"] if p["name"] == svc["spec"]["ports"][0]["targetPort"])
    env = _operator_env(manifests)
    webhook = WebhookSettings.from_env(env)
    assert webhook is not None and webhook.port == port["containerPort"]
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == str(webhook.cert_dir))
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["secretName"] == "cuvil-webhook-tls"


def test_self_signed_certificate_names_the_service_and_its_ca_is_the_bundle(
    render: Render, tmp_path: Path
) -> None:
    manifests = render(INJECTION)
    secret = _one(manifests, "Secret", "cuvil-webhook-tls")
    bundle = _one(manifests, "MutatingWebhookConfiguration")["webhooks"][0]["clientConfig"]
    assert bundle["caBundle"] == secret["data"]["ca.crt"]
    for key in ("tls.crt", "ca.crt"):
        (tmp_path / key).write_bytes(base64.b64decode(secret["data"][key]))
    checked = subprocess.run(
        ["openssl", "verify", "-CAfile", str(tmp_path / "ca.crt"), str(tmp_path / "tls.crt")],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert checked.returncode == 0, checked.stderr
    names = subprocess.run(
        ["openssl", "x509", "-noout", "-ext", "subjectAltName", "-in", str(tmp_path / "tls.crt")],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout  # fmt: skip
    assert f"DNS:cuvil-webhook.{NAMESPACE}.svc" in names


def test_cert_manager_issues_the_certificate_and_injects_its_ca(render: Render) -> None:
    manifests = render(
        INJECTION,
        sets=("injection.tls.certManager.enabled=true",
              "injection.tls.certManager.issuerRef.name=cluster-ca",
              "injection.tls.certManager.issuerRef.kind=ClusterIssuer"),
    )  # fmt: skip
    certificate = _one(manifests, "Certificate")
    assert certificate["spec"]["secretName"] == "cuvil-webhook-tls"
    assert certificate["spec"]["issuerRef"] == {"name": "cluster-ca", "kind": "ClusterIssuer"}
    config = _one(manifests, "MutatingWebhookConfiguration")
    annotation = config["metadata"]["annotations"]["cert-manager.io/inject-ca-from"]
    assert annotation == f"{NAMESPACE}/cuvil-webhook"
    secrets = [m["metadata"]["name"] for m in manifests if m["kind"] == "Secret"]
    assert "cuvil-webhook-tls" not in secrets


def test_injected_sidecars_get_the_sidecar_settings_the_configmap_holds(render: Render) -> None:
    manifests = render(INJECTION, CHART / "ci" / "sidecar-config-values.yaml")
    settings = InjectionSettings.from_env(_operator_env(manifests))
    data = _one(manifests, "ConfigMap", "cuvil-sidecar")["data"]
    # per pod: the model, and files the webhook mounts itself (pull Secret, trusted keys)
    per_pod = {"CUVIL_MODEL", "CUVIL_MODEL_NAME", "CUVIL_REGISTRY_CONFIG", "CUVIL_TRUSTED_KEYS"}
    per_pod.add("HOME")
    assert dict(settings.env) == {k: v for k, v in data.items() if k not in per_pod}
    assert settings.env["CUVIL_MAX_BATCH_SIZE"] == "16"
    assert (
        settings.env["OTEL_EXPORTER_OTLP_ENDPOINT"]
        == "http://otel-collector.observability.svc:4317"
    )
    assert settings.unserved == "admit" and settings.cache_host_path == "/var/cache/cuvil"
    assert settings.registry_secret == "registry-pull"
    # signatures are checked in injected pods too, with the keys the snippet mounts
    assert settings.env["CUVIL_TRUST_POLICY"] == "require"
    assert settings.trusted_keys == "cuvil-trusted-keys"
    assert settings.image.startswith("ghcr.io/cuvil/cuvil-sidecar:")


def test_example_app_is_valid_and_selected_by_the_webhook(tmp_path: Path) -> None:
    example = ROOT / "examples" / "apps" / "minilm-app.yaml"
    checked = validate_strict(example)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    template = yaml.safe_load(example.read_text())["spec"]["template"]
    request = read_request(template["metadata"]["annotations"], template["metadata"]["labels"])
    assert request.model == "minilm-cpu" and request.threads == 2
    compilation = yaml.safe_load((ROOT / "examples" / "minilm-cpu.yaml").read_text())
    assert compilation["metadata"]["name"] == request.model
    assert request.target in compilation["spec"]["targets"]


def test_injected_sidecars_get_the_sidecars_tls_and_token_secrets(render: Render) -> None:
    sets = ("sidecar.tls.existingSecret=minilm-serving-tls", "sidecar.tls.clientCA=true",
            "sidecar.auth.tokensSecret=minilm-tokens")  # fmt: skip
    settings = InjectionSettings.from_env(_operator_env(render(INJECTION, sets=sets)))
    assert settings.tls_secret == "minilm-serving-tls" and settings.tls_client_ca
    assert settings.tokens_secret == "minilm-tokens"
    plain = InjectionSettings.from_env(_operator_env(render(INJECTION)))
    assert plain.tls_secret is None and plain.tokens_secret is None


def test_token_checked_probes_are_refused_with_injection(helm_run: Any) -> None:
    done = helm_run(
        "template", "cuvil", str(CHART), "-f", str(INJECTION),
        "--set", "sidecar.auth.tokensSecret=minilm-tokens", "--set", "sidecar.auth.health=required",
    )  # fmt: skip
    assert done.returncode != 0 and "fails the kubelet's probes" in done.stderr


def test_a_role_lets_app_sidecars_publish_measurements_on_their_own_pods(render: Render) -> None:
    role = _one(render(INJECTION), "ClusterRole", "cuvil-sidecar-measurement")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"]}]
    scoped = render(INJECTION, sets=("operator.watchNamespace=team-a",))
    assert _one(scoped, "Role", "cuvil-sidecar-measurement")["metadata"]["namespace"] == "team-a"
    off = render(INJECTION, sets=("injection.measurementRole=false",))
    assert not [m for m in off if m["metadata"]["name"] == "cuvil-sidecar-measurement"]


def test_canary_example_is_valid_and_pins_the_candidate(render: Render) -> None:
    example = ROOT / "examples" / "apps" / "minilm-gpu-canary.yaml"
    checked = validate_strict(example)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    docs = list(yaml.safe_load_all(example.read_text()))
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    template = deployment["spec"]["template"]
    request = read_request(template["metadata"]["annotations"], template["metadata"]["labels"])
    assert request.track == "candidate" and request.gpus == 1 and request.target == "cuda-sm_90"
    compilation = yaml.safe_load((ROOT / "examples" / "minilm-edge-gpus.yaml").read_text())
    assert compilation["metadata"]["name"] == request.model
    assert request.target in compilation["spec"]["targets"]
    binding = next(d for d in docs if d["kind"] == "RoleBinding")
    role = _one(render(INJECTION), "ClusterRole", binding["roleRef"]["name"])
    assert role["rules"][0]["verbs"] == ["patch"]
    assert binding["subjects"][0]["name"] == template["spec"]["serviceAccountName"]
