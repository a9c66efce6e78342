"""The pure part of sidecar injection: annotations read, the reference chosen, the pod patched."""

from __future__ import annotations

from typing import Any

import pytest
from cuvil_operator.injection import (
    CONTAINER_NAME,
    INJECTED_ANNOTATION,
    InjectionRefused,
    InjectionSettings,
    SidecarRequest,
    build_pod_patch,
    read_request,
    served_ref,
)

REPO = "registry.example.com/models/minilm"
INDEX = f"{REPO}@sha256:" + "a" * 64
CPU_REF = f"{REPO}@sha256:" + "b" * 64
CUDA_REF = f"{REPO}@sha256:" + "c" * 64


def _succeeded(**status: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "minilm"},
        "status": {
            "phase": "Succeeded",
            "index": {"ref": INDEX, "digest": INDEX.split("@")[1]},
            "artifacts": [
                {"target": "cpu-x86_64", "ref": CPU_REF},
                {"target": "cuda-sm_90", "ref": CUDA_REF},
            ],
            **status,
        },
    }


def _pod(**annotations: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "app", "annotations": {"cuvil.dev/model": "minilm", **annotations}},
        "spec": {"containers": [{"name": "app", "image": "app:1"}]},
    }


def _sidecar(patch: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in patch["spec"]["containers"] if c["name"] == CONTAINER_NAME)


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def test_index_is_served_by_default_and_a_named_target_gets_its_own_artifact() -> None:
    assert served_ref(_succeeded(), SidecarRequest("minilm")) == INDEX
    assert served_ref(_succeeded(), SidecarRequest("minilm", target="cuda-sm_90")) == CUDA_REF


def test_promoted_wins_over_the_latest_generation() -> None:
    promoted = {"ref": CPU_REF, "targets": {"cpu-x86_64": CPU_REF}, "generation": 1}
    compilation = _succeeded(promoted=promoted)
    assert served_ref(compilation, SidecarRequest("minilm")) == CPU_REF
    # a later generation that failed still serves what was promoted before
    compilation["status"]["phase"] = "Failed"
    assert served_ref(compilation, SidecarRequest("minilm", target="cpu-x86_64")) == CPU_REF


@pytest.mark.parametrize(
    ("compilation", "request_", "message"),
    [
        (None, SidecarRequest("minilm"), "does not exist"),
        ({"status": {"phase": "Compiling"}}, SidecarRequest("minilm"), "phase Compiling"),
        ({}, SidecarRequest("minilm"), "phase not started"),
        (
            _succeeded(candidate={"generation": 1, "ref": INDEX}),
            SidecarRequest("minilm"),
            "generation 1 awaits a measurement",
        ),
        (_succeeded(), SidecarRequest("minilm", target="cpu-aarch64"), "no artifact for target"),
        (
            _succeeded(index={"ref": f"{REPO}:latest"}),
            SidecarRequest("minilm"),
            "not a reference pinned by digest",
        ),
    ],
)
def test_unservable_compilations_are_refused_saying_why(
    compilation: dict[str, Any] | None, request_: SidecarRequest, message: str
) -> None:
    with pytest.raises(InjectionRefused, match=message):
        served_ref(compilation, request_)


@pytest.mark.parametrize(
    ("annotations", "message"),
    [
        ({"cuvil.dev/model": "Not_A_Name"}, "cuvil.dev/model"),
        ({"cuvil.dev/model": "m", "cuvil.dev/port": "99999"}, "cuvil.dev/port"),
        ({"cuvil.dev/model": "m", "cuvil.dev/cpu": "two"}, "cuvil.dev/cpu"),
        ({"cuvil.dev/model": "m", "cuvil.dev/cpu": "0"}, "more than zero"),
        ({"cuvil.dev/model": "m", "cuvil.dev/memory": "lots"}, "cuvil.dev/memory"),
    ],
)
def test_bad_annotations_are_refused_by_name(annotations: dict[str, str], message: str) -> None:
    with pytest.raises(InjectionRefused, match=message):
        read_request(annotations)


@pytest.mark.parametrize(("cpu", "threads"), [("2", 2), ("1500m", 1), ("250m", 1), ("4.0", 4)])
def test_threads_follow_the_cpu_limit(cpu: str, threads: int) -> None:
    request = read_request({"cuvil.dev/model": "minilm", "cuvil.dev/cpu": cpu})
    sidecar = _sidecar(build_pod_patch(_pod(), INDEX, request, InjectionSettings()))
    assert _env(sidecar)["CUVIL_TORCH_THREADS"] == str(threads)
    assert sidecar["resources"]["limits"]["cpu"] == cpu


