"""Picking a step's tokens for several rows at once: greedy rows by one argmax, sampled rows
each from its own generator, the same tokens as row by row."""

from __future__ import annotations

import torch

from cuvil.generation.sampling import SamplingParams, next_token, next_tokens


def test_a_mixed_step_picks_what_each_row_picks_alone() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    greedy = SamplingParams()
    sampled = SamplingParams(do_sample=True, top_k=10, seed=3)
    params = [greedy, sampled, greedy, sampled]
    together = next_tokens(logits, params, [p.generator() for p in params])
    generators = [p.generator() for p in params]
    alone = [next_token(row, p, g) for row, p, g in zip(logits, params, generators, strict=True)]
    assert together == alone
    assert together[0] == int(logits[0].argmax()) and together[2] == int(logits[2].argmax())
