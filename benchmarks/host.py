"""What a benchmark report says of the machine it ran on."""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any


def cpu_name() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (``platform.processor()`` elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def emit(report: Any, out: str | Path | None) -> None:
    """The report as indented JSON on stdout, and into ``out`` where one is named."""
    text = json.dumps(report, indent=2)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
