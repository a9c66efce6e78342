"""The node cache: content-addressed artifacts shared by every process on a node.

Layout under the root (``$CUVIL_CACHE_DIR``, default ``~/.cache/cuvil``)::

    manifests/sha256/<hex>          manifests and indexes (small JSON, verified on every read)
    artifacts/sha256/<hex>/         one directory per artifact manifest digest: its files,
                                    manifest.json, and .verified (stat stamps of checked files)
    refs/<sha256 of ref>.json       the digest a tag resolved to last (offline fallback)
    locks/<hex>.lock                one file lock per digest; tmp/ for downloads in progress

A download happens under the digest's lock into ``tmp/`` and is renamed into place only after
every blob matched its digest, so a second process waiting on the lock finds the finished entry
and downloads nothing. A hit re-hashes any file whose stat (size, mtime, ctime, inode) differs
from the stamp taken when it was verified: a tampered file is found and the entry dropped.
Entries are evicted least recently used first once the total exceeds ``max_bytes``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from cuvil.artifact import media_types as mt
from cuvil.artifact.errors import DigestMismatchError
from cuvil.artifact.layout import atomic_write
from cuvil.artifact.manifests import sha256_digest

ENV_CACHE_DIR = "CUVIL_CACHE_DIR"
ENV_CACHE_MAX_BYTES = "CUVIL_CACHE_MAX_BYTES"
DEFAULT_MAX_BYTES = 20 * 2**30
MANIFEST_FILE = "manifest.json"
STAMP_FILE = ".verified"
LAST_USED_FILE = ".last-used"
STALE_TMP_S = 24 * 3600
_CHUNK = 1 << 20


def file_sha256(path: Path) -> str:
    hasher = hashlib.sha256()
    with path.open("rb") as source:
        while chunk := source.read(_CHUNK):
            hasher.update(chunk)
    return "sha256:" + hasher.hexdigest()


def _stamp(path: Path) -> list[int]:
    status = path.stat()
    return [status.st_size, status.st_mtime_ns, status.st_ctime_ns, status.st_ino]


def artifact_files(manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """File name -> descriptor for the config and every titled layer of an artifact manifest."""
    files = {mt.CONFIG_FILE: manifest["config"]}
    for layer in manifest.get("layers", []):
        title = layer.get("annotations", {}).get(mt.ANNOTATION_TITLE)
        if title not in mt.FILE_MEDIA_TYPES:
            raise DigestMismatchError(f"artifact layer with unexpected title {title!r}: refused")
        files[title] = layer
    return files


class NodeCache:
    def __init__(self, root: str | Path | None = None, *, max_bytes: int | None = None) -> None:
        if root is None:
            root = os.environ.get(ENV_CACHE_DIR) or Path("~/.cache/cuvil").expanduser()
        if max_bytes is None:
            max_bytes = int(os.environ.get(ENV_CACHE_MAX_BYTES, DEFAULT_MAX_BYTES))
        self.root = Path(root)
        self.max_bytes = max_bytes
        for folder in ("manifests/sha256", "artifacts/sha256", "refs", "locks", "tmp"):
            (self.root / folder).mkdir(parents=True, exist_ok=True)

    # -- manifests and tags --------------------------------------------------------------------
    def _manifest_path(self, digest: str) -> Path:
        return self.root / "manifests" / "sha256" / digest.split(":", 1)[1]

    def get_manifest(self, digest: str) -> bytes | None:
        path = self._manifest_path(digest)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        if sha256_digest(data) != digest:
            path.unlink(missing_ok=True)
            return None
        return data

    def put_manifest(self, data: bytes) -> str:
        digest = sha256_digest(data)
        atomic_write(self._manifest_path(digest), data)
        return digest

    def _ref_path(self, ref: str) -> Path:
        return self.root / "refs" / (hashlib.sha256(ref.encode()).hexdigest() + ".json")

    def record_tag(self, ref: str, digest: str) -> None:
        atomic_write(self._ref_path(ref), json.dumps({"ref": ref, "digest": digest}).encode())

    def lookup_tag(self, ref: str) -> str | None:
        try:
            digest: str = json.loads(self._ref_path(ref).read_text())["digest"]
        except (OSError, ValueError, KeyError):
            return None
        return digest

    # -- artifacts -----------------------------------------------------------------------------
    def entry_path(self, digest: str) -> Path:
        return self.root / "artifacts" / "sha256" / digest.split(":", 1)[1]

    def lock(self, digest: str, timeout: float = -1) -> FileLock:
        return FileLock(str(self.root / "locks" / (digest.split(":", 1)[1] + ".lock")), timeout)

    def lookup(self, digest: str) -> Path | None:
        """The verified entry for an artifact manifest digest, or None; a corrupt one is dropped."""
        entry = self.entry_path(digest)
        if not entry.is_dir():
            return None
        try:
            self._verify(entry, digest)
        except (DigestMismatchError, OSError, ValueError, KeyError):
            self._drop(entry)
            raise DigestMismatchError(
                f"node cache entry {digest} was modified or is incomplete: dropped"
            ) from None
        (entry / LAST_USED_FILE).touch()
        return entry

    def _verify(self, entry: Path, digest: str) -> None:
        manifest_data = (entry / MANIFEST_FILE).read_bytes()
        if sha256_digest(manifest_data) != digest:
            raise DigestMismatchError(f"{entry}: manifest does not match {digest}")
        stamps: dict[str, list[int]] = json.loads((entry / STAMP_FILE).read_text())
        changed = False
        for name, descriptor in artifact_files(json.loads(manifest_data)).items():
            path = entry / name
            if stamps.get(name) == _stamp(path):
                continue
            if file_sha256(path) != descriptor["digest"]:
                raise DigestMismatchError(f"{path} does not match {descriptor['digest']}")
            stamps[name], changed = _stamp(path), True
        if changed:
            atomic_write(entry / STAMP_FILE, json.dumps(stamps).encode())

    def install(
        self, digest: str, manifest_data: bytes, fetch: Callable[[str, Path], object]
    ) -> tuple[Path, bool]:
        """The entry for ``digest``, downloading it with ``fetch(blob_digest, path)`` (which must
        verify) unless another process did already. Returns (path, downloaded)."""
        if sha256_digest(manifest_data) != digest:
            raise DigestMismatchError(f"manifest does not match {digest}: refused")
        with self.lock(digest):
            try:
                found = self.lookup(digest)
            except DigestMismatchError:
                found = None
            if found is not None:
                return found, False
            staging = Path(tempfile.mkdtemp(dir=self.root / "tmp", prefix="pull-"))
            try:
                stamps = {}
                for name, descriptor in artifact_files(json.loads(manifest_data)).items():
                    fetch(descriptor["digest"], staging / name)
                    if (staging / name).stat().st_size != descriptor["size"]:
                        raise DigestMismatchError(f"{name}: size differs from the manifest")
                    os.chmod(staging / name, 0o444)
                    stamps[name] = _stamp(staging / name)
                (staging / MANIFEST_FILE).write_bytes(manifest_data)
                (staging / STAMP_FILE).write_text(json.dumps(stamps))
                (staging / LAST_USED_FILE).touch()
                entry = self.entry_path(digest)
                os.replace(staging, entry)
                stamps = {name: _stamp(entry / name) for name in stamps}  # ctime moves on rename
                atomic_write(entry / STAMP_FILE, json.dumps(stamps).encode())
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
        self.evict(keep={digest})
        return entry, True

    def _drop(self, entry: Path) -> None:
        trash = Path(tempfile.mkdtemp(dir=self.root / "tmp", prefix="drop-"))
        with contextlib.suppress(OSError):
            os.replace(entry, trash / "entry")
        shutil.rmtree(trash, ignore_errors=True)

    def entries(self) -> list[tuple[float, int, str]]:
        """(last used, bytes, digest) of every artifact entry, least recently used first."""
        found = []
        for entry in (self.root / "artifacts" / "sha256").iterdir():
            try:
                used = (entry / LAST_USED_FILE).stat().st_mtime
                size = sum(path.stat().st_size for path in entry.iterdir())
            except OSError:
                continue
            found.append((used, size, "sha256:" + entry.name))
        return sorted(found)

    def evict(self, keep: Collection[str] = ()) -> list[str]:
        """Drop least recently used entries until the cache fits ``max_bytes``; skips entries in
        use by a download (locked) and those in ``keep``."""
        entries = self.entries()
        total = sum(size for _, size, _ in entries)
        evicted = []
        for _, size, digest in entries:
            if total <= self.max_bytes:
                break
            if digest in keep:
                continue
            try:
                with self.lock(digest, timeout=0):
                    self._drop(self.entry_path(digest))
            except Timeout:
                continue
            total -= size
            evicted.append(digest)
        self._sweep_tmp()
        return evicted

    def _sweep_tmp(self, older_than_s: float = STALE_TMP_S) -> None:
        """Remove what crashed downloads left in tmp/ (a live download touches its folder)."""
        cutoff = time.time() - older_than_s
        for leftover in (self.root / "tmp").iterdir():
            with contextlib.suppress(OSError):
                if leftover.stat().st_mtime < cutoff:
                    shutil.rmtree(leftover, ignore_errors=True)
