"""The per-step profile end to end on the MLP: every data step of the plan timed, slowest first
(ONNX Runtime's side, ``--ort``, needs the ``bench`` extra, which the test environment lacks)."""

from __future__ import annotations

import json

import pytest
import torch

import cuvil
from benchmarks import plan_profile
from cuvil.models import mlp


def test_mlp_steps(capsys: pytest.CaptureFixture[str]) -> None:
    threads = torch.get_num_threads()
    try:
        assert plan_profile.main(["--model", "mlp", "--threads", "1", "--runs", "3"]) == 0
    finally:
        torch.set_num_threads(threads)
    report = json.loads(capsys.readouterr().out)
    assert report["model"] == "mlp" and report["threads"] == 1
    assert "onnxruntime" not in report

    spec = mlp()
    compiled = cuvil.jit(spec.model, spec.example_inputs, dynamic_shapes=spec.dynamic_shapes)
    steps = report["cuvil"]["steps"]
    assert sorted(row["step"] for row in steps) == sorted(s.name for s in compiled.plan.data_steps)
    assert all(row["ms"] > 0 for row in steps)
    assert [row["ms"] for row in steps] == sorted((row["ms"] for row in steps), reverse=True)
    assert report["cuvil"]["sum_ms"] == pytest.approx(sum(row["ms"] for row in steps), abs=1e-2)
