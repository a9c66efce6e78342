"""The ``cuvil`` command as a user runs it: compile, inspect, run, and clear errors."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def cuvil(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cuvil_cli.main", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "small.cuvil"
    result = cuvil("compile", "tests.cuvil.factories:small", "-o", str(path))
    assert result.returncode == 0, result.stderr
    assert "input  input: f32[batch, 8]" in result.stdout
    return path


def test_inspect_shows_signature_histogram_and_ir(artifact: Path) -> None:
    result = cuvil("inspect", str(artifact), "--ir")
    assert result.returncode == 0, result.stderr
    assert "symbol batch in [1, 4]" in result.stdout
    assert "cuvil.linear" in result.stdout
    assert "graph @small {" in result.stdout


def test_inspect_memory_shows_planned_naive_measured_and_lifetimes(artifact: Path) -> None:
    result = cuvil("inspect", str(artifact), "--memory")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    numbers = {}
    for label in ("planned peak", "naive", "measured peak"):
        line = next(x for x in lines if x.strip().startswith(label))
        numbers[label] = int(line.split()[-2].replace(",", ""))
    assert 0 < numbers["planned peak"] <= numbers["naive"]
    assert 0 < numbers["measured peak"] <= 1.1 * numbers["planned peak"]
    chart = lines[lines.index("lifetimes:") + 2 :]
    assert chart and all(re.search(r"\|\s*#+\s*\|$", row) for row in chart if "%" in row)


def test_inspect_draws_the_fused_graph(artifact: Path, tmp_path: Path) -> None:
    dot, svg = tmp_path / "g.dot", tmp_path / "g.svg"
    result = cuvil("inspect", str(artifact), "--dot", str(dot), "--svg", str(svg))
    assert result.returncode == 0, result.stderr
    assert "patterns: linear_act x1, linear_plain x1" in result.stdout
    text = dot.read_text()
    assert "cuvil.linear" in text and "const" not in text
    assert (
        svg.read_bytes().lstrip().startswith((b"<?xml", b"<svg"))
        and b"cuvil.linear" in svg.read_bytes()
    )


def test_run_on_golden_inputs_compares_with_eager(artifact: Path) -> None:
    result = cuvil("run", str(artifact), "--runs", "3")
    assert result.returncode == 0, result.stderr
    line = next(x for x in result.stdout.splitlines() if "vs eager output" in x)
    assert float(line.split("max abs ")[1].split(",")[0]) < 1e-5
    assert "latency over 3 runs" in result.stdout


def test_run_with_a_dim_outside_its_range_is_a_clear_error(artifact: Path) -> None:
    result = cuvil("run", str(artifact), "--dim", "batch=5")
    assert result.returncode == 2
    assert "outside its declared range [1, 4]" in result.stderr


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("tests.cuvil.factories", "not 'module:factory'"),
        ("tests.cuvil.nowhere:small", "cannot import"),
        ("tests.cuvil.factories:not_a_model", "factory returned str"),
    ],
)
def test_bad_spec_is_a_clear_error(spec: str, message: str, tmp_path: Path) -> None:
    result = cuvil("compile", spec, "-o", str(tmp_path / "x.cuvil"))
    assert result.returncode == 2
    assert message in result.stderr


def test_piped_output_keeps_every_digest_on_one_line(tmp_path: Path) -> None:
    """Stdout and stderr are pipes here, as in ``cuvil … | grep``: no line is broken at a
    console width, so each ``sha256:`` is followed by its 64 hex digits on the same line."""
    layout = tmp_path / ("a-folder-name-long-enough-to-pass-eighty-columns-" * 2) / "layout"
    spec = tmp_path / "mlp.yaml"
    spec.write_text(
        "apiVersion: cuvil.dev/v1alpha1\nkind: ModelCompilation\n"
        "metadata: {name: mlp-piped}\nspec:\n  source: {builtin: {name: mlp}}\n"
        f"  targets: [cpu-x86_64]\n  output: {{repository: 'oci:{layout}', tag: v1}}\n"
    )
    runs = [
        cuvil("compile", "tests.cuvil.factories:small", "-o", f"oci:{layout}:small"),
        cuvil("compile", str(spec), "--bench-iterations", "2"),
        cuvil("inspect", f"oci:{layout}:v1"),
        cuvil("pull", f"oci:{layout}:small", "-o", str(tmp_path / "pulled.cuvil")),
    ]
    digests = 0
    for run in runs:
        assert run.returncode == 0, run.stderr
        for line in (run.stdout + run.stderr).splitlines():
            found = re.findall(r"sha256:([0-9a-f]*)", line)
            assert all(len(hexdigest) == 64 for hexdigest in found), line
            digests += len(found)
        assert not (run.stdout + run.stderr).startswith("\n"), "a spinner's blank line"
    assert digests >= 5, [run.stdout + run.stderr for run in runs]
