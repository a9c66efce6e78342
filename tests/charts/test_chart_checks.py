"""The chart's CI checks (scripts/check-chart) pass, and each kind of bad input is refused."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.charts.conftest import CHART, ROOT, HelmRun


def test_check_chart_script_passes() -> None:
    done = subprocess.run(
        [str(ROOT / "scripts" / "check-chart")],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert "chart checks passed" in lines
    assert not [line for line in lines if line.startswith("FAIL")]
    # one validated render per ci variant, every example, and every bad-value case
    variants = sorted(path.stem for path in (CHART / "ci").glob("*.yaml"))
    validated = sorted(
        line.split()[1].rstrip(":") for line in lines if "kubernetes-validate --strict" in line
    )
    assert validated == variants
    for example in (ROOT / "examples").glob("*.yaml"):
        assert any(line.startswith(f"ok   examples/{example.name}") for line in lines), example
    assert sum(line.startswith("ok   schema rejects") for line in lines) == 4


@pytest.mark.parametrize(
    ("values", "key"),
    [
        ("operator:\n  replicas: -1\n", "/operator/replicas"),
        (
            "workers:\n  queues:\n    - {name: tpu, targets: [tpu-v5]}\n",
            "/workers/queues/0/targets/0",
        ),
        ("operator:\n  image:\n    repository: ''\n", "/operator/image/repository"),
        ("sidecar:\n  image:\n    repository: null\n", "missing property 'repository'"),
        (
            "workers:\n  queues:\n    - {name: cpu, targets: [cpu-x86_64], replicas: -2}\n",
            "/workers/queues/0/replicas",
        ),
        ("operator:\n  replicas: 2\n", "/operator"),  # several replicas need kopf peering
        ("redis:\n  enabled: false\n", "/externalRedis"),
        ("registry:\n  credentials: {create: true, server: r.example}\n", "/registry/credentials"),
        ("workers:\n  queus: []\n", "'queus'"),  # a misspelt key is not silently ignored
        ("injection:\n  failurePolicy: Sometimes\n", "/injection/failurePolicy"),
        ("injection:\n  unservedModel: maybe\n", "/injection/unservedModel"),
    ],
    ids=[
        "negative-replicas",
        "unknown-target",
        "empty-repository",
        "missing-repository",
        "negative-worker-replicas",
        "replicas-without-peering",
        "external-redis-without-url",
        "credentials-incomplete",
        "unknown-key",
        "webhook-failure-policy",
        "webhook-unserved-model",
    ],
)
def test_bad_value_is_rejected_naming_the_key(
    helm_run: HelmRun, tmp_path: Path, values: str, key: str
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(values)
    done = helm_run("template", "cuvil", str(CHART), "-f", str(bad))
    assert done.returncode != 0
    assert "values don't meet the specifications of the schema" in done.stderr
    assert key in done.stderr, done.stderr
    assert done.stdout == ""


def test_lint_strict_fails_on_a_bad_value(helm_run: HelmRun) -> None:
    done = helm_run("lint", "--strict", str(CHART), "--set", "workers.queues[0].targets[0]=tpu")
    assert done.returncode != 0
    assert "/workers/queues/0" in done.stdout + done.stderr


def test_check_examples_rejects_a_bad_manifest(tmp_path: Path) -> None:
    bad = tmp_path / "typo.yaml"
    bad.write_text(
        "apiVersion: cuvil.dev/v1alpha1\nkind: ModelCompilation\nmetadata: {name: typo}\n"
        "spec:\n  source: {huggingface: {model: a/b}}\n"
        "  inputs: [{name: x, dtype: float32, shape: [2, 3]}]\n"
        "  targets: [cpu-x86_64]\n  precison: fp32\n"
        "  output: {repository: 127.0.0.1:5000/models/m}\n"
    )
    done = subprocess.run(
        [str(ROOT / "scripts" / "check-examples"), str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 1
    assert "'precison' was unexpected" in done.stdout


def test_two_worker_entries_with_one_name_fail(helm_run: HelmRun, tmp_path: Path) -> None:
    values = tmp_path / "twice.yaml"
    values.write_text(
        "workers:\n  queues:\n    - {name: cpu, targets: [cpu-x86_64]}\n"
        "    - {name: cpu, targets: [cuda-sm_90]}\n"
    )
    done = helm_run("template", "cuvil", str(CHART), "-f", str(values))
    assert done.returncode != 0
    assert 'workers.queues: the name "cpu" appears twice' in done.stderr
