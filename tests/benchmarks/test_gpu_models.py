"""The GPU benchmark and scripts/gpu-check, on a machine without a GPU: the options are
checked, the ratios say how many times faster Cuvil is, the benchmark says it needs a GPU, and
gpu-check runs its steps (the `gpu` tests skip here) and reports the environment it found."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_models

REPO = Path(__file__).resolve().parents[2]


def test_unknown_models_and_peers_are_refused() -> None:
    with pytest.raises(SystemExit):
        gpu_models.parse_args(["--models", "mlp,gpt5"])
    options = gpu_models.parse_args(["--models", "mlp", "--peers", "eager,cuvil"])
    assert options.models == ["mlp"] and options.peers == ["eager", "cuvil"]


def test_ratios_are_peer_over_cuvil() -> None:
    rows = {"eager": {"median_ms": 3.0}, "cuvil": {"median_ms": 1.5}, "broken": {"error": "x"}}
    assert gpu_models.ratios(rows) == {"eager / cuvil": 2.0}
    assert gpu_models.ratios({"eager": {"median_ms": 3.0}}) == {}


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_gpu_check_runs_its_steps_and_says_there_is_no_gpu(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path)}
    done = subprocess.run(
        [str(REPO / "scripts" / "gpu-check"), "--quick"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 1, done.stdout + done.stderr  # the benchmark needs a GPU
    assert "torch " in (tmp_path / "environment.txt").read_text()
    assert "no CUDA device on this machine" in (tmp_path / "gpu-tests.log").read_text()
    assert "no CUDA device" in (tmp_path / "gpu_models.log").read_text()
