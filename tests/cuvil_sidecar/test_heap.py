"""Freed heap goes back to the OS after warm-up (cuvil_sidecar/heap.py), measured in a fresh
process whose allocator is set to keep freed blocks, as a warmed-up sidecar's is."""

from __future__ import annotations

import subprocess
import sys

from tests.cuvil_sidecar.conftest import REPO

PROGRAM = """
import ctypes, ctypes.util
from cuvil_sidecar.heap import resident_mib, trim_heap
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD: blocks come from the heap, as after warm-up
blocks = []
for _ in range(400):  # 100 MiB in 256 KiB blocks, each touched
    block = libc.malloc(1 << 18)
    ctypes.memset(block, 1, 1 << 18)
    blocks.append(block)
for block in blocks[:-1]:  # all freed but the last, which pins the heap's top
    libc.free(block)
held = resident_mib()
assert trim_heap()
print(held, resident_mib())
"""


def test_trimming_returns_freed_heap_to_the_os() -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env={"PYTHONPATH": f"{REPO / 'runtime_sidecar'}:{REPO}", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr
    held, trimmed = map(float, done.stdout.split())
    assert held - trimmed > 80, (held, trimmed)  # most of the 100 MiB freed went back
