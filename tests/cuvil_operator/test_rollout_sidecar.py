"""Rollout with every part real in one run: kmock as the Kubernetes API, ``cuvil-operator``
(with its HTTPS injection webhook), a ``cuvil-worker`` on Redis compiling the bundled MLP, the
Debian docker-registry, and the injected pod's ``cuvil-sidecar`` run as the kubelet would run it
(``kubelet.PodSidecar``: the webhook's patch, its environment and its downward API file).

Generation 1 is served; the spec is edited and generation 2 passes its gates on the compiling
CPU worker, so the operator re-pins the pod and the running sidecar moves to it while a client
loop keeps calling, with no failed request; generation 3 asks an impossible ``minSpeedup``, fails
that gate, and the sidecar stays on generation 2 with the ``Promoted`` condition saying why.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient

from cuvil.models import catalog
from tests.cuvil_operator import webhook_server
from tests.cuvil_operator.compilations import apply, mlp_compilation, phase_of, workers
from tests.cuvil_operator.conftest import events_for, get_mc, wait_for
from tests.cuvil_operator.kubelet import PodSidecar
from tests.cuvil_operator.webhook_server import Webhook, patched_pod
from tests.fixtures.kube import KubeApi
from tests.fixtures.redis import RedisServer
from tests.fixtures.registry import RunningRegistry, registry

__all__ = ["registry", "workers"]
pytestmark = pytest.mark.slow
NAME = "rollout-real"
POD = "app-1"
# The chart's sidecar settings: a short check of the pinned reference, so a re-pin is seen fast.
SIDECAR_ENV = {**webhook_server.SIDECAR_ENV, "CUVIL_POLL_INTERVAL_S": "0.5"}


@pytest.fixture
def webhook(kube_api: KubeApi, redis_server: RedisServer, tmp_path: Path) -> Iterator[Webhook]:
    settings = {"CUVIL_INJECT_ENV": json.dumps(SIDECAR_ENV), "CUVIL_OPERATOR_STALL_SECONDS": "60"}
    yield from webhook_server._start(kube_api, redis_server, tmp_path, **settings)


class ClientLoop:
    """A client thread calling the model until stopped; every answer is checked against eager
    PyTorch, and anything else is a failure."""

    def __init__(self, url: str, model: str, x: np.ndarray, expected: np.ndarray) -> None:
        self.url, self.model, self.x, self.expected = url, model, x, expected
        self.answers = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        client = grpcclient.InferenceServerClient(self.url)
        item = grpcclient.InferInput("x", list(self.x.shape), "FP32")
        item.set_data_from_numpy(self.x)
        while not self._stop.is_set():
            try:
                y = client.infer(self.model, [item]).as_numpy("output")
            except Exception as error:
                self.failures.append(repr(error))
                continue
            if y is not None and np.allclose(y, self.expected, rtol=1e-4, atol=1e-4):
                self.answers += 1
            else:
                self.failures.append(f"a wrong answer: {None if y is None else y[0, :3]}")
        client.close()

    def wait_for_more(self, more: int, timeout_s: float = 60.0) -> None:
        target = self.answers + more
        deadline = time.monotonic() + timeout_s
        while self.answers < target:
            assert time.monotonic() < deadline, (self.answers, self.failures[:3])
            time.sleep(0.05)

    def __enter__(self) -> ClientLoop:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


def _promoted_condition(status: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == "Promoted")


def _finished(kube: KubeApi, generation: int) -> dict[str, Any]:
    done = wait_for(
        lambda: phase_of(kube, NAME, "Succeeded", "Failed", generation=generation),
        120, f"generation {generation} to finish",
    )  # fmt: skip
    return dict(done["status"])


def _cpu_digest(status: dict[str, Any]) -> str:
    (artifact,) = [a for a in status["artifacts"] if a["target"] == "cpu-x86_64"]
    return str(artifact["digest"])


def _admit_pod(kube: KubeApi, webhook: Webhook) -> None:
    """A Deployment's pod as the API server stores it: sent through the webhook, then created."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"generateName": "app-7d9f-", "labels": {"cuvil.dev/model": NAME},
                     "annotations": {"cuvil.dev/cpu": "1"}},
        "spec": {"containers": [{"name": "app", "image": "example/app:1"}]},
    }  # fmt: skip
    pod = patched_pod(pod, webhook.review(pod))
    pod["metadata"] |= {"name": POD, "namespace": "default"}
    kube.create("v1", "pods", pod)


