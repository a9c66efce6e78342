"""Copies of a constant weight in a GEMM library's layout, shared by every kernel that
multiplies by that weight.

A generation artifact's prefill and decode graphs are two plans over one set of weight tensors,
and each plan prepares kernels of its own. Were each kernel to pack its own copies (MKL's packed
layout, oneDNN's blocked ones), every weight would be held packed once per graph, the two
copies identical. Kept here, a layout is packed once per weight, and whichever kernel asks for
it next takes the same copy (benchmarks/README.md, ``generation_memory.py``: the resident size
of a warmed-up 100M-parameter generation model with and without the sharing). A bf16 weight's
fp32 widening, on CPUs without bf16 GEMMs, is one such copy too.

Copies are keyed by the weight tensor object (``torch.utils.weak.WeakTensorKeyDictionary``, so
they live no longer than the weight does), then by the caller's layout key and the weight's
version counter: an in-place change to the weight makes later kernels pack afresh rather than
take a copy of the old values. ``CUVIL_SHARE_PACKED=off`` gives every kernel copies of its
own (to measure what the sharing saves).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import torch
from torch.utils.weak import WeakTensorKeyDictionary

T = TypeVar("T")

_lock = threading.Lock()
_copies: WeakTensorKeyDictionary = WeakTensorKeyDictionary()  # weight -> {key: copy}


def shared_copy(weight: torch.Tensor, key: Hashable, make: Callable[[], T]) -> T:
    """The copy of ``weight`` under ``key`` (with the weight's version), made by ``make`` on the
    first ask. Made under the lock, so two threads preparing kernels at once pack it once."""
    if os.environ.get("CUVIL_SHARE_PACKED", "on") == "off":
        return make()
    versioned = (key, _version(weight))
    with _lock:
        held: dict[Hashable, Any] | None = _copies.get(weight)
        if held is None:
            held = _copies[weight] = {}
        found = held.get(versioned)
        if found is None:
            found = held[versioned] = make()
        return found


def _version(weight: torch.Tensor) -> int:
    """The weight's version counter; -1 for an inference tensor, which keeps none (it can be
    changed in place only within inference mode, which weights are not)."""
    return -1 if weight.is_inference() else int(weight._version)


def copies_held(weight: torch.Tensor) -> int:
    """How many copies of ``weight`` are kept."""
    with _lock:
        return len(_copies.get(weight) or {})
