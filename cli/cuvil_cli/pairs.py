"""``KEY=VALUE`` command-line arguments (``cuvil push --annotation``, the benchmarks' ``--env``)."""

from __future__ import annotations

from collections.abc import Iterable


def key_values(pairs: Iterable[str], flag: str) -> dict[str, str]:
    """The pairs as a mapping (a later key wins); ValueError naming ``flag`` for one without
    ``=`` or a key."""
    found = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"{flag} wants KEY=VALUE, got {pair!r}")
        found[key] = value
    return found
