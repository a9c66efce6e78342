"""The worker's validation against eager: an element may be off by ``atol + rtol * |eager|``,
the default ``atol`` taken relative to the output's scale, a spec's own ``atol`` as given."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from cuvil_worker import checks
from cuvil_worker.errors import VerificationFailed


class _Logits(torch.nn.Module):
    """Outputs from -scale to scale through zero, as a classifier's logits."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def _off_by(model: torch.nn.Module, error: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """A stand-in for a compiled model: eager's answer, every element off by ``error``."""
    return lambda x: model(x) + error


SAMPLES = [torch.linspace(-1, 1, 101)]  # holds an exact zero


def _validate(model: torch.nn.Module, error: float, **validation: float) -> dict:
    return checks.validate(_off_by(model, error), model, SAMPLES, ["logits"], validation)


def test_default_atol_follows_the_output_scale() -> None:
    """Logits of scale 200 off by 3e-4 everywhere (1.5e-6 of the scale, an fp32 plan's rounding):
    within the default; the same error on outputs of scale 0.5 is not (the floor stays 1e-4)."""
    report = _validate(_Logits(200.0), 3e-4)
    assert report["atol_relative_to_scale"]
    assert report["max_abs_error"] == pytest.approx(3e-4, rel=0.1)
    with pytest.raises(VerificationFailed, match="x the output's scale: logits"):
        _validate(_Logits(0.5), 3e-4)


def test_a_spec_atol_is_absolute() -> None:
    with pytest.raises(VerificationFailed, match=r"atol=0\.0001: logits \(sample 0"):
        _validate(_Logits(200.0), 3e-4, atol=1e-4)
    assert not _validate(_Logits(200.0), 3e-4, atol=1e-3)["atol_relative_to_scale"]


def test_an_error_past_fp32_rounding_fails_at_any_scale() -> None:
    with pytest.raises(VerificationFailed):
        _validate(_Logits(200.0), 0.05)  # 2.5e-4 of the scale: 25x the default floor
