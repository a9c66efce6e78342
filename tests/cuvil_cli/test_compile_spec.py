"""``cuvil compile SPEC.yaml`` runs the worker's per-target pipeline: the spec's gates and
validation hold, the result goes where ``spec.output`` (or ``-o``) says, with an index over its
targets, and the model is named as the operator's compile names it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cuvil_cli.main import main

import cuvil

SPEC = """\
apiVersion: cuvil.dev/v1alpha1
kind: ModelCompilation
metadata: {{name: mlp-local}}
spec:
  source: {{builtin: {{name: mlp}}}}
  targets: [cpu-x86_64]
  precision: fp32
  output: {{repository: "oci:{layout}", tag: v1}}
{extra}"""


def _spec(tmp_path: Path, extra: str = "") -> Path:
    path = tmp_path / "mlp.yaml"
    path.write_text(SPEC.format(layout=tmp_path / "layout", extra=extra))
    return path


def test_a_failed_gate_exits_1_with_its_value_and_threshold(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = _spec(tmp_path, "  gates: {minSpeedup: 100}\n")
    assert main(["compile", str(spec), "--bench-iterations", "5"]) == 1
    error = capsys.readouterr().err
    assert "GateFailed" in error and "minSpeedup" in error and "100" in error
    assert not (tmp_path / "layout").exists()  # nothing pushed


def test_validation_bounds_of_the_spec_hold(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = _spec(tmp_path, "  validation: {samples: 2, rtol: 0, atol: 1.0e-30}\n")
    assert main(["compile", str(spec), "--bench-iterations", "2"]) == 1
    assert "VerificationFailed" in capsys.readouterr().err


def test_the_spec_output_gets_an_index_and_the_operator_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = _spec(tmp_path, "  gates: {maxAbsError: 1.0e-3}\n")
    assert main(["compile", str(spec), "--bench-iterations", "5", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    report = printed["report"]["cpu-x86_64"]
    assert report["gates"]["maxAbsError"]["limit"] == 1e-3
    assert printed["artifact"].startswith(f"oci:{tmp_path / 'layout'}:v1@sha256:")
    compiled = cuvil.load(f"oci:{tmp_path / 'layout'}:v1", cache_dir=tmp_path / "cache")
    assert compiled.name == "mlp"  # what the worker names it: the source's name
    x = torch.randn(3, 784)
    torch.testing.assert_close(compiled(x), compiled(x))


def test_a_path_takes_one_target(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    path = tmp_path / "mlp.cuvil"
    assert main(["compile", str(spec), "-o", str(path), "--bench-iterations", "2"]) == 0
    assert cuvil.load(path).config["target"] == "cpu-x86_64"
    two = ["compile", str(spec), "-o", str(path), "--target", "cpu"]
    assert main([*two, "--bench-iterations", "2"]) == 0
    assert cuvil.load(path).config["target"] == "cpu"


def test_a_cuda_target_compiles_here_with_its_speed_gates_deferred(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = _spec(tmp_path, "  gates: {maxAbsError: 1.0e-3, minSpeedup: 100}\n")
    path = tmp_path / "mlp.cuvil"
    arguments = ["compile", str(spec), "-o", str(path), "--target", "cuda-sm_90", "--json"]
    assert main([*arguments, "--bench-iterations", "2"]) == 0
    report = json.loads(capsys.readouterr().out)["report"]["cuda-sm_90"]
    assert report["benchmark"]["measured"] is False
    assert "speed not measured" in report["benchmark"]["reason"]
    assert report["gates"]["minSpeedup"]["measured"] is None
    assert "deferred" in report["gates"]["minSpeedup"]
    assert report["gates"]["maxAbsError"]["passed"] is True
    loaded = cuvil.load(path)
    assert loaded.config["target"] == "cuda-sm_90" and loaded.execution()["kernels"]


def test_with_a_signing_key_the_manifest_and_its_report_are_signed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from cuvil.artifact import list_referrers
    from cuvil.artifact.api import resolve
    from cuvil.artifact.media_types import REPORT
    from cuvil.artifact.trust import TrustSettings, check_reference
    from tests.fixtures.keys import make_key_pair

    key, public = make_key_pair(tmp_path / "keys", "worker", password="s3cret")
    (tmp_path / "keys" / "password").write_text("s3cret\n")
    monkeypatch.setenv("CUVIL_SIGNING_KEY", str(key))
    monkeypatch.setenv("CUVIL_SIGNING_KEY_PASSWORD_FILE", str(tmp_path / "keys" / "password"))
    monkeypatch.setenv("CUVIL_SIGNER", "ci-worker")
    assert main(["compile", str(_spec(tmp_path)), "--bench-iterations", "2"]) == 0
    capsys.readouterr()
    layout = f"oci:{tmp_path / 'layout'}"
    trust = TrustSettings.load("require", [public])
    found = resolve(f"{layout}:v1", trust=trust, cache_dir=tmp_path / "cache")
    (report,) = list_referrers(f"{layout}@{found.digest}", artifact_type=REPORT)
    (check,) = check_reference(f"{layout}@{report.digest}", trust.keys)
    assert check.verified and check.signer == "ci-worker" and check.trusted_key == "worker.pub"


def test_the_summary_of_a_cuda_target_says_its_speed_was_not_measured(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = _spec(tmp_path, "")
    path = tmp_path / "mlp.cuvil"
    assert main(["compile", str(spec), "-o", str(path), "--target", "cuda-sm_87"]) == 0
    captured = capsys.readouterr()
    out = " ".join((captured.out + captured.err).split())  # the console may wrap
    assert "for cuda-sm_87" in out and "speed not measured here" in out and "x eager" not in out
    assert "verified on CPU by interpretation" in out
