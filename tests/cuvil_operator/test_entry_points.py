"""Every entry point answers --help (listing its environment settings) and --version without
starting anything: no broker, no cluster, no model is reached, nothing is written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
SETTINGS = {
    "cuvil-operator": [
        "CUVIL_BROKER_URL",
        "CUVIL_OPERATOR_STALL_SECONDS",
        "CUVIL_OPERATOR_PUSH_POLICY",
    ],
    "cuvil-worker": ["CUVIL_BROKER_URL", "CUVIL_WORK_DIR", "CUVIL_PUSH_RETRIES"],
    "cuvil-sidecar": ["CUVIL_MODEL", "CUVIL_GRPC_PORT", "CUVIL_METRICS_PORT"],
}


@pytest.mark.parametrize("program", sorted(SETTINGS))
def test_help_and_version_have_no_side_effects(program: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUVIL_", "KUBE"))}
    env |= {"CUVIL_BROKER_URL": "redis://127.0.0.1:1/0", "KUBECONFIG": str(tmp_path / "none"),
            "HOME": str(tmp_path)}  # fmt: skip
    run = [str(BIN / program)]
    helped = subprocess.run([*run, "--help"], env=env, cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    assert helped.returncode == 0, helped.stderr[-2000:]
    for setting in SETTINGS[program]:
        assert setting in helped.stdout, setting
    version = subprocess.run([*run, "--version"], env=env, cwd=tmp_path, capture_output=True,
                             text=True, timeout=120)  # fmt: skip
    assert version.returncode == 0 and version.stdout.startswith(f"{program} "), version
    assert version.stdout.split()[1][0].isdigit()
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "it wrote files"
    assert "Traceback" not in helped.stderr + version.stderr
