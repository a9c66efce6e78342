"""What the chart renders: secure defaults, least-privilege RBAC, one worker per queue entry,
and settings that match what the deployables read."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from cuvil_operator.crd import GROUP, PLURAL, TARGETS
from cuvil_worker.contract import queue_for_target

from tests.charts.conftest import CHART, CI_VALUES, ROOT, HelmRun, Render, pod_specs
from tests.fixtures.validate import validate_strict

VARIANTS = [pytest.param(path, id=path.stem) for path in CI_VALUES]


@pytest.fixture(scope="module", params=VARIANTS)
def rendered(request: pytest.FixtureRequest, render: Render) -> list[dict[str, Any]]:
    return render(request.param)


def test_every_pod_runs_with_the_secure_defaults(rendered: list[dict[str, Any]]) -> None:
    pods = pod_specs(rendered)
    assert pods
    for where, pod in pods:
        context = pod["securityContext"]
        assert context["runAsNonRoot"] is True, where
        assert context["runAsUser"] > 0, where
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}, where
        assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
        volumes = {volume["name"]: volume for volume in pod.get("volumes", [])}
        assert not [v for v in volumes.values() if "hostPath" in v], where
        for container in pod["containers"] + pod.get("initContainers", []):
            sc = container["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc["runAsNonRoot"] is True, where
            assert sc["capabilities"] == {"drop": ["ALL"]}, where
            assert sc["seccompProfile"] == {"type": "RuntimeDefault"}, where
            assert not sc.get("privileged"), where
            # a read-only root needs writable scratch: /tmp is an emptyDir
            mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            assert "emptyDir" in volumes[mounts["/tmp"]], where
            assert container["resources"].get("limits", {}).get("memory"), where
        # only the operator talks to the Kubernetes API
        wants_token = where.endswith("-operator")
        assert pod["automountServiceAccountToken"] is wants_token, where


ALLOWED_VERBS = {
    (GROUP, PLURAL): {"get", "list", "watch", "patch"},
    (GROUP, f"{PLURAL}/status"): {"patch"},
    ("", "events"): {"create"},
    ("", "secrets"): {"get"},  # push Secrets by name (operator.pushSecrets); never list/watch
    ("", "pods"): {"list", "watch", "patch"},  # injection.enabled: serving counts, rollout
    ("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"},
    ("", "namespaces"): {"list", "watch"},
    ("kopf.dev", "kopfpeerings"): {"get", "list", "watch", "patch"},
    ("kopf.dev", "clusterkopfpeerings"): {"get", "list", "watch", "patch"},
}


def _rules(rendered: list[dict[str, Any]], kind: str) -> list[tuple[str, str, set[str]]]:
    return [
        (group, resource, set(rule["verbs"]))
        for m in rendered
        if m["kind"] == kind
        for rule in m["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    ]


def test_rbac_is_least_privilege(rendered: list[dict[str, Any]]) -> None:
    roles = [m for m in rendered if m["kind"] in ("Role", "ClusterRole")]
    assert roles
    for role in roles:
        for rule in role["rules"]:
            for field in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule[field], (role["metadata"]["name"], rule)
            assert not rule.get("nonResourceURLs")
            assert not rule.get("resourceNames")
    for kind in ("Role", "ClusterRole"):
        for group, resource, verbs in _rules(rendered, kind):
            allowed = ALLOWED_VERBS.get((group, resource))
            assert allowed is not None, f"{kind} grants {group}/{resource}"
            assert verbs <= allowed, f"{kind} grants {verbs - allowed} on {group}/{resource}"
    values = _values_of(rendered)
    cluster = {(g, r) for g, r, _ in _rules(rendered, "ClusterRole")}
    namespaced = {(g, r) for g, r, _ in _rules(rendered, "Role")}
    if values["watchNamespace"]:
        # one namespace: the CRs in a Role there; only CRD discovery is cluster-wide
        assert cluster == {("apiextensions.k8s.io", "customresourcedefinitions")}
        assert (GROUP, PLURAL) in namespaced and ("", "events") in namespaced
        role = next(m for m in rendered if m["kind"] == "Role")
        assert role["metadata"]["namespace"] == values["watchNamespace"]
    else:
        assert not namespaced
        assert {
            (GROUP, PLURAL),
            (GROUP, f"{PLURAL}/status"),
            ("", "events"),
            ("", "namespaces"),
        } <= cluster
    binding = next(m for m in rendered if m["kind"] == "ClusterRoleBinding")
    operator_sa = next(
        m["metadata"]["name"]
        for m in rendered
        if m["kind"] == "ServiceAccount" and m["metadata"]["name"].endswith("-operator")
    )
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": operator_sa, "namespace": "cuvil-system"}
    ]


def _values_of(rendered: list[dict[str, Any]]) -> dict[str, str]:
    operator = next(
        m
        for m in rendered
        if m["kind"] == "Deployment" and m["metadata"]["name"].endswith("-operator")
    )
    env = {
        e["name"]: e.get("value")
        for e in operator["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    return {"watchNamespace": env.get("CUVIL_OPERATOR_NAMESPACE") or ""}


def test_one_worker_deployment_per_queue_entry_with_gpus_where_asked(render: Render) -> None:
    """CUDA targets compile on CPU workers: an entry gets GPUs (and the GPU tolerations) only
    when it sets ``gpus``."""
    values_file = CHART / "ci" / "gpu-workers-values.yaml"
    entries = yaml.safe_load(values_file.read_text())["workers"]["queues"]
    workers = {
        m["metadata"]["name"].removeprefix("cuvil-worker-"): m
        for m in render(values_file)
        if m["kind"] == "Deployment" and m["metadata"]["name"].startswith("cuvil-worker-")
    }
    assert sorted(workers) == sorted(entry["name"] for entry in entries)
    for entry in entries:
        pod = workers[entry["name"]]["spec"]["template"]["spec"]
        container = pod["containers"][0]
        queues = {queue_for_target(t) for t in entry["targets"]} | set(entry.get("extraQueues", []))
        args = dict(arg.removeprefix("--").split("=", 1) for arg in container["args"])
        assert set(args["queues"].split(",")) == queues
        gpus = container["resources"].get("limits", {}).get("nvidia.com/gpu", 0)
        assert gpus == entry.get("gpus", 0)
        tolerations = pod.get("tolerations", [])
        assert any(t.get("key") == "nvidia.com/gpu" for t in tolerations) is (gpus > 0)
        for toleration in entry.get("tolerations", []):
            assert toleration in tolerations
        assert pod.get("nodeSelector", {}) == entry.get("nodeSelector", {})
        if "image" in entry:
            assert container["image"].startswith(entry["image"]["repository"])


def test_schema_knows_exactly_the_crd_targets() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    entry = schema["properties"]["workers"]["properties"]["queues"]["items"]
    assert entry["properties"]["targets"]["items"]["enum"] == TARGETS


def test_every_values_key_is_documented() -> None:
    """Each key in values.yaml has a "# --" comment above it, opens a block whose keys do, or
    sits inside a documented key's value (resources, queue entries, security contexts)."""
    undocumented = []
    ancestors: list[tuple[int, bool]] = []  # (indent, documented) of the enclosing keys
    previous = ""
    for line in (CHART / "values.yaml").read_text().splitlines():
        stripped = line.strip()
        match = re.match(r"^(\s*)(- )?([A-Za-z][\w./-]*):", line)
        if match:
            indent = len(match.group(1)) + (2 if match.group(2) else 0)
            while ancestors and ancestors[-1][0] >= indent:
                ancestors.pop()
            documented = previous.startswith("#") and not previous.startswith("# ---")
            inherited = any(flag for _, flag in ancestors)
            opens_block = stripped.endswith(":")
            if not (documented or inherited or opens_block):
                undocumented.append(stripped)
            ancestors.append((indent, documented or inherited))
        if stripped:
            previous = stripped
    assert not undocumented, undocumented


