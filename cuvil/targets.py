"""Target names, in one place: what ``cpu-x86_64``, ``cpu-x86_64-amx``, ``cuda-sm_90`` mean.

A target is a family (``cpu`` or ``cuda``, which picks the backend) and a variant (the CPU
architecture and ISA level, or the GPU architecture). The generic ``cpu`` and ``cuda`` name
the family alone. Everything that reads a target name — the compiler's backend choice, the
worker's queue per target, the operator's CRD, the sidecar's pick from an index — parses it here.
This module imports nothing heavy (the operator uses it without torch).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

FAMILIES = ("cpu", "cuda")
CPU_ARCHES = ("x86_64", "aarch64")
CPU_ISAS = ("avx512", "amx")  # x86_64 levels above the baseline, in rising order
# ISA level -> the /proc/cpuinfo flags a CPU needs for code built for that level
CPU_ISA_FLAGS = {"avx512": frozenset({"avx512f"}), "amx": frozenset({"amx_tile", "amx_bf16"})}
CUDA_ARCHES = ("sm_80", "sm_86", "sm_87", "sm_89", "sm_90")
# The targets a ModelCompilation may name (the CRD's enum), most common first.
KNOWN_TARGETS = (
    "cpu-x86_64",
    "cpu-x86_64-avx512",
    "cpu-x86_64-amx",
    "cpu-aarch64",
    *(f"cuda-{arch}" for arch in CUDA_ARCHES),
)
_CUDA_VARIANT = re.compile(r"sm_(\d)(\d)(a?)")


class TargetError(ValueError):
    """A name that is not a target."""


@dataclass(frozen=True)
class Target:
    name: str
    family: str  # "cpu" | "cuda"
    variant: str  # "x86_64", "x86_64-amx", "sm_90", or "" for the family alone

    @property
    def queue(self) -> str:
        """The Celery queue its compile tasks go to: ``cuvil.cpu``, ``cuvil.cuda.sm_90``."""
        if self.family == "cpu" or not self.variant:
            return f"cuvil.{self.family}"
        return f"cuvil.cuda.{self.variant}"

    @property
    def compute_capability(self) -> tuple[int, int] | None:
        """(9, 0) for ``cuda-sm_90``; None for CPU targets and the bare ``cuda``."""
        found = _CUDA_VARIANT.fullmatch(self.variant) if self.family == "cuda" else None
        return (int(found.group(1)), int(found.group(2))) if found else None

    @property
    def cpu_isa(self) -> str | None:
        """``amx`` for ``cpu-x86_64-amx``, None for the baseline and for GPU targets."""
        if self.family != "cpu":
            return None
        _, _, isa = self.variant.partition("-")
        return isa or None


def parse_target(name: str) -> Target:
    """``cpu``, ``cpu-x86_64``, ``cpu-x86_64-amx``, ``cuda``, ``cuda-sm_90`` … -> Target."""
    family, _, variant = name.partition("-")
    if family not in FAMILIES:
        raise TargetError(
            f"unknown target {name!r}: a target starts with one of {list(FAMILIES)} "
            f"(known: {list(KNOWN_TARGETS)})"
        )
    if family == "cpu" and variant:
        arch, _, isa = variant.partition("-")
        if arch not in CPU_ARCHES or (isa and (arch != "x86_64" or isa not in CPU_ISAS)):
            raise TargetError(
                f"unknown CPU target {name!r}: cpu-<arch>[-<isa>] with arch in "
                f"{list(CPU_ARCHES)} and, on x86_64, isa in {list(CPU_ISAS)}"
            )
    if family == "cuda" and variant and not _CUDA_VARIANT.fullmatch(variant):
        raise TargetError(f"unknown CUDA target {name!r}: cuda-sm_<major><minor>, e.g. cuda-sm_90")
    return Target(name, family, variant)
