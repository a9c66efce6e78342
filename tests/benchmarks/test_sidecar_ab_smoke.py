"""The side-by-side benchmark end to end on the MLP, the working tree against its own HEAD: two
sidecars at once, alternating calls at concurrency 1 and windows at 16, one JSON document on
stdout, both sides on one tactics cache, a variable set for one side only, and the base's
worktree gone afterwards."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.benchmarks.scripts import REPO, run_report


def test_mlp_against_head(tmp_path: Path) -> None:
    report = run_report(
        "sidecar_ab.py",
        *("--base", "HEAD", "--models", "mlp", "--rounds", "1", "--window", "0.3"),
        *("--scale", "20", "--artifacts", str(tmp_path), "--shared-tactics"),
        *("--env", "GOMP_SPINCOUNT=4000"),
    )
    assert report["base"] == "HEAD" and report["shared_tactics"] is True
    assert report["env"] == {"GOMP_SPINCOUNT": "4000"} and report["base_env"] == {}
    for mode in ("c1", "c16"):  # each sidecar says which spin it runs with
        assert (
            "GOMP_SPINCOUNT=4000, as set"
            in (tmp_path / f"ab-mlp-{mode}-working_tree.log").read_text()
        )
        assert "GOMP_SPINCOUNT=4000" not in (tmp_path / f"ab-mlp-{mode}-base.log").read_text()
    assert list((tmp_path / "tactics").iterdir())  # the first sidecar kept its kernel choices
    c1, c16 = report["mlp"]["c1"], report["mlp"]["c16"]
    assert set(c1) == set(c16) == {"base", "working_tree"}
    assert all(p50 > 0 for p50 in c1.values())
    assert all(side["qps"] > 0 and side["p95_ms"] > 0 for side in c16.values())
    trees = subprocess.run(
        ["git", "-C", str(REPO), "worktree", "list"], capture_output=True, text=True, check=True
    )
    assert "cuvil-ab-" not in trees.stdout  # the base's checkout was removed