def _source_text(*folders: str) -> str:
    return "\n".join(
        path.read_text() for folder in folders for path in (ROOT / folder).rglob("*.py")
    )


def test_environment_matches_what_the_deployables_read(render: Render) -> None:
    manifests = render(*CI_VALUES[:1]) + render(CHART / "ci" / "sidecar-config-values.yaml")
    readers = {
        "operator": _source_text("operator/cuvil_operator"),
        "worker": _source_text("compiler_worker/cuvil_worker", "cuvil"),
        "sidecar": _source_text("runtime_sidecar/cuvil_sidecar", "cuvil/artifact"),
    }
    names: dict[str, set[str]] = {"operator": set(), "worker": set(), "sidecar": set()}
    for m in manifests:
        if m["kind"] == "Deployment":
            component = "operator" if m["metadata"]["name"].endswith("-operator") else "worker"
            for container in m["spec"]["template"]["spec"]["containers"]:
                names[component] |= {e["name"] for e in container.get("env", [])}
        if m["kind"] == "ConfigMap" and m["metadata"]["name"].endswith("-sidecar"):
            names["sidecar"] |= set(m["data"])
    for component, env in names.items():
        assert env, component
        for name in env:
            if name.startswith("CUVIL_") and name != "CUVIL_REDIS_PASSWORD":
                assert name in readers[component], f"{component} never reads {name}"


