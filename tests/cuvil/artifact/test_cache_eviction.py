"""Size-bounded LRU eviction of the node cache (a local layout as the source: no network)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from cuvil.artifact import PushResult, push_artifact
from cuvil.artifact.api import resolve
from cuvil.artifact.cache import NodeCache
from cuvil.artifact.files import ArtifactContents
from tests.cuvil.artifact.conftest import artifact_files


def test_least_recently_used_entries_go_first(
    tiny_contents: ArtifactContents, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    layout = tmp_path / "layout"
    pushed = [
        push_artifact(
            artifact_files(tiny_contents, "cpu", name=f"m{i}", bump=i), f"oci:{layout}:m{i}"
        )
        for i in range(3)
    ]
    assert PushResult.from_json(pushed[0].to_json()) == pushed[0]
    cache = NodeCache(tmp_path / "cache", max_bytes=10**12)
    entries = [resolve(f"oci:{layout}:m{i}", cache_dir=cache.root).path for i in range(2)]
    one_entry = sum(path.stat().st_size for path in entries[0].iterdir())
    old = time.time() - 100
    os.utime(entries[0] / ".last-used", (old, old))
    os.utime(entries[1] / ".last-used", (old + 50, old + 50))
    resolve(f"oci:{layout}:m0", cache_dir=cache.root)  # a hit makes m0 the most recent

    monkeypatch.setenv("CUVIL_CACHE_MAX_BYTES", str(int(one_entry * 2.5)))
    resolve(f"oci:{layout}:m2", cache_dir=cache.root)  # three entries > 2.5 allowed: m1 goes
    kept = {digest for _, _, digest in cache.entries()}
    assert kept == {pushed[0].digest, pushed[2].digest}
    assert not entries[1].exists()
