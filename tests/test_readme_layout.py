"""The README's Layout table matches the tree: every folder it names exists, and every package
of the library and every backend is named in it."""

from __future__ import annotations

import re
from pathlib import Path

from cuvil.backends import BACKENDS

ROOT = Path(__file__).resolve().parents[1]


def _layout_folders() -> list[str]:
    text = (ROOT / "README.md").read_text()
    table = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
    return [match for match in re.findall(r"^\| `([^`]+/)`", table, flags=re.M)]


def test_every_folder_the_layout_names_exists() -> None:
    folders = _layout_folders()
    assert folders, "README has no Layout table"
    missing = [folder for folder in folders if not (ROOT / folder).is_dir()]
    assert not missing, missing


def test_every_library_package_and_backend_is_in_the_layout() -> None:
    text = (ROOT / "README.md").read_text().split("## Layout", 1)[1]
    packages = [p.parent for p in (ROOT / "cuvil").glob("*/__init__.py")]
    unnamed = [p.name for p in packages if f"`cuvil/{p.name}/`" not in text]
    assert not unnamed, unnamed
    for family, location in BACKENDS.items():
        assert f"`{family}/`" in text, family
        assert (ROOT / "cuvil" / "backends" / family).is_dir(), location
