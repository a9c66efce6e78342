"""The warm-up measurement for gates the compiler left to the node: a real sidecar serving an
artifact whose report defers its latency gate times the golden inputs and writes the result to
its pod's ``cuvil.dev/measurement`` annotation in the Kubernetes API (kmock); an artifact with
nothing deferred is not measured."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import tritonclient.grpc as grpcclient
from cuvil_sidecar.measurement import MeasurementSettings, deferred_gates, measure

from cuvil.artifact.files import read_artifact, write_artifact
from tests.cuvil_sidecar.conftest import Sidecar, ready_sidecar
from tests.fixtures.kube import KubeApi, kube_api, kubectl_binary

__all__ = ["kube_api", "kubectl_binary"]
DEFERRED = {"measured": None, "limit": 50.0, "deferred": "speed is not measured on this worker"}


def _with_gates(artifact: Path, gates: dict[str, Any], path: Path) -> Path:
    contents = read_artifact(artifact)
    contents.config["report"] = {**(contents.config.get("report") or {}), "gates": gates}
    return write_artifact(contents, path)


def _pod(kube: KubeApi, name: str) -> None:
    kube.create("v1", "pods", {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"containers": [{"name": "app", "image": "app:1"}]},
    })  # fmt: skip


def _annotations(kube: KubeApi, name: str) -> dict[str, str]:
    pod = kube.get("v1", "pods", "default", name) or {}
    return dict(pod.get("metadata", {}).get("annotations") or {})


def test_deferred_gates_and_the_measure_of_a_run() -> None:
    report = {"gates": {"maxLatencyP99Ms": DEFERRED, "maxAbsError": {"measured": 0.0, "limit": 1}}}
    assert deferred_gates(report) == {"maxLatencyP99Ms": 50.0}
    assert deferred_gates({}) == {}
    golden = {"output.y": torch.ones(2, 3)}
    timed = measure(lambda inputs: {"y": inputs["x"] + 1}, {"x": torch.zeros(2, 3)}, golden, 7)
    assert timed["runs"] == 7 and timed["maxAbsError"] == 0.0
    assert 0 < timed["latencyP50Ms"] <= timed["latencyP99Ms"]
    off = measure(lambda inputs: {"y": inputs["x"] + 1.5}, {"x": torch.zeros(2, 3)}, golden, 1)
    assert off["maxAbsError"] == 0.5


def test_in_cluster_settings_come_from_the_service_account() -> None:
    settings = MeasurementSettings.from_env(
        {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443",
         "CUVIL_POD_NAME": "app-1", "CUVIL_POD_NAMESPACE": "team-a"}
    )  # fmt: skip
    assert settings.api == "https://10.0.0.1:443" and settings.runs == 50
    assert str(settings.token_file).endswith("serviceaccount/token")


def test_a_deferred_gate_is_measured_at_warm_up_and_posted_on_the_pod(
    mlp_artifact: Path, kube_api: KubeApi, tmp_path: Path
) -> None:
    artifact = _with_gates(mlp_artifact, {"maxLatencyP99Ms": DEFERRED}, tmp_path / "gpu.cuvil")
    plain = _with_gates(mlp_artifact, {}, tmp_path / "plain.cuvil")
    token = tmp_path / "token"
    token.write_text("sa-token\n")
    for name in ("app-measured", "app-plain"):
        _pod(kube_api, name)
    environ = {"CUVIL_KUBE_API": kube_api.url, "CUVIL_POD_NAMESPACE": "default",
               "CUVIL_NODE_NAME": "node-a", "CUVIL_MEASURE_RUNS": "20",
               "CUVIL_KUBE_TOKEN_FILE": str(token)}  # fmt: skip
    measured = Sidecar(
        artifact, tmp_path / "measured.log", CUVIL_POD_NAME="app-measured", **environ
    )
    with ready_sidecar(measured):
        client = grpcclient.InferenceServerClient(measured.url)
        digest = client.get_model_metadata("mlp").versions[1]
        client.close()
        measured.wait_until(
            lambda: "cuvil.dev/measurement" in _annotations(kube_api, "app-measured")
        )
    posted = json.loads(_annotations(kube_api, "app-measured")["cuvil.dev/measurement"])
    assert posted["digest"] == digest
    assert posted["target"] == read_artifact(artifact).config["target"]
    assert posted["node"] == "node-a" and posted["runs"] == 20
    assert posted["deferred"] == ["maxLatencyP99Ms"]
    assert 0 < posted["latencyP50Ms"] <= posted["latencyP99Ms"]
    assert posted["maxAbsError"] < 1e-3  # against the artifact's golden outputs
    assert "measurement published on pod default/pods/app-measured" in measured.log()

    quiet = Sidecar(plain, tmp_path / "plain.log", CUVIL_POD_NAME="app-plain", **environ)
    with ready_sidecar(quiet):
        pass
    assert "cuvil.dev/measurement" not in _annotations(kube_api, "app-plain")
    assert "measured on this node" not in quiet.log()
