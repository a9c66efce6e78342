"""Shared test setup: deterministic torch, offline HuggingFace, few threads (CI has 2 cores),
kernel choices timed as models run rather than at compile time."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# cuvil.jit times kernel choices at compile time by default (ResNet-50: ~1 min on 2 cores);
# tests compile hundreds of models, so kernels time as they run unless a test turns it on
# (tests/cuvil/backends/cpu/test_kernel_choices.py does).
os.environ.setdefault("CUVIL_KERNEL_CHOICES", "off")

import pytest
import torch

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """GPU tests skip only when no CUDA device exists."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
