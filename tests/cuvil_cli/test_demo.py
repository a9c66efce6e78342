"""``cuvil demo`` end to end on the MLP: the worker's pipeline compiles it into a local OCI
layout, a real ``cuvil-sidecar`` process serves it from ``oci:LAYOUT:mlp``, NVIDIA's
tritonclient queries it, the answers match eager, and one trace holds both halves."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cuvil_cli.main import main

REPO = Path(__file__).resolve().parents[2]
REF_NAME = "org.opencontainers.image.ref.name"  # the tag, in an OCI layout's index.json


def run_demo(
    out: Path, *extra: str, models: str = "cuvil.models:mlp"
) -> tuple[subprocess.CompletedProcess[str], float]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("CUVIL_", "OTEL_"))}
    environ |= {"HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore::FutureWarning"}
    command = [sys.executable, "-m", "cuvil_cli.main", "demo", "--models", models]
    started = time.monotonic()
    done = subprocess.run(
        [*command, "--out", str(out), "--bench-iterations", "5", *extra],
        env=environ,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done, time.monotonic() - started


def test_demo_compiles_serves_and_checks_the_mlp(tmp_path: Path) -> None:
    done, seconds = run_demo(tmp_path / "out", "--requests", "5")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert seconds < 90, f"the MLP demo took {seconds:.0f} s"
    out = done.stdout
    # The worker's report: fusions fired, validation and latency against eager.
    assert "compiled for cpu-x86_64 by the worker pipeline" in out
    assert re.search(r"ops: 12 -> 10 after \d+ passes; patterns fired: linear_act=2", out)
    assert "validation vs eager fp32 (4 samples)" in out
    # Served from the layout by a real sidecar, asked by tritonclient, checked against eager.
    layout = tmp_path / "out" / "layout"
    index = json.loads((layout / "index.json").read_text())
    tags = [
        m.get("annotations", {}).get("org.opencontainers.image.ref.name")
        for m in index["manifests"]
    ]
    assert "mlp" in tags
    assert "5 tritonclient ModelInfer requests (x [1, 784])" in out
    # the front end: gRPC C++ where the machine has it (scripts/test installs it)
    served = out.count("sidecar ready in")
    assert served >= 1 and out.count("serving on the native gRPC front end") == served, out
    # the same requests through shared memory, each answer checked against the gRPC one
    assert re.search(r"tensors in shared memory .*: sidecar p50 (\d+\.\d ms|\d+ µs)", out)
    assert re.search(r"answers vs eager: max error \S+ of the output scale \(ok\)", out)
    # One trace: the compile spans (this process) and the serving spans (the sidecar, over OTLP).
    tree = out[out.index("== trace") : out.index("== summary")]
    for name in ("cuvil.compile_target", "cuvil.export", "cuvil.push", "cuvil.push_index"):
        assert name in tree
    assert re.search(r"/inference\.GRPCInferenceService/ModelInfer .*\[cuvil-sidecar\]", tree)
    assert re.search(r"cuvil\.execute .*\[cuvil-sidecar\]", tree)
    summary = out[out.index("== summary") :].splitlines()
    row = next(line for line in summary if line.startswith("mlp "))
    assert row.rstrip().endswith("ok") and "12->10" in row
    assert summary[-1].startswith("demo: ok: 1 model(s) compiled through the worker pipeline")


def test_demo_without_serving_stores_the_artifact(tmp_path: Path) -> None:
    done, _ = run_demo(tmp_path / "out", "--no-serve")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "served by cuvil-sidecar" not in done.stdout
    assert (tmp_path / "out" / "layout" / "index.json").is_file()
    assert done.stdout.splitlines()[-1].startswith("demo: ok: 1 model(s)")


@pytest.mark.parametrize("models", ["os:getcwd", "cuvil.models"])
def test_demo_refuses_what_the_worker_cannot_compile(
    models: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", "--models", models]) == 2
    assert "the demo compiles through the worker" in capsys.readouterr().err


def test_demo_exits_nonzero_when_a_check_fails(tmp_path: Path) -> None:
    """A gate nothing can meet: the worker refuses the model, the summary says so, exit 1."""
    spec = tmp_path / "strict.yaml"
    spec.write_text(
        "apiVersion: cuvil.dev/v1alpha1\n"
        "kind: ModelCompilation\n"
        "metadata: {name: mlp-strict}\n"
        "spec:\n"
        "  source: {builtin: {name: mlp}}\n"
        "  targets: [cpu-x86_64]\n"
        "  gates: {maxAbsError: 0.0}\n"
    )
    done, _ = run_demo(tmp_path / "out", "--no-serve", models=str(spec))
    assert done.returncode == 1, done.stdout[-4000:] + done.stderr[-4000:]
    row = next(line for line in done.stdout.splitlines() if line.startswith("mlp-strict "))
    assert "FAILED: GateFailed: gate maxAbsError failed" in row
    assert done.stdout.splitlines()[-1].startswith("demo: FAILED: 1 model(s)")
