"""The stage benchmark end to end on the MLP: a sidecar whose ModelInfer path is timestamped,
tritonclient's sync client, and every call's time split into the stages it passed through
(which all still exist under the names the benchmark wraps)."""

from __future__ import annotations

from pathlib import Path

from tests.benchmarks.scripts import run_report


def test_mlp_stages(tmp_path: Path) -> None:
    report = run_report(
        "sidecar_stages.py", "--models", "mlp", "--calls", "40", "--artifacts", str(tmp_path)
    )
    mlp = report["mlp"]
    assert mlp["calls"] >= 30  # only readiness checks may lack marks
    stages = mlp["stages_p50_us"]
    assert list(stages) == [
        "request_in",
        "parse",
        "to_loop",
        "to_data_plane",
        "decode",
        "to_worker",
        "model",
        "response",
        "response_out",
    ]
    assert all(value >= 0 for value in stages.values())
    assert stages["model"] > 0 and stages["decode"] > 0 and stages["request_in"] > 0
    assert mlp["model_us"] == stages["model"]
    assert 0 < mlp["sidecar_us"] < mlp["total_us"]
    assert 0 < mlp["transport_us"] < mlp["total_us"]
