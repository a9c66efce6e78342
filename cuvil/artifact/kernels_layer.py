"""The kernels layer (``kernels.tar``): the files a backend's codegen wrote for an artifact.

A plain tar of flat, regular files (compiled kernels, their sources and JSON manifests), written
in a fixed order with fixed metadata so the same files give the same digest. Reading refuses
anything but plain members with simple names (no folders, links or ``..``), and nothing in it is
executed or unpickled here: the backend that wrote it decides what its files mean.
"""

from __future__ import annotations

import io
import re
from collections.abc import Mapping

from cuvil.artifact.errors import ArtifactError
from cuvil.artifact.plain_tar import read_plain_tar, write_plain_tar

MEMBER_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,200}")
MAX_KERNEL_BYTES = 2**30


def pack_kernels(files: Mapping[str, bytes]) -> bytes | None:
    """The layer's bytes, or None when the backend wrote no files (the artifact has no layer)."""
    if not files:
        return None
    bad = [name for name in files if not MEMBER_NAME.fullmatch(name)]
    if bad:
        raise ArtifactError(f"kernels layer: {bad[0]!r} is not a plain file name")
    buffer = io.BytesIO()
    write_plain_tar(buffer, [(name, files[name]) for name in sorted(files)])
    return buffer.getvalue()


def unpack_kernels(data: bytes | None) -> dict[str, bytes]:
    """The layer's files by name (empty for an artifact without one)."""
    if data is None:
        return {}
    return read_plain_tar(
        io.BytesIO(data),
        origin="kernels layer",
        is_expected=lambda name: MEMBER_NAME.fullmatch(name) is not None,
        max_bytes=MAX_KERNEL_BYTES,
    )
