"""Where the served model comes from: ``CUVIL_MODEL`` as a local artifact or an OCI reference.

``digest()`` is the cheap question a reload asks ("has it changed?"); ``fetch()`` brings the
artifact to a local path (through ``cuvil.artifact.resolve_model`` and the node cache for OCI
layouts and registry references, which also verifies every blob and picks this machine's target).
For a local artifact the digest is that of its ``config.json``, which records the digest of
every other file, so it changes whenever any part of the artifact does.
"""

from __future__ import annotations

import hashlib
import logging
import tarfile
from pathlib import Path
from typing import TYPE_CHECKING

from cuvil.artifact import media_types as mt

if TYPE_CHECKING:
    from cuvil.artifact.trust import TrustSettings


log = logging.getLogger("cuvil_sidecar.source")


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
        """What the reference names now. A tag whose registry cannot be reached names the
        digest it last resolved to on this node (the node cache keeps it, and the artifact),
        saying so: a sidecar restarts while its registry is down."""
        if self.is_local:
            return config_digest(Path(self.reference))
        from cuvil.artifact import resolve_digest
        from cuvil.artifact.api import parse_model_reference
        from cuvil.artifact.cache import NodeCache
        from cuvil.artifact.errors import RegistryUnavailableError

        try:
            return str(resolve_digest(self.reference))
        except RegistryUnavailableError as error:
            ref = parse_model_reference(self.reference)
            remembered = ref.digest or NodeCache(self.cache_dir).lookup_tag(str(ref))
            if remembered is None:
                raise
            log.warning(
                "%s; %s last resolved to %s on this node: using that", error, ref, remembered
            )
            return remembered

    def fetch(self) -> Path:
        return self.fetch_resolved()[0]

    def fetch_resolved(self, trust: TrustSettings | None = None) -> tuple[Path, str | None]:
        """The local artifact and the digest of the OCI manifest it came from (None for a
        local artifact path): the per-target manifest, also when the reference names an index.
        With ``trust``, its signatures are checked by policy before it is downloaded."""
        from cuvil.artifact.api import resolve

        resolution = resolve(self.reference, cache_dir=self.cache_dir, trust=trust)
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
