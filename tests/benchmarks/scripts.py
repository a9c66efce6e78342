"""Running a benchmark script as a user would: its own process, from the repository root."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def run_report(script: str, *args: str) -> Any:
    """``benchmarks/SCRIPT ARGS...`` (or ``python -m benchmarks.SCRIPT`` for a script name
    without ``.py``); its JSON report (stdout), after checking it succeeded."""
    command = [str(REPO / "benchmarks" / script)] if script.endswith(".py") else ["-m", script]
    done = subprocess.run(
        [sys.executable, *command, *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)
