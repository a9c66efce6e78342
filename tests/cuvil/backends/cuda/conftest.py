"""A stand-in ``libcuda.so.1`` built from mock_libcuda.c, for the launcher's tests on the CPU."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

MOCK_SOURCE = Path(__file__).parent / "mock_libcuda.c"


@pytest.fixture(scope="module")
def mock_driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    library = tmp_path_factory.mktemp("mock") / "libcuda.so.1"
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-O1", "-o", str(library), str(MOCK_SOURCE)], check=True
    )
    return library