def test_patch_adds_a_pinned_hardened_probed_sidecar_and_its_volumes() -> None:
    settings = InjectionSettings(
        image="reg.example/cuvil-sidecar:1",
        env={"CUVIL_METRICS_PORT": "9102", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://otel:4317"},
        cache_host_path="/var/cache/cuvil-node",
        registry_secret="pull",
    )
    pod = _pod(**{"cuvil.dev/port": "9001", "cuvil.dev/memory": "1Gi"})
    patch = build_pod_patch(pod, INDEX, read_request(pod["metadata"]["annotations"]), settings)
    assert patch["metadata"]["annotations"][INJECTED_ANNOTATION] == INDEX
    assert [c["name"] for c in patch["spec"]["containers"]] == ["app", CONTAINER_NAME]
    sidecar = _sidecar(patch)
    env = _env(sidecar)
    assert env["CUVIL_MODEL"] == INDEX and env["CUVIL_GRPC_PORT"] == "9001"
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel:4317"
    assert env["CUVIL_REGISTRY_CONFIG"] == "/etc/cuvil/registry/config.json"
    assert "CUVIL_TORCH_THREADS" not in env  # no CPU limit: the sidecar's default
    assert sidecar["image"] == "reg.example/cuvil-sidecar:1"
    assert {p["name"]: p["containerPort"] for p in sidecar["ports"]} == {
        "oip-grpc": 9001,
        "metrics": 9102,
    }
    assert sidecar["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "metrics"}
    assert sidecar["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "metrics"}
    security = sidecar["securityContext"]
    assert security["runAsNonRoot"] and security["readOnlyRootFilesystem"]
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["allowPrivilegeEscalation"] is False
    assert sidecar["resources"] == {"requests": {"memory": "1Gi"}, "limits": {"memory": "1Gi"}}
    volumes = {v["name"]: v for v in patch["spec"]["volumes"]}
    assert volumes["cuvil-cache"]["hostPath"]["path"] == "/var/cache/cuvil-node"
    assert volumes["cuvil-registry"]["secret"]["secretName"] == "pull"
    mounts = {m["name"] for m in sidecar["volumeMounts"]}
    assert mounts == set(volumes)


def test_a_pod_with_a_sidecar_is_left_alone_and_its_own_volumes_are_kept() -> None:
    request = SidecarRequest("minilm")
    pod = _pod()
    pod["spec"]["containers"].append({"name": CONTAINER_NAME, "image": "mine"})
    assert build_pod_patch(pod, INDEX, request, InjectionSettings()) == {}
    pod = _pod()
    pod["spec"]["volumes"] = [{"name": "cuvil-shm", "emptyDir": {"medium": "Memory"}}]
    volumes = build_pod_patch(pod, INDEX, request, InjectionSettings())["spec"]["volumes"]
    assert [v for v in volumes if v["name"] == "cuvil-shm"] == pod["spec"]["volumes"]


def test_metrics_off_probes_the_grpc_health_service() -> None:
    settings = InjectionSettings(env={"CUVIL_METRICS_PORT": "0", "CUVIL_SHARED_MEMORY": "off"})
    patch = build_pod_patch(_pod(), INDEX, SidecarRequest("minilm"), settings)
    sidecar = _sidecar(patch)
    assert sidecar["readinessProbe"]["grpc"] == {"port": 8001}
    assert "cuvil-shm" not in {v["name"] for v in patch["spec"]["volumes"]}


def test_settings_from_the_environment_are_checked() -> None:
    settings = InjectionSettings.from_env(
        {"CUVIL_INJECT_ENV": '{"CUVIL_MAX_BATCH_SIZE": 4}', "CUVIL_INJECT_UNSERVED": "Admit"}
    )
    assert settings.env == {"CUVIL_MAX_BATCH_SIZE": "4"} and settings.unserved == "admit"
    with pytest.raises(ValueError, match="CUVIL_INJECT_ENV"):
        InjectionSettings.from_env({"CUVIL_INJECT_ENV": "[1]"})
    with pytest.raises(ValueError, match="CUVIL_INJECT_UNSERVED"):
        InjectionSettings.from_env({"CUVIL_INJECT_UNSERVED": "maybe"})
    for bad in ("soon", "-1", "nan"):
        with pytest.raises(ValueError, match="CUVIL_EXIT_TIMEOUT_S"):
            InjectionSettings.from_env({"CUVIL_INJECT_ENV": f'{{"CUVIL_EXIT_TIMEOUT_S": "{bad}"}}'})


@pytest.mark.parametrize(
    ("exit_timeout", "pod_grace", "patched"),
    [
        (None, None, None),  # 5 s + the margin fits Kubernetes' default 30 s
        ("20", None, None),
        ("20", 10, 30),  # a pod asking for less than the sidecar's drain gets what it needs
        ("120", None, 130),  # long generation streams: the pod's grace follows
        ("120", 600, None),  # a pod giving more keeps it
        ("0.5", 0, 11),
    ],
)
def test_the_pods_grace_period_covers_the_sidecars_exit_timeout(
    exit_timeout: str | None, pod_grace: int | None, patched: int | None
) -> None:
    env = {} if exit_timeout is None else {"CUVIL_EXIT_TIMEOUT_S": exit_timeout}
    pod = _pod()
    if pod_grace is not None:
        pod["spec"]["terminationGracePeriodSeconds"] = pod_grace
    patch = build_pod_patch(pod, INDEX, SidecarRequest("minilm"), InjectionSettings(env=env))
    assert patch["spec"].get("terminationGracePeriodSeconds") == patched


def test_the_sidecar_follows_the_pods_injected_annotation_through_a_downward_api_file() -> None:
    patch = build_pod_patch(_pod(), INDEX, SidecarRequest("minilm"), InjectionSettings())
    sidecar = _sidecar(patch)
    env = _env(sidecar)
    mount = next(m for m in sidecar["volumeMounts"] if m["name"] == "cuvil-serve")
    assert env["CUVIL_MODEL_FILE"] == mount["mountPath"] + "/ref" and mount["readOnly"]
    assert float(env["CUVIL_POLL_INTERVAL_S"]) > 0  # the chart's 0 (SIGHUP only) cannot follow
    volume = next(v for v in patch["spec"]["volumes"] if v["name"] == "cuvil-serve")
    (item,) = volume["downwardAPI"]["items"]
    assert item == {
        "path": "ref",
        "fieldRef": {"fieldPath": f"metadata.annotations['{INJECTED_ANNOTATION}']"},
    }
    chosen = InjectionSettings(env={"CUVIL_POLL_INTERVAL_S": "60"})
    sidecar = _sidecar(build_pod_patch(_pod(), INDEX, SidecarRequest("minilm"), chosen))
    assert _env(sidecar)["CUVIL_POLL_INTERVAL_S"] == "60"


def test_trusted_keys_are_mounted_from_the_pods_namespace() -> None:
    settings = InjectionSettings(
        env={"CUVIL_TRUST_POLICY": "require", "CUVIL_HTTP_PORT": "8000"},
        trusted_keys="cuvil-trusted-keys",
    )
    patch = build_pod_patch(_pod(), INDEX, SidecarRequest("minilm"), settings)
    sidecar = _sidecar(patch)
    env = _env(sidecar)
    assert env["CUVIL_TRUST_POLICY"] == "require"
    mount = next(m for m in sidecar["volumeMounts"] if m["name"] == "cuvil-trust")
    assert env["CUVIL_TRUSTED_KEYS"] == mount["mountPath"] and mount["readOnly"]
    volume = next(v for v in patch["spec"]["volumes"] if v["name"] == "cuvil-trust")
    assert volume["configMap"] == {"name": "cuvil-trusted-keys"}
    assert {"name": "oip-http", "containerPort": 8000} in sidecar["ports"]


def test_a_canary_is_pinned_to_the_candidate_while_there_is_one() -> None:
    candidate = {"generation": 2, "ref": CPU_REF, "targets": {"cuda-sm_90": CUDA_REF}}
    promoted = {"generation": 1, "ref": INDEX, "targets": {"cpu-x86_64": INDEX}}
    canary = read_request({"cuvil.dev/model": "minilm", "cuvil.dev/track": "candidate"})
    assert canary.track == "candidate"
    both = _succeeded(promoted=promoted, candidate=candidate)
    assert served_ref(both, canary) == CPU_REF
    assert served_ref(both, SidecarRequest("minilm")) == INDEX  # everyone else: promoted
    assert served_ref(_succeeded(promoted=promoted), canary) == INDEX  # no candidate
    # a first generation awaiting its measurement can run on a canary only
    assert served_ref(_succeeded(candidate=candidate), canary) == CPU_REF
    with pytest.raises(InjectionRefused, match="awaits a measurement"):
        served_ref(_succeeded(candidate=candidate), SidecarRequest("minilm"))
    with pytest.raises(InjectionRefused, match=r"cuvil\.dev/track 'beta'"):
        read_request({"cuvil.dev/model": "minilm", "cuvil.dev/track": "beta"})


def test_the_sidecar_is_told_its_pod_and_node_to_publish_measurements_on() -> None:
    sidecar = _sidecar(
        build_pod_patch(_pod(), INDEX, SidecarRequest("minilm"), InjectionSettings())
    )
    fields = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"]
              for e in sidecar["env"] if "valueFrom" in e}  # fmt: skip
    assert fields == {"CUVIL_POD_NAME": "metadata.name",
                      "CUVIL_POD_NAMESPACE": "metadata.namespace",
                      "CUVIL_NODE_NAME": "spec.nodeName"}  # fmt: skip


def test_a_gpu_annotation_gives_the_sidecar_its_gpus() -> None:
    pod = _pod(**{"cuvil.dev/gpu": "1", "cuvil.dev/memory": "8Gi"})
    request = read_request(pod["metadata"]["annotations"])
    resources = _sidecar(build_pod_patch(pod, INDEX, request, InjectionSettings()))["resources"]
    assert resources["limits"] == {"memory": "8Gi", "nvidia.com/gpu": "1"}
    assert resources["requests"] == resources["limits"]
    with pytest.raises(InjectionRefused, match=r"cuvil\.dev/gpu 'all'"):
        read_request({"cuvil.dev/model": "minilm", "cuvil.dev/gpu": "all"})
