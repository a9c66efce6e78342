"""The kubelet's part, for tests that run an injected pod's sidecar as a real process.

kmock stores pods but runs nothing. ``PodSidecar`` does what a kubelet does for the
``cuvil-sidecar`` container the injection webhook added: it gives each volume the container
mounts a folder (downward API volumes hold the files their ``fieldRef`` items name, from the
pod as stored in the API), starts ``cuvil-sidecar`` with the image's environment and the
container's on top (paths under a mount point moved to that folder; ports moved to free
loopback ports, as the pod's own network namespace would keep them apart), reports the pod
Ready once the sidecar is, and keeps syncing: when the pod's annotations change in the API,
the downward API files are rewritten in place by an atomic rename, as the kubelet's atomic
writer does.
"""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path
from typing import Any

from cuvil.runtime import native_build
from tests.cuvil_operator.conftest import wait_for
from tests.cuvil_sidecar.conftest import Sidecar
from tests.fixtures.kube import KubeApi

CONTAINER = "cuvil-sidecar"
PORTS = ("CUVIL_GRPC_HOST", "CUVIL_GRPC_PORT", "CUVIL_HTTP_PORT", "CUVIL_METRICS_PORT")
_ANNOTATION_FIELD = re.compile(r"^metadata\.annotations\['([^']+)'\]$")


def image_env() -> dict[str, str]:
    """What the sidecar image's own environment gives the container before the pod's env
    (``runtime_sidecar/Dockerfile``'s ENV): its native kernels prebuilt in a cache, for which
    the test session's cache stands in, so the sidecar starts without compiling them."""
    return {"CUVIL_NATIVE_CACHE": str(native_build.cache_dir())}


def _field(pod: dict[str, Any], path: str) -> str:
    """The value of a downward API ``fieldPath`` (the forms the webhook uses)."""
    meta = pod.get("metadata") or {}
    match = _ANNOTATION_FIELD.match(path)
    if match is not None:
        return str((meta.get("annotations") or {}).get(match.group(1), ""))
    if path in ("metadata.name", "metadata.namespace", "metadata.uid"):
        return str(meta.get(path.split(".", 1)[1], ""))
    if path == "spec.nodeName":
        return str((pod.get("spec") or {}).get("nodeName", ""))
    raise AssertionError(f"the emulated kubelet does not project {path}")


class PodSidecar:
    """The injected sidecar of one pod stored in ``kube``, run and kept in sync."""

    def __init__(self, kube: KubeApi, namespace: str, name: str, folder: Path) -> None:
        self.kube, self.namespace, self.name = kube, namespace, name
        self.folder = folder
        pod = self.pod()
        (container,) = [c for c in pod["spec"]["containers"] if c["name"] == CONTAINER]
        volumes = {v["name"]: v for v in pod["spec"].get("volumes") or []}
        self.mounts: dict[str, Path] = {}  # mount path -> the local folder standing in
        self.projected: list[tuple[Path, str]] = []  # (file, fieldPath) of downward API items
        for mount in container.get("volumeMounts") or []:
            local = folder / "volumes" / mount["name"]
            local.mkdir(parents=True, exist_ok=True)
            self.mounts[mount["mountPath"]] = local
            for item in (volumes[mount["name"]].get("downwardAPI") or {}).get("items") or []:
                self.projected.append((local / item["path"], item["fieldRef"]["fieldPath"]))
        self._project(pod)
        env = {
            e["name"]: self._local(e["value"])
            if "value" in e
            else _field(pod, e["valueFrom"]["fieldRef"]["fieldPath"])
            for e in container.get("env") or []
        }
        self.env = image_env() | {k: v for k, v in env.items() if k not in PORTS}
        self.sidecar = Sidecar(self.env.pop("CUVIL_MODEL"), folder / "sidecar.log", **self.env)
        self._stop = threading.Event()
        self._sync = threading.Thread(target=self._sync_loop, daemon=True)
        self._sync.start()

    def pod(self) -> dict[str, Any]:
        pod = self.kube.get("v1", "pods", self.namespace, self.name)
        assert pod is not None, f"pod {self.namespace}/{self.name} is gone"
        return pod

    def _local(self, value: str) -> str:
        """A path under a mount point, moved to the folder standing in for that volume."""
        for mount, local in sorted(self.mounts.items(), key=lambda m: -len(m[0])):
            if value == mount or value.startswith(mount.rstrip("/") + "/"):
                return str(local) + value[len(mount.rstrip("/")) :]
        return value

    def _project(self, pod: dict[str, Any]) -> None:
        for path, field_path in self.projected:
            text = _field(pod, field_path)
            if path.exists() and path.read_text() == text:
                continue
            staging = path.with_name(f"..{path.name}.tmp")
            staging.write_text(text)
            os.replace(staging, path)

    def _sync_loop(self) -> None:
        while not self._stop.wait(0.2):
            pod = self.kube.get("v1", "pods", self.namespace, self.name)
            if pod is not None:
                self._project(pod)

    def wait_ready(self, client: Any, timeout_s: float = 180.0) -> None:
        """Until the readiness probe would pass; then the pod's Ready condition, as the
        kubelet reports it."""
        self.sidecar.wait_ready(client, timeout_s)
        ready = {"type": "Ready", "status": "True"}
        path = self.kube.path("v1", "pods", self.namespace, self.name) + "/status"
        self.kube.request("PATCH", path, {"status": {"conditions": [ready]}},
                          "application/merge-patch+json")  # fmt: skip
        wait_for(lambda: ready in (self.pod().get("status") or {}).get("conditions", []), 10,
                 "the pod's Ready condition")  # fmt: skip

    def file(self, name: str) -> str:
        """The current content of a projected file, by its name in the volume."""
        (path,) = [p for p, _ in self.projected if p.name == name]
        return path.read_text()

    def stop(self) -> int:
        self._stop.set()
        self._sync.join(5)
        return self.sidecar.stop()
