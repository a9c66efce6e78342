"""Libraries of several sources: built side by side into one shared object, or refused with
the failing source named; the cache holds only whole libraries."""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

import pytest

from cuvil.runtime.native_build import NativeError, link_into

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
FLAGS = ("-O2", "-fPIC", "-shared")


def sources(folder: Path, **texts: str) -> list[Path]:
    folder.mkdir()
    paths = []
    for name, text in texts.items():
        path = folder / f"{name}.c"
        path.write_text(text)
        paths.append(path)
    return paths


def test_sources_compiled_apart_link_into_one_library(tmp_path: Path) -> None:
    parts = sources(
        tmp_path / "src",
        twice="int twice(int x) { return 2 * x; }\n",
        calls="int twice(int); int four_times(int x) { return twice(twice(x)); }\n",
        same_stem="int plus_one(int x) { return x + 1; }\n",
    )
    other = tmp_path / "other" / "same_stem.c"  # a second source with the same file name
    other.parent.mkdir()
    other.write_text("int minus_one(int x) { return x - 1; }\n")
    target = tmp_path / "cache" / "library.so"
    link_into(target, "cc", [*parts, other], FLAGS, [])
    library = ctypes.CDLL(str(target))
    assert library.four_times(5) == 20
    assert library.plus_one(5) == 6 and library.minus_one(5) == 4
    assert [p.name for p in target.parent.iterdir()] == ["library.so"]  # no scratch left


def test_a_failing_source_is_named_and_nothing_lands_in_the_cache(tmp_path: Path) -> None:
    parts = sources(
        tmp_path / "src",
        fine="int fine(void) { return 1; }\n",
        broken="int broken(void) { return undeclared; }\n",
    )
    target = tmp_path / "cache" / "library.so"
    with pytest.raises(NativeError, match=r"(?s)compiling broken\.c failed.*undeclared"):
        link_into(target, "cc", parts, FLAGS, [])
    assert list(target.parent.iterdir()) == []
