"""The CPU benchmark end to end on the MLP: eager and Cuvil only, two runs, JSON shape."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from benchmarks import cpu_models
from benchmarks.peers import Prepared


def test_mlp_eager_and_cuvil(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    argv = ["--models", "mlp", "--peers", "eager,cuvil", "--runs", "2", "--warmup", "1"]
    assert cpu_models.main([*argv, "--out", str(out)]) == 0

    document = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == document
    assert document["environment"]["threads"] == 2
    assert list(document["models"]) == ["mlp"]
    result = document["models"]["mlp"]
    assert result["inputs"] == {"x": [1, 784]}
    assert set(result["rows"]) == {"eager", "cuvil_fp32", "cuvil_bf16"}

    eager, cuvil = result["rows"]["eager"], result["rows"]["cuvil_fp32"]
    assert eager["max_abs_err"] == 0.0
    for row in (eager, cuvil):
        assert row["precision"] == "fp32"
        assert 0 < row["median_ms"] <= row["p90_ms"]
    assert cuvil["rel_err"] < 1e-4
    assert cuvil["setup_seconds"] > 0
    # bf16 either runs or records why not; it never stops the benchmark
    bf16 = result["rows"]["cuvil_bf16"]
    assert "error" in bf16 or bf16["precision"] == "bf16"

    assert result["best_fp32_peer"]["name"] == "eager"
    ratios = result["ratios"]
    assert ratios["cuvil_fp32 / best_fp32_peer"] == pytest.approx(
        cuvil["median_ms"] / eager["median_ms"], rel=1e-2, abs=1e-3
    )
    assert ratios["cuvil_fp32 / onnxruntime"] is None  # not selected


def test_a_fast_row_is_timed_over_several_full_bursts_a_slow_one_over_its_runs() -> None:
    """Bursts are sized from the warm-up times given, so what each row gets is fixed: a row
    of several calls a burst gets ``MIN_TURNS`` full bursts whatever ``--runs`` says."""
    calls = {"fast": 0, "slow": 0}

    def peer(name: str) -> Prepared:
        def call() -> None:
            calls[name] += 1

        return Prepared(call, lambda result: torch.zeros(1), 0.0, "fp32")

    prepared = {"fast": peer("fast"), "slow": peer("slow")}
    warm_ms = {"fast": 0.1, "slow": 50.0}  # a burst of 200 calls, and of one
    options = argparse.Namespace(runs=2, max_seconds=60.0)
    times = cpu_models.time_interleaved(prepared, warm_ms, options)
    burst = int(cpu_models.BURST_MS / warm_ms["fast"])
    assert len(times["fast"]) == cpu_models.MIN_TURNS * burst
    assert len(times["slow"]) == 2
    # each turn starts with one untimed call
    assert calls["fast"] == len(times["fast"]) + cpu_models.MIN_TURNS
    assert calls["slow"] == len(times["slow"]) + cpu_models.MIN_TURNS


def test_select_expands_prefixes() -> None:
    names = list(cpu_models.CASES)
    assert cpu_models.select(names, "minilm,mlp", "model") == [
        "minilm_b1_s128",
        "minilm_b8_s128",
        "mlp",
    ]
    with pytest.raises(SystemExit):
        cpu_models.select(names, "vgg", "model")


def test_reuse_fills_in_rows_not_run(tmp_path: Path) -> None:
    earlier = tmp_path / "earlier.json"
    row = {"precision": "fp32", "median_ms": 2.0, "p90_ms": 3.0, "runs": 2, "setup_seconds": 0}
    earlier.write_text(json.dumps({"models": {"mlp": {"rows": {"onnxruntime": row}}}}))
    out = tmp_path / "bench.json"
    argv = ["--models", "mlp", "--peers", "eager", "--runs", "2", "--warmup", "0"]
    assert cpu_models.main([*argv, "--reuse", str(earlier), "--out", str(out)]) == 0

    result = json.loads(out.read_text())["models"]["mlp"]
    assert list(result["rows"]) == ["eager", "onnxruntime"]
    assert result["rows"]["onnxruntime"]["reused"] is True
    assert "reused" not in result["rows"]["eager"]
    assert result["best_fp32_peer"]["name"] in {"eager", "onnxruntime"}