def _served_digest(client: Any, model: str) -> str:
    return str(client.get_model_metadata(model).versions[1])  # "1", then the manifest digest


def test_a_running_sidecar_moves_to_a_promoted_generation_and_stays_when_one_fails(
    kube_api: KubeApi,
    registry: RunningRegistry,
    workers: Any,
    webhook: Webhook,
    tmp_path: Path,
) -> None:
    workers("rollout")
    obj = mlp_compilation(NAME, registry)
    apply(kube_api, obj, tmp_path)
    first = _finished(kube_api, 1)
    assert first["phase"] == "Succeeded", first.get("message")
    assert first["promoted"]["generation"] == 1

    _admit_pod(kube_api, webhook)
    kubelet = PodSidecar(kube_api, "default", POD, tmp_path / "pod")
    assert kubelet.env["CUVIL_TORCH_THREADS"] == "1"  # from cuvil.dev/cpu
    assert kubelet.file("ref") == first["promoted"]["ref"]  # pinned by the webhook
    x = np.random.default_rng(3).standard_normal((2, 784), dtype=np.float32)
    expected = catalog.mlp().model(torch.from_numpy(x)).detach().numpy()
    client = grpcclient.InferenceServerClient(kubelet.sidecar.url)
    try:
        kubelet.wait_ready(client)
        (model,) = [m["name"] for m in client.get_model_repository_index(as_json=True)["models"]]
        assert _served_digest(client, model) == _cpu_digest(first)
        wait_for(
            lambda: (get_mc(kube_api, NAME) or {}).get("status", {}).get("serving")
            == [{"ref": first["promoted"]["ref"], "pods": 1, "ready": 1}],
            30, "status.serving to count the ready pod",
        )  # fmt: skip

        with ClientLoop(kubelet.sidecar.url, model, x, expected) as loop:
            loop.wait_for_more(20)
            # Generation 2: the spec is edited, its gates pass on the compiling worker.
            obj["spec"]["gates"] = {"maxAbsError": 0.01, "minSpeedup": 0.05}
            apply(kube_api, obj, tmp_path)
            second = _finished(kube_api, 2)
            assert second["phase"] == "Succeeded", second.get("message")
            assert second["promoted"]["generation"] == 2
            assert _cpu_digest(second) != _cpu_digest(first)
            wait_for(lambda: kubelet.file("ref") == second["promoted"]["ref"], 30, "the re-pin")
            wait_for(lambda: _served_digest(client, model) == _cpu_digest(second), 60,
                     "the sidecar to serve generation 2")  # fmt: skip
            loop.wait_for_more(20)
            assert loop.failures == []

            # Generation 3 cannot meet its speed gate: it fails, generation 2 stays served.
            obj["spec"]["gates"] = {"maxAbsError": 0.01, "minSpeedup": 1000.0}
            apply(kube_api, obj, tmp_path)
            third = _finished(kube_api, 3)
            assert third["phase"] == "Failed"
            assert third["promoted"] == second["promoted"]
            condition = _promoted_condition(third)
            assert (condition["status"], condition["reason"]) == ("False", "GenerationFailed")
            why = condition["message"]  # the gate, its measured value and its limit
            assert "gate minSpeedup failed: measured" in why and "required >= 1000" in why
            assert f"generation 2 ({second['promoted']['digest']}) stays served" in why
            time.sleep(3)  # three intervals of the operator's serving timer: nothing moves
            loop.wait_for_more(20)
        assert loop.failures == []
        assert kubelet.file("ref") == second["promoted"]["ref"]
        assert _served_digest(client, model) == _cpu_digest(second)
        rolled = [e["message"] for e in events_for(kube_api, NAME) if e["reason"] == "RolledOut"]
        assert rolled == [f"1 pods moved to generation 2: {POD}"]
        with urllib.request.urlopen(kubelet.sidecar.metrics_url + "/metrics") as response:
            metrics = response.read().decode()
        assert 'cuvil_model_reloads{result="ok"} 2' in metrics  # the first load, generation 2
        assert 'cuvil_model_reloads{result="refused"}' not in metrics
    finally:
        client.close()
        assert kubelet.stop() == 0, kubelet.sidecar.log()[-3000:]
