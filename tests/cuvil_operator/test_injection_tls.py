"""TLS and bearer tokens for injected sidecars: the chart's Secrets mounted where the sidecar's
settings point, the patched pod valid for the Kubernetes API, and the sidecar's own config
reading what the patch gives it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from cuvil_operator.injection import (
    CONTAINER_NAME,
    InjectionSettings,
    SidecarRequest,
    build_pod_patch,
)
from cuvil_sidecar.config import SidecarConfig

from tests.fixtures.kube import merge_patch
from tests.fixtures.validate import validate_strict

INDEX = "registry.example.com/models/minilm@sha256:" + "a" * 64
SECRET_FILES = {"cuvil-tls": ("tls.crt", "tls.key", "ca.crt"), "cuvil-auth": ("tokens",)}


def _pod() -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "app-7d9f-x2k4q", "annotations": {"cuvil.dev/model": "minilm"}},
        "spec": {"containers": [{"name": "app", "image": "app:1"}]},
    }


def _injected(settings: InjectionSettings) -> dict[str, Any]:
    pod = _pod()
    return dict(merge_patch(pod, build_pod_patch(pod, INDEX, SidecarRequest("minilm"), settings)))


def _sidecar(pod: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in pod["spec"]["containers"] if c["name"] == CONTAINER_NAME)


def test_tls_and_token_secrets_are_mounted_and_the_sidecar_is_pointed_at_them(
    tmp_path: Path,
) -> None:
    settings = InjectionSettings.from_env({
        "CUVIL_INJECT_TLS_SECRET": "minilm-serving-tls",
        "CUVIL_INJECT_TLS_CLIENT_CA": "true",
        "CUVIL_INJECT_TOKENS_SECRET": "minilm-tokens",
    })  # fmt: skip
    pod = _injected(settings)
    manifest = tmp_path / "pod.yaml"
    manifest.write_text(yaml.safe_dump(pod))
    checked = validate_strict(manifest)
    assert checked.returncode == 0, checked.stdout + checked.stderr

    sidecar = _sidecar(pod)
    env = {e["name"]: e["value"] for e in sidecar["env"] if "value" in e}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["cuvil-tls"]["secret"] == {"secretName": "minilm-serving-tls"}
    assert volumes["cuvil-auth"]["secret"] == {
        "secretName": "minilm-tokens",
        "items": [{"key": "tokens", "path": "tokens"}],
    }
    mounts = {m["name"]: m for m in sidecar["volumeMounts"]}
    assert mounts["cuvil-tls"]["readOnly"] and mounts["cuvil-auth"]["readOnly"]
    # The probes stay on the plaintext, token-free metrics port.
    assert sidecar["readinessProbe"]["httpGet"]["port"] == "metrics"

    # The kubelet's view: each Secret's keys as files under its mount; the sidecar's own
    # settings read them from where the patch points.
    local: dict[str, str] = {}
    for name, files in SECRET_FILES.items():
        folder = tmp_path / name
        folder.mkdir()
        for file in files:
            (folder / file).write_text("x\n")
        local[mounts[name]["mountPath"]] = str(folder)
    for key, value in env.items():
        for mount, folder in local.items():
            if value.startswith(mount + "/"):
                env[key] = folder + value[len(mount) :]
    config = SidecarConfig.from_env(env)
    assert config.tls is not None
    assert config.tls.cert == tmp_path / "cuvil-tls" / "tls.crt"
    assert config.tls.key == tmp_path / "cuvil-tls" / "tls.key"
    assert config.tls.client_ca == tmp_path / "cuvil-tls" / "ca.crt"
    assert config.auth_tokens_file == tmp_path / "cuvil-auth" / "tokens"
    assert config.auth_health is False  # the kubelet's probes carry no token


def test_without_the_settings_no_secret_is_mounted() -> None:
    sidecar = _sidecar(_injected(InjectionSettings.from_env({})))
    names = {e["name"] for e in sidecar["env"]}
    assert not names & {"CUVIL_TLS_CERT", "CUVIL_TLS_KEY", "CUVIL_AUTH_TOKENS_FILE"}
    assert not {m["name"] for m in sidecar["volumeMounts"]} & {"cuvil-tls", "cuvil-auth"}
    one_way = _sidecar(_injected(InjectionSettings(tls_secret="serving-tls")))
    assert "CUVIL_TLS_CLIENT_CA" not in {e["name"] for e in one_way["env"]}


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"CUVIL_INJECT_TLS_CLIENT_CA": "true"}, "needs CUVIL_INJECT_TLS_SECRET"),
        ({"CUVIL_INJECT_TLS_SECRET": "s", "CUVIL_INJECT_TLS_CLIENT_CA": "yes"}, "true or false"),
        (
            {"CUVIL_INJECT_TLS_SECRET": "s", "CUVIL_INJECT_ENV": '{"CUVIL_METRICS_PORT": "0"}'},
            "need CUVIL_METRICS_PORT",
        ),
        (
            {"CUVIL_INJECT_TOKENS_SECRET": "t",
             "CUVIL_INJECT_ENV": '{"CUVIL_AUTH_HEALTH": "required"}'},
            "fails the kubelet's probes",
        ),
    ],
)  # fmt: skip
def test_settings_whose_probes_could_never_pass_are_refused(
    env: dict[str, str], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        InjectionSettings.from_env(env)
