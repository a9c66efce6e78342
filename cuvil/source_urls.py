"""The form a ``spec.source.url`` must have, shared by the operator (before its allowlist
looks at the URL) and the worker (before it downloads): torch-free, like ``cuvil.targets``.

An http(s) URL with a host; no credentials in it; no ``.``/``..`` path segments, plain or
percent-encoded, and no backslashes (a server would resolve them out of an allowed prefix);
no fragment but ``#sha256=<64 hex digits>``, which pins the archive's digest as pip's URLs do.
"""

from __future__ import annotations

import re
from urllib.parse import unquote, urlsplit

SHA256_FRAGMENT = re.compile(r"^sha256=([0-9a-f]{64})$")


def url_problem(url: str) -> str | None:
    """What is wrong with ``url`` as a source URL; None when nothing is."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"{url!r} is not an http(s) URL with a host"
    if "@" in parts.netloc:
        return f"{url!r}: no credentials in the URL (the server must serve it without)"
    path = unquote(parts.path)
    if "\\" in path or any(segment in (".", "..") for segment in path.split("/")):
        return f"{url!r}: no '.' or '..' path segments or backslashes"
    if parts.fragment and not SHA256_FRAGMENT.match(parts.fragment):
        return f"{url!r}: the only fragment taken is #sha256=<64 hex digits>"
    return None


def pinned_digest(url: str) -> str | None:
    """``sha256:<hex>`` when the URL pins its archive's digest (checked by ``url_problem``)."""
    match = SHA256_FRAGMENT.match(urlsplit(url).fragment)
    return f"sha256:{match.group(1)}" if match else None
