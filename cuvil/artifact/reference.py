"""What a user writes where a model is expected (``CUVIL_MODEL``, ``cuvil pull REF``), parsed.

Three kinds, tried in this order:
- an artifact path: an existing tar file, or a directory holding ``config.json``;
- a local OCI image layout: ``oci:PATH[:tag|@digest]``, or an existing directory holding an
  ``oci-layout`` file (with an optional ``:tag`` or ``@digest`` after the path);
- a registry reference: ``host[:port]/repo/name[:tag][@sha256:…]`` — the first component must look
  like a host (a dot, a port, or ``localhost``), so that ``models/x`` is never sent to a registry.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from cuvil.artifact import media_types as mt

DEFAULT_TAG = "latest"
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REPOSITORY = re.compile(rf"^{_COMPONENT}(?:/{_COMPONENT})*$")
_HOST = re.compile(
    r"^(?:localhost|[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+|\[[0-9a-fA-F:]+\])(?::\d+)?$"
    r"|^[A-Za-z0-9-]+:\d+$"
)
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")


def is_digest(text: str) -> bool:
    return bool(_DIGEST.match(text))


@dataclass(frozen=True)
class Reference:
    """A registry (``registry`` set) or layout (``layout`` set) location, by tag or digest."""

    repository: str = ""
    tag: str | None = None
    digest: str | None = None
    registry: str | None = None
    layout: Path | None = None

    @property
    def reference(self) -> str:
        """What goes after ``/manifests/``: the digest when pinned, else the tag."""
        return self.digest or self.tag or DEFAULT_TAG

    @property
    def is_loopback(self) -> bool:
        host = (self.registry or "").rsplit(":", 1)[0] if "]" not in (self.registry or "") else ""
        return host in LOOPBACK_HOSTS or (self.registry or "").startswith("[::1]")

    def with_digest(self, digest: str) -> Reference:
        return Reference(self.repository, self.tag, digest, self.registry, self.layout)

    def with_tag(self, tag: str | None) -> Reference:
        return Reference(self.repository, tag, None, self.registry, self.layout)

    @property
    def name(self) -> str:
        """The repository (or layout) without tag or digest."""
        if self.layout is not None:
            return f"oci:{self.layout}"
        return f"{self.registry}/{self.repository}"

    def __str__(self) -> str:
        if self.digest:
            return f"{self.name}@{self.digest}"
        return f"{self.name}:{self.tag or DEFAULT_TAG}"


def _split_tag_digest(text: str) -> tuple[str, str | None, str | None]:
    """``name[:tag][@digest]`` -> (name, tag, digest); a ':' before the last '/' is a port."""
    digest = None
    if "@" in text:
        text, digest = text.rsplit("@", 1)
        if not is_digest(digest):
            raise ValueError(f"{digest!r} is not a sha256 digest (sha256:<64 hex digits>)")
    tag = None
    last = text.rsplit("/", 1)[-1]
    if ":" in last:
        text, tag = text.rsplit(":", 1)
        if not _TAG.match(tag):
            raise ValueError(f"{tag!r} is not a valid tag")
    return text, tag, digest


def parse_registry_reference(text: str) -> Reference:
    """``host[:port]/repo[:tag][@digest]``; a ValueError says what is wrong."""
    name, tag, digest = _split_tag_digest(text.strip())
    host, _, repository = name.partition("/")
    if not repository or not _HOST.match(host):
        raise ValueError(
            f"{text!r} is not a registry reference: expected host[:port]/repository[:tag|@digest]"
        )
    if not _REPOSITORY.match(repository):
        raise ValueError(f"{repository!r} is not a valid repository name (lowercase, a-z0-9._-/)")
    return Reference(repository, tag, digest, registry=host)


def parse_layout_reference(text: str) -> Reference:
    """``[oci:]PATH[:tag][@digest]`` for a local OCI image layout."""
    text = text.removeprefix("oci:")
    path, tag, digest = text, None, None
    if "@" in path:
        path, digest = path.rsplit("@", 1)
        if not is_digest(digest):
            raise ValueError(f"{digest!r} is not a sha256 digest")
    head, sep, maybe_tag = path.rpartition(":")
    if sep and "/" not in maybe_tag and _TAG.match(maybe_tag) and head:
        path, tag = head, maybe_tag
    return Reference("", tag, digest, layout=Path(path))


def is_artifact_path(text: str) -> bool:
    path = Path(text)
    return path.is_file() or (path.is_dir() and (path / mt.CONFIG_FILE).is_file())


def is_layout_reference(text: str) -> bool:
    if text.startswith("oci:"):
        return True
    try:
        layout = parse_layout_reference(text).layout
    except ValueError:
        return False
    return layout is not None and (layout / "oci-layout").is_file()


def looks_like_registry_reference(text: str) -> bool:
    """True for anything that is not an existing local path and parses as a registry reference."""
    if Path(text).exists():
        return False
    try:
        parse_registry_reference(text)
    except ValueError:
        return False
    return True


def parse_target_reference(text: str) -> Reference:
    """Where to push: a registry reference, else a local OCI layout (created if missing)."""
    if not text.startswith("oci:") and looks_like_registry_reference(text):
        return parse_registry_reference(text)
    return parse_layout_reference(text)


def is_oci_reference(text: str) -> bool:
    """A registry reference or an OCI layout (``oci:`` prefix, or an existing layout directory):
    what the CLI's ``-o REF`` and ``inspect REF`` treat as OCI rather than as a local path."""
    return (
        text.startswith("oci:") or is_layout_reference(text) or looks_like_registry_reference(text)
    )