def test_sidecar_config_map_parses_as_the_sidecar_reads_it(render: Render) -> None:
    from cuvil_sidecar.config import SidecarConfig

    manifests = render(CHART / "ci" / "sidecar-config-values.yaml")
    data = next(
        m["data"]
        for m in manifests
        if m["kind"] == "ConfigMap" and m["metadata"]["name"].endswith("-sidecar")
    )
    config = SidecarConfig.from_env(data)
    assert config.warmup_shapes == ({"seq": 128}, {"seq": 384})
    assert (config.max_batch_size, config.model_instances) == (16, 2)
    assert config.lone_requests_wait
    assert config.shared_memory  # asked for in the values
    assert config.grpc_frontend == "native"  # the image has the native front end built in
    assert config.exit_timeout_s == 120
    assert (config.generation_slots, config.kv_cache_bytes) == (8, 8 * 2**30)
    assert not config.reuse_prefixes and config.stream_interval == 4
    assert (config.prefill_chunk, config.generation_max_waiting) == (128, 64)  # the defaults
    changed = render(sets=("sidecar.sharedMemory.mode=off", "sidecar.grpcFrontend=grpcio"))
    data = next(m["data"] for m in changed if m["metadata"]["name"].endswith("-sidecar"))
    config = SidecarConfig.from_env(data | {"CUVIL_MODEL": "m"})
    assert not config.shared_memory
    assert config.grpc_frontend == "grpcio"
    assert not config.lone_requests_wait  # the default


def _dry_run_install(helm_run: HelmRun, *values: str) -> subprocess.CompletedProcess[str]:
    """``helm install --dry-run=client`` of the chart: what a user's install would print."""
    return helm_run(
        "install", "cuvil", str(CHART), "--namespace", "cuvil-system", "--dry-run=client", *values
    )


def test_sidecar_snippet_in_notes_is_a_valid_pod(
    helm_run: HelmRun, tmp_path: Path, render: Render
) -> None:
    values = CHART / "ci" / "sidecar-config-values.yaml"
    done = _dry_run_install(helm_run, "-f", str(values))
    assert done.returncode == 0, done.stderr
    notes = done.stdout.split("NOTES:", 1)[1]
    block = notes.split("add the sidecar below", 1)[1].split("\n\n", 1)[1].split("\n\n", 1)[0]
    snippet = yaml.safe_load("\n".join(line.removeprefix("    ") for line in block.splitlines()))
    sidecar = snippet["spec"]["containers"][0]
    assert sidecar["name"] == "cuvil-sidecar"
    # the pod's grace covers the sidecar's exit timeout (120 s in these values) and a margin
    assert snippet["spec"]["terminationGracePeriodSeconds"] == 130
    # the ConfigMap and the registry secret it points at are the chart's own
    rendered = {(m["kind"], m["metadata"]["name"]) for m in render(values)}
    assert ("ConfigMap", sidecar["envFrom"][0]["configMapRef"]["name"]) in rendered
    secret = next(v["secret"]["secretName"] for v in snippet["spec"]["volumes"] if "secret" in v)
    assert ("Secret", secret) in rendered
    # shared memory for tensors: a memory-backed volume at /dev/shm
    shm = next(m["name"] for m in sidecar["volumeMounts"] if m["mountPath"] == "/dev/shm")
    volume = next(v for v in snippet["spec"]["volumes"] if v["name"] == shm)
    assert volume["emptyDir"]["medium"] == "Memory"
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "app"},
        "spec": {
            **snippet["spec"],
            "containers": [{"name": "app", "image": "example/app:1"}, sidecar],
        },
    }
    manifest = tmp_path / "pod.yaml"
    manifest.write_text(yaml.safe_dump(pod))
    checked = validate_strict(manifest)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "passed for resource pod/app" in checked.stdout


