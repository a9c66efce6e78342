"""Model factories for CLI tests (``cuvil compile tests.cuvil.factories:small``)."""

from __future__ import annotations

import torch

import cuvil


def small() -> tuple[torch.nn.Module, tuple[torch.Tensor], dict]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.SiLU(), torch.nn.Linear(16, 3)
    ).eval()
    return model, (torch.randn(2, 8),), {"input": {0: cuvil.Dim("batch", min=1, max=4)}}


def not_a_model() -> str:
    return "nope"
