"""Tars of plain files, the one way artifacts and their kernels layer are packed and unpacked.

Written in the order given with fixed metadata (mtime 0, mode 644), so the same files give the
same bytes and digest. Read back refusing anything but regular files with an expected name
(no folders, links or devices), each under a size bound and named once; nothing is extracted to
disk, executed or unpickled.
"""

from __future__ import annotations

import io
import tarfile
from collections.abc import Callable, Iterable
from typing import IO

from cuvil.artifact.errors import ArtifactError


def write_plain_tar(target: IO[bytes], files: Iterable[tuple[str, bytes]]) -> None:
    with tarfile.open(fileobj=target, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in files:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tar.addfile(info, io.BytesIO(data))


def read_plain_tar(
    source: IO[bytes], *, origin: str, is_expected: Callable[[str], bool], max_bytes: int
) -> dict[str, bytes]:
    """Every member of the tar by name; an ArtifactError naming ``origin`` for anything else."""
    files: dict[str, bytes] = {}
    try:
        with tarfile.open(fileobj=source, mode="r:") as tar:
            for member in tar:
                if not is_expected(member.name):
                    raise ArtifactError(f"{origin}: unexpected member {member.name!r}")
                if not member.isfile() or member.size > max_bytes or member.name in files:
                    raise ArtifactError(f"{origin}: member {member.name!r} is not a plain file")
                extracted = tar.extractfile(member)
                assert extracted is not None
                files[member.name] = extracted.read()
    except tarfile.TarError as error:
        raise ArtifactError(f"{origin} is not a tar of plain files: {error}") from None
    return files
