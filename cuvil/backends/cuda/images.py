"""Which image of a kernel a GPU loads: its cubin where the GPU runs that architecture, else its
PTX where the driver can JIT-compile that for the GPU, else none — and then the artifact is
refused with both architectures named.

A cubin for ``sm_XY`` runs on GPUs of compute capability ``X.Y'`` with ``Y' >= Y`` (same major);
an arch-specific cubin (``sm_90a``) only on ``9.0`` itself. PTX for ``sm_XY`` JIT-compiles for any
GPU of capability ``X.Y`` or newer (slower to load, and without the arch-specific instructions
the cubin has). This is pure: it takes the manifest and a compute capability, and is tested on
the CPU.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cuvil.backends.base import TargetUnavailableError

_ARCH = re.compile(r"sm_(\d+)(a?)")


class ArchitectureError(TargetUnavailableError):
    """No image of a kernel runs on this GPU."""


@dataclass(frozen=True)
class Image:
    kind: str  # "cubin" or "ptx"
    arch: str  # the architecture it was built for
    file: str  # its file in the kernels layer
    symbol: str
    shared: int  # dynamic shared memory per block (bytes)


def parse_arch(arch: str) -> tuple[int, bool]:
    """``"sm_90a"`` -> ``(90, True)``."""
    found = _ARCH.fullmatch(arch)
    if found is None:
        raise ValueError(f"not a GPU architecture: {arch!r}")
    return int(found.group(1)), bool(found.group(2))


def cubin_runs_on(arch: str, capability: int) -> bool:
    built, specific = parse_arch(arch)
    if specific:
        return built == capability
    return built // 10 == capability // 10 and built % 10 <= capability % 10


def choose_image(manifest: Mapping[str, Any], capability: int, device: str = "") -> Image:
    """The image of ``manifest``'s kernel for a GPU of ``capability`` (e.g. 90 for 9.0)."""
    if cubin_runs_on(manifest["arch"], capability):
        return Image(
            "cubin", manifest["arch"], manifest["cubin"], manifest["symbol"], manifest["shared"]
        )
    ptx_arch = manifest.get("ptx_arch")
    if ptx_arch and parse_arch(ptx_arch)[0] <= capability:
        return Image(
            "ptx", ptx_arch, manifest["ptx"], manifest["ptx_symbol"], manifest["ptx_shared"]
        )
    named = f"sm_{capability}" + (f" ({device})" if device else "")
    raise ArchitectureError(
        f"kernel {manifest['name']} is built for {manifest['arch']} (PTX for {ptx_arch}); "
        f"this GPU is {named}: compile the model for cuda-sm_{capability}"
    )
