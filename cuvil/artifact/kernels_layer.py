"""The kernels layer (``kernels.tar``): the files a backend's codegen wrote for an artifact.

A plain tar of flat, regular files (compiled kernels, their sources and JSON manifests), written
in a fixed order with fixed metadata so the same files give the same digest. Reading refuses
anything but plain members with simple names (no folders, links or ``..``), and nothing in it is
executed or unpickled here: the backend that wrote it decides what its files mean.
"""

from __future__ import annotations

import io
import re
import tarfile
from collections.abc import Mapping

from cuvil.artifact.files import ArtifactError

MEMBER_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,200}")
MAX_KERNEL_BYTES = 2**30


def pack_kernels(files: Mapping[str, bytes]) -> bytes | None:
    """The layer's bytes, or None when the backend wrote no files (the artifact has no layer)."""
    if not files:
        return None
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(files):
            if not MEMBER_NAME.fullmatch(name):
                raise ArtifactError(f"kernels layer: {name!r} is not a plain file name")
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(files[name]), 0, 0o644
            tar.addfile(info, io.BytesIO(files[name]))
    return buffer.getvalue()


def unpack_kernels(data: bytes | None) -> dict[str, bytes]:
    """The layer's files by name (empty for an artifact without one)."""
    if data is None:
        return {}
    files: dict[str, bytes] = {}
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            for member in tar:
                if not member.isfile() or not MEMBER_NAME.fullmatch(member.name):
                    raise ArtifactError(f"kernels layer: refusing member {member.name!r}")
                if member.size > MAX_KERNEL_BYTES or member.name in files:
                    raise ArtifactError(f"kernels layer: member {member.name!r} is too large")
                extracted = tar.extractfile(member)
                assert extracted is not None
                files[member.name] = extracted.read()
    except tarfile.TarError as error:
        raise ArtifactError(f"kernels layer is not a tar: {error}") from None
    return files