def test_readme_snippet_is_what_the_chart_prints(helm_run: HelmRun) -> None:
    done = _dry_run_install(helm_run, "--set", "registry.existingSecret=registry-push")
    assert done.returncode == 0, done.stderr
    notes = done.stdout.split("add the sidecar below", 1)[1].split("\n\n", 1)[1]
    printed = "\n".join(
        line.removeprefix("    ") for line in notes.split("\n\n", 1)[0].splitlines()
    )
    readme = (CHART / "README.md").read_text()
    documented = readme.split("## Adding the sidecar", 1)[1].split("```yaml\n", 1)[1]
    assert documented.split("```", 1)[0].strip() == printed.strip()


def test_tls_and_tokens_secrets_reach_the_sidecar(helm_run: HelmRun, render: Render) -> None:
    """With the secrets given, the ConfigMap points the sidecar at the files the snippet mounts
    them as; without them, TLS and authentication stay off and nothing is mounted."""
    sets = (
        "sidecar.tls.existingSecret=app-tls",
        "sidecar.tls.clientCA=true",
        "sidecar.auth.tokensSecret=app-tokens",
        "sidecar.maxQueueSize=16",
    )
    data = next(m["data"] for m in render(sets=sets) if m["metadata"]["name"].endswith("-sidecar"))
    assert data["CUVIL_TLS_CERT"] == "/etc/cuvil/tls/tls.crt"
    assert data["CUVIL_TLS_KEY"] == "/etc/cuvil/tls/tls.key"
    assert data["CUVIL_TLS_CLIENT_CA"] == "/etc/cuvil/tls/ca.crt"
    assert data["CUVIL_AUTH_TOKENS_FILE"] == "/etc/cuvil/auth/tokens"
    assert (data["CUVIL_HTTP_PORT"], data["CUVIL_MAX_QUEUE_SIZE"]) == ("8000", "16")
    done = _dry_run_install(helm_run, *(arg for item in sets for arg in ("--set", item)))
    assert done.returncode == 0, done.stderr
    block = done.stdout.split("add the sidecar below", 1)[1].split("\n\n", 1)[1]
    block = block.split("\n\n", 1)[0]
    snippet = yaml.safe_load("\n".join(line.removeprefix("    ") for line in block.splitlines()))
    sidecar = snippet["spec"]["containers"][0]
    mounts = {m["name"]: m["mountPath"] for m in sidecar["volumeMounts"]}
    volumes = {v["name"]: v for v in snippet["spec"]["volumes"]}
    assert mounts["cuvil-tls"] == "/etc/cuvil/tls"
    assert volumes["cuvil-tls"]["secret"]["secretName"] == "app-tls"
    assert mounts["cuvil-auth"] == "/etc/cuvil/auth"
    assert volumes["cuvil-auth"]["secret"] == {
        "secretName": "app-tokens",
        "items": [{"key": "tokens", "path": "tokens"}],
    }
    assert {p["name"]: p["containerPort"] for p in sidecar["ports"]}["oip-http"] == 8000
    plain = next(m["data"] for m in render() if m["metadata"]["name"].endswith("-sidecar"))
    assert not {"CUVIL_TLS_CERT", "CUVIL_AUTH_TOKENS_FILE"} & set(plain)
