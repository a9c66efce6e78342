"""Activations by their IR name: as oneDNN post-ops, and applied in place to a fresh result."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

# activation name in the IR -> (oneDNN post-op, scalars, algorithm)
ONEDNN_ACTIVATIONS: dict[str, tuple[str, list[float], str]] = {
    "none": ("none", [], ""),
    "relu": ("relu", [], ""),
    "gelu": ("gelu", [], "none"),
    "gelu_tanh": ("gelu", [], "tanh"),
    "silu": ("swish", [], ""),
    "hardswish": ("hardswish", [], ""),
    "relu6": ("hardtanh", [0.0, 6.0], ""),
    "tanh": ("tanh", [], ""),
    "sigmoid": ("sigmoid", [], ""),
}

# The same activations applied in place to a fresh GEMM result.
INPLACE_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "none": lambda y: y,
    "relu": torch.relu_,
    "gelu": lambda y: torch.ops.aten.gelu_(y),
    "gelu_tanh": lambda y: torch.ops.aten.gelu_(y, approximate="tanh"),
    "silu": lambda y: F.silu(y, inplace=True),
    "hardswish": lambda y: F.hardswish(y, inplace=True),
    "relu6": lambda y: F.hardtanh_(y, 0.0, 6.0),
    "tanh": torch.tanh_,
    "sigmoid": torch.sigmoid_,
}
