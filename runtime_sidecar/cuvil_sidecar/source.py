"""Where the served model comes from: ``CUVIL_MODEL`` as a local artifact or an OCI reference.

``digest()`` is the cheap question a reload asks ("has it changed?"); ``fetch()`` brings the
artifact to a local path (through ``cuvil.artifact.resolve_model`` and the node cache for OCI
layouts and registry references, which also verifies every blob and picks this machine's target).
For a local artifact the digest is that of its ``config.json``, which records the digest of
every other file, so it changes whenever any part of the artifact does.
"""

from __future__ import annotations

import hashlib
import tarfile
from pathlib import Path

from cuvil.artifact import media_types as mt


class SourceError(OSError):
    """The model reference cannot be read or resolved now."""


class ModelSource:
    """``reference``, or what ``reference_file`` holds when it exists and is not empty (read
    again on every question, so a rewritten file is followed)."""

    def __init__(
        self, reference: str, cache_dir: Path | None = None, reference_file: Path | None = None
    ) -> None:
        self.default_reference = reference
        self.cache_dir = cache_dir
        self.reference_file = reference_file

    @property
    def reference(self) -> str:
        if self.reference_file is not None:
            try:
                named = self.reference_file.read_text().strip()
            except FileNotFoundError:
                named = ""
            if named:
                return named
        return self.default_reference

    @property
    def is_local(self) -> bool:
        return not self.reference.startswith("oci:") and Path(self.reference).exists()

    def digest(self) -> str:
        if self.is_local:
            return config_digest(Path(self.reference))
        from cuvil.artifact import resolve_digest

        return str(resolve_digest(self.reference))

    def fetch(self) -> Path:
        return self.fetch_resolved()[0]

    def fetch_resolved(self) -> tuple[Path, str | None]:
        """The local artifact and the digest of the OCI manifest it came from (None for a
        local artifact path): the per-target manifest, also when the reference names an index."""
        from cuvil.artifact.api import resolve

        resolution = resolve(self.reference, cache_dir=self.cache_dir)
        return Path(resolution.path), resolution.digest

    def __str__(self) -> str:
        return self.reference


def config_digest(path: Path) -> str:
    """sha256 of an artifact's config.json (directory or tar form), reading nothing else."""
    try:
        if path.is_dir():
            data = (path / mt.CONFIG_FILE).read_bytes()
        else:
            with tarfile.open(path, "r:") as tar:
                member = tar.extractfile(mt.CONFIG_FILE)
                if member is None:
                    raise SourceError(f"{path}: {mt.CONFIG_FILE} is not a file")
                data = member.read()
    except (OSError, KeyError, tarfile.TarError) as error:
        raise SourceError(f"cannot read the artifact config at {path}: {error}") from None
    return "sha256:" + hashlib.sha256(data).hexdigest()
