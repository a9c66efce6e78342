"""URL sources: a source bundle (see ``source_bundle``) as a tar archive over HTTP(S).

    spec.source.url   https://models.example.com/team-a/minilm.tar.gz[#sha256=<hex>]

The archive holds the bundle's files (``config.json``, ``*.safetensors``, ``*.txt``, optionally
``cuvil-source.json`` naming the transformers class), at its top or in one folder (what
``tar czf m.tar.gz -C dir .`` or ``tar czf m.tar.gz dir`` make); plain, gzip, bzip2 or xz.
Only regular files with plain data names are taken: no links, devices, nested folders or
pickles, so the model loads as every bundle does (a transformers class from safetensors,
never remote code). A ``#sha256=`` fragment pins the archive's digest, as pip's URLs do.

The operator checks the URL against the namespace's allowlist; here redirects are refused
(a redirect would leave what was allowed), and the download is bounded in size and time.
"""

from __future__ import annotations

import hashlib
import shutil
import tarfile
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path, PurePosixPath
from typing import IO, Any

from cuvil.frontend.source_bundle import (
    ALLOWED_SUFFIXES,
    SAFE_NAME,
    SourceBundleError,
    bundle_files,
)
from cuvil.source_urls import pinned_digest, url_problem

MAX_BUNDLE_BYTES = 64 * 2**30  # the archive as downloaded, and again its files unpacked
TIMEOUT_S = 60.0  # per connect and per read, not for the whole download
_CHUNK = 1 << 20


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(
        self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str
    ) -> urllib.request.Request | None:
        raise SourceBundleError(
            f"{req.full_url} redirects to {newurl}: redirects are not followed"
            " (the allowlist admitted the URL given); name the final URL"
        )


def _download(url: str, out: IO[bytes], max_bytes: int, timeout: float) -> str:
    """Stream ``url`` into ``out``; returns the sha256 digest of what came."""
    opener = urllib.request.build_opener(_NoRedirects)
    request = urllib.request.Request(url.split("#", 1)[0], headers={"User-Agent": "cuvil"})
    digest, size = hashlib.sha256(), 0
    try:
        with opener.open(request, timeout=timeout) as response:
            while chunk := response.read(_CHUNK):
                size += len(chunk)
                if size > max_bytes:
                    raise SourceBundleError(f"{url}: larger than {max_bytes} bytes")
                digest.update(chunk)
                out.write(chunk)
    except urllib.error.HTTPError as error:
        raise SourceBundleError(f"{url}: HTTP {error.code} {error.reason}") from None
    except (urllib.error.URLError, OSError) as error:
        raise SourceBundleError(f"{url}: download failed: {error}") from None
    return f"sha256:{digest.hexdigest()}"


def _member_name(member: tarfile.TarInfo, url: str) -> str | None:
    """The bundle file a member becomes (None: a folder entry, skipped), or a refusal."""
    parts = [p for p in PurePosixPath(member.name).parts if p != "."]
    if member.isdir() and len(parts) <= 1:
        return None
    if not member.isfile() or len(parts) not in (1, 2) or ".." in parts:
        raise SourceBundleError(
            f"{url}: archive member {member.name!r} refused (regular files only, at the top"
            " or in one folder)"
        )
    name = parts[-1]
    if not SAFE_NAME.match(name) or not name.endswith(ALLOWED_SUFFIXES):
        raise SourceBundleError(
            f"{url}: archive member {member.name!r} refused: a bundle carries data only"
            f" ({', '.join(ALLOWED_SUFFIXES)})"
        )
    return name


def _unpack(archive: Path, destination: Path, url: str, max_bytes: int) -> None:
    """The archive's files into ``destination``; their total size is bounded like the
    download's (a compressed archive must not unpack into more than that)."""
    try:
        with tarfile.open(archive, "r:*") as tar:
            folders: set[str] = set()
            unpacked = 0
            for member in tar:
                name = _member_name(member, url)
                if name is None:
                    continue
                unpacked += member.size
                if unpacked > max_bytes:
                    raise SourceBundleError(f"{url}: unpacks into more than {max_bytes} bytes")
                parts = [p for p in PurePosixPath(member.name).parts if p != "."]
                folders.add(parts[0] if len(parts) == 2 else "")
                if len(folders) > 1:
                    raise SourceBundleError(f"{url}: the archive's files are in several folders")
                if (destination / name).exists():
                    raise SourceBundleError(f"{url}: the archive holds {name} twice")
                source = tar.extractfile(member)
                assert source is not None  # a regular file
                with source, (destination / name).open("wb") as out:
                    shutil.copyfileobj(source, out, _CHUNK)
    except tarfile.TarError as error:
        raise SourceBundleError(f"{url}: not a tar archive: {error}") from None


def fetch_url_bundle(
    url: str,
    destination: str | Path,
    *,
    max_bytes: int = MAX_BUNDLE_BYTES,
    timeout: float = TIMEOUT_S,
) -> Path:
    """Download the bundle archive at ``url`` and unpack it into ``destination``; returns it."""
    problem = url_problem(url)
    if problem is not None:
        raise SourceBundleError(problem)
    pinned = pinned_digest(url)
    destination = Path(destination)
    if destination.exists() and any(destination.iterdir()):
        raise SourceBundleError(f"{destination} is not empty")
    destination.mkdir(parents=True, exist_ok=True)
    try:
        with tempfile.NamedTemporaryFile(dir=destination, suffix=".download") as archive:
            got = _download(url, archive, max_bytes, timeout)
            archive.flush()
            if pinned is not None and got != pinned:
                raise SourceBundleError(f"{url}: the archive's digest is {got}, not {pinned}")
            _unpack(Path(archive.name), destination, url, max_bytes)
        bundle_files(destination)  # config.json and weights are there, data only
    except SourceBundleError as error:
        shutil.rmtree(destination, ignore_errors=True)  # nothing half-unpacked stays
        message = str(error)
        raise SourceBundleError(message if url in message else f"{url}: {message}") from None
    return destination


def bundle_name(url: str) -> str:
    """The model's name from the archive's file name: ``…/minilm.tar.gz`` -> ``minilm``."""
    stem = PurePosixPath(urllib.parse.urlsplit(url).path).name
    for suffix in (".gz", ".bz2", ".xz", ".tgz", ".tar"):
        stem = stem.removesuffix(suffix)
    return stem or "model"
