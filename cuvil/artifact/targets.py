"""Which index entry this machine runs: probe the CPU ISA and the GPU, rank the targets.

Targets are the names of ``cuvil.targets`` (``cpu-x86_64``, ``cpu-x86_64-amx``, ``cuda-sm_90``…)
plus the generic ``cpu``. A machine's CPU candidates come best first, the most specific ISA down
to the generic build; its GPU candidates, the exact architecture, then older minors of the same
major (a cubin for sm_80 runs on sm_86/87/89, not on sm_90), rank after them (see
``probe_targets``). An index entry is picked by the first candidate it offers; when none
matches, the error lists what the index offers and what this machine accepts.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any

from cuvil.artifact import media_types as mt
from cuvil.artifact.errors import NoMatchingTargetError
from cuvil.targets import CPU_ISA_FLAGS, CPU_ISAS

_MACHINE_ARCH = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The ``flags`` of the first processor in /proc/cpuinfo (empty where there is none)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def cpu_targets(arch: str, flags: Iterable[str]) -> list[str]:
    """CPU candidates, best first: ``cpu-x86_64-amx`` > ``-avx512`` > ``cpu-x86_64`` > ``cpu``."""
    flags = set(flags)
    arch = _MACHINE_ARCH.get(arch, arch)
    found: list[str] = []
    if arch == "x86_64":
        found += [f"cpu-x86_64-{isa}" for isa in reversed(CPU_ISAS) if CPU_ISA_FLAGS[isa] <= flags]
    found.extend([f"cpu-{arch}", "cpu"])
    return found


def cuda_targets(capabilities: Iterable[tuple[int, int]]) -> list[str]:
    """CUDA candidates for the GPUs' compute capabilities: sm_90a, sm_90, then older minors."""
    found: list[str] = []
    for major, minor in capabilities:
        names = [f"cuda-sm_{major}{minor}a", f"cuda-sm_{major}{minor}"]
        names += [f"cuda-sm_{major}{older}" for older in range(minor - 1, -1, -1)]
        found += [name for name in names if name not in found]
    if found:
        found.append("cuda")
    return found


def _nvidia_smi_capabilities() -> list[tuple[int, int]] | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        output = subprocess.run(
            ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    capabilities = []
    for line in output.split():
        major, _, minor = line.strip().partition(".")
        if major.isdigit() and minor.isdigit():
            capabilities.append((int(major), int(minor)))
    return capabilities


def gpu_capabilities() -> list[tuple[int, int]]:
    """Compute capabilities of the visible GPUs: nvidia-smi, else torch if already imported."""
    found = _nvidia_smi_capabilities()
    if found is not None:
        return found
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]


@cache
def machine_targets() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(this machine's CPU targets, its GPUs' CUDA targets), each best first; probed once."""
    cpu = cpu_targets(platform.machine(), cpu_flags())
    return tuple(cpu), tuple(cuda_targets(gpu_capabilities()))


def probe_targets() -> list[str]:
    """This machine's targets, best first: its GPUs' (the CUDA plan runs there), then its
    CPU's. With ``CUVIL_CUDA_EXECUTOR=interpreter`` (CUDA plans run on the CPU by Triton's
    interpreter, for checks) the CPU's rank first."""
    cpu, cuda = (list(found) for found in machine_targets())
    if os.environ.get("CUVIL_CUDA_EXECUTOR") == "interpreter":
        return cpu + cuda
    return cuda + cpu


def entry_target(entry: Mapping[str, Any]) -> str | None:
    return entry.get("annotations", {}).get(mt.ANNOTATION_TARGET)


def select_entry(
    entries: Sequence[Mapping[str, Any]],
    candidates: Sequence[str] | None = None,
    *,
    precision: str | None = None,
) -> Mapping[str, Any]:
    """The index entry for the first candidate (default: ``probe_targets()``) it offers."""
    candidates = list(candidates) if candidates is not None else probe_targets()
    usable = [
        entry
        for entry in entries
        if precision is None
        or entry.get("annotations", {}).get(mt.ANNOTATION_PRECISION)
        in (
            None,
            precision,
        )
    ]
    by_target: dict[str, Mapping[str, Any]] = {}
    for entry in usable:
        target = entry_target(entry)
        if target is not None:
            by_target.setdefault(target, entry)
    for candidate in candidates:
        if candidate in by_target:
            return by_target[candidate]
    offered = sorted({entry_target(entry) or "<no target annotation>" for entry in entries})
    raise NoMatchingTargetError(
        f"the index offers targets {offered}"
        + (f" (precision {precision})" if precision else "")
        + f"; this machine accepts {candidates}"
    )
