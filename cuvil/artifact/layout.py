"""A local OCI image layout directory, with the same interface as a registry repository.

The embedded default when no registry is configured
(https://github.com/opencontainers/image-spec/blob/main/image-layout.md): ``oci-layout``,
``index.json`` (tags as ``org.opencontainers.image.ref.name`` annotations) and
``blobs/sha256/<hex>``. Blobs are written to a temporary name and renamed into place; updates of
``index.json`` hold a file lock, so several processes may push into one layout.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from filelock import FileLock

from cuvil.artifact import media_types as mt
from cuvil.artifact.errors import DigestMismatchError, NotFoundError
from cuvil.artifact.manifests import Blob, build_descriptor, sha256_digest
from cuvil.artifact.reference import Reference, is_digest

_CHUNK = 1 << 20


def atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


class LayoutStore:
    def __init__(self, root: Path, *, create: bool = False) -> None:
        self.root = Path(root)
        self.location = Reference(layout=self.root)
        if not (self.root / "oci-layout").is_file():
            if not create:
                raise NotFoundError(f"{self.root} is not an OCI image layout (no oci-layout file)")
            self.root.mkdir(parents=True, exist_ok=True)
            atomic_write(self.root / "oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
        if not (self.root / "index.json").is_file():
            self._write_index({"schemaVersion": 2, "mediaType": mt.OCI_INDEX, "manifests": []})

    def _blob_path(self, digest: str) -> Path:
        if not is_digest(digest):
            raise ValueError(f"{digest!r} is not a sha256 digest")
        return self.root / "blobs" / "sha256" / digest.split(":", 1)[1]

    def _read_index(self) -> dict[str, Any]:
        index: dict[str, Any] = json.loads((self.root / "index.json").read_text())
        return index

    def _write_index(self, index: dict[str, Any]) -> None:
        atomic_write(self.root / "index.json", json.dumps(index, indent=2).encode())

    def _tagged(self, tag: str) -> dict[str, Any]:
        for entry in self._read_index().get("manifests", []):
            if entry.get("annotations", {}).get(mt.ANNOTATION_REF_NAME) == tag:
                return dict(entry)
        raise NotFoundError(f"layout {self.root} has no tag {tag!r}")

    def get_manifest(self, reference: str) -> tuple[bytes, str]:
        digest = self.resolve(reference)
        data = self._read_blob(digest)
        media_type = json.loads(data).get("mediaType", mt.OCI_MANIFEST)
        return data, media_type

    def resolve(self, reference: str) -> str:
        if is_digest(reference):
            return reference
        digest: str = self._tagged(reference)["digest"]
        return digest

    def _read_blob(self, digest: str) -> bytes:
        path = self._blob_path(digest)
        if not path.is_file():
            raise NotFoundError(f"layout {self.root} has no blob {digest}")
        data = path.read_bytes()
        if sha256_digest(data) != digest:
            raise DigestMismatchError(f"layout {self.root}: blob {digest} is corrupt: refused")
        return data

    def put_manifest(self, data: bytes, media_type: str, tag: str | None) -> str:
        digest = sha256_digest(data)
        atomic_write(self._blob_path(digest), data)
        if tag is None:
            return digest
        with FileLock(str(self.root / "index.json.lock")):
            index = self._read_index()
            kept = [
                entry
                for entry in index.get("manifests", [])
                if entry.get("annotations", {}).get(mt.ANNOTATION_REF_NAME) != tag
            ]
            entry = build_descriptor(media_type, data, {mt.ANNOTATION_REF_NAME: tag})
            artifact_type = json.loads(data).get("artifactType")
            if artifact_type:
                entry["artifactType"] = artifact_type
            index["manifests"] = [*kept, entry]
            self._write_index(index)
        return digest

    def has_blob(self, digest: str) -> bool:
        return self._blob_path(digest).is_file()

    def put_blob(self, blob: Blob) -> None:
        atomic_write(self._blob_path(blob.digest), blob.data)

    def fetch_blob(self, digest: str, destination: Path) -> int:
        source = self._blob_path(digest)
        if not source.is_file():
            raise NotFoundError(f"layout {self.root} has no blob {digest}")
        hasher = hashlib.sha256()
        partial = destination.with_name(destination.name + ".partial")
        with source.open("rb") as src, partial.open("wb") as out:
            while chunk := src.read(_CHUNK):
                hasher.update(chunk)
                out.write(chunk)
        if "sha256:" + hasher.hexdigest() != digest:
            partial.unlink(missing_ok=True)
            raise DigestMismatchError(f"layout {self.root}: blob {digest} is corrupt: refused")
        partial.replace(destination)
        return destination.stat().st_size

    def referrers(self, digest: str) -> dict[str, Any] | None:
        return None  # the layout keeps referrers under the tag schema, like Distribution 2.8
