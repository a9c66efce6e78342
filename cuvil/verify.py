"""Numerical verification: compiled outputs against eager PyTorch on the same inputs.

Per output: max absolute error, max error relative to the reference's scale (max |ref|), cosine
similarity, and top-1 agreement along the last dim for float outputs with more than one class.
``relative_to_scale`` is what gates and tests compare against a tolerance. A NaN or an infinity
where eager has a finite value is an infinite error (NaN would compare as "within tolerance").
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class OutputError:
    name: str
    max_abs_error: float
    relative_to_scale: float
    cosine: float
    top1_agreement: float | None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def output_scale(expected: torch.Tensor) -> float:
    """The scale errors are taken relative to: max |expected| over its finite values (0 for an
    empty tensor)."""
    if expected.numel() == 0:
        return 0.0
    return float(expected.detach().double().abs().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).max())


def compare_output(name: str, actual: torch.Tensor, expected: torch.Tensor) -> OutputError:
    if actual.shape != expected.shape:
        raise AssertionError(
            f"output {name!r}: shape {list(actual.shape)} != eager {list(expected.shape)}"
        )
    if not expected.is_floating_point():
        mismatches = float((actual != expected).float().mean()) if expected.numel() else 0.0
        return OutputError(name, mismatches, mismatches, 1.0 - mismatches, None)
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    if e.numel() == 0:
        return OutputError(name, 0.0, 0.0, 1.0, None)
    difference = (a - e).abs()
    same = (a == e) | (a.isnan() & e.isnan())  # the same inf, or NaN where eager has NaN too
    difference = torch.where(same, 0.0, difference).nan_to_num(nan=math.inf)
    max_abs = float(difference.max())
    scale = output_scale(e)
    relative = max_abs / scale if scale > 0 else max_abs
    cosine = float(torch.nn.functional.cosine_similarity(a.flatten(), e.flatten(), dim=0))
    top1 = None
    if e.dim() >= 1 and e.shape[-1] > 1:
        top1 = float((a.argmax(-1) == e.argmax(-1)).double().mean())
    return OutputError(name, max_abs, relative, cosine, top1)


def compare_outputs(
    actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]
) -> list[OutputError]:
    return [compare_output(name, actual[name], expected[name]) for name in expected]


def worst_relative_error(errors: list[OutputError]) -> float:
    """The largest relative error; a NaN counts as infinitely wrong (``max`` would skip it)."""
    values = [error.relative_to_scale for error in errors]
    return max((v if math.isfinite(v) else math.inf for v in values), default=0.0)
