"""Helm for the chart tests: helm v4 from PyPI (scripts/fetch-kube-tools), run offline.

``render(values_files, *set_args)`` returns the rendered manifests as dicts; ``helm_run`` runs any
helm command with a private HOME so that helm's caches stay out of the user's.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "cuvil"
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
RELEASE, NAMESPACE = "cuvil", "cuvil-system"

HelmRun = Callable[..., subprocess.CompletedProcess[str]]
Render = Callable[..., list[dict[str, Any]]]


@pytest.fixture(scope="session")
def kube_tools() -> Path:
    done = subprocess.run(
        [str(ROOT / "scripts" / "fetch-kube-tools")],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return Path(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def helm_run(kube_tools: Path, tmp_path_factory: pytest.TempPathFactory) -> HelmRun:
    home = tmp_path_factory.mktemp("helm-home")
    env = {"HOME": str(home), "KUBECONFIG": str(home / "no-kubeconfig"), "PATH": "/usr/bin:/bin"}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(kube_tools / "helm"), *args],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
            cwd=ROOT,
        )

    return run


@pytest.fixture(scope="session")
def render(helm_run: HelmRun) -> Render:
    def do(*values_files: Path, sets: tuple[str, ...] = ()) -> list[dict[str, Any]]:
        args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
        for path in values_files:
            args += ["-f", str(path)]
        for item in sets:
            args += ["--set", item]
        done = helm_run(*args)
        assert done.returncode == 0, done.stderr
        return [doc for doc in yaml.safe_load_all(done.stdout) if doc]

    return do


def pod_specs(manifests: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(kind/name, pod spec) of every workload."""
    return [
        (f"{m['kind']}/{m['metadata']['name']}", m["spec"]["template"]["spec"])
        for m in manifests
        if m["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job")
    ]
