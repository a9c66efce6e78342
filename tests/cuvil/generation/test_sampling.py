"""Picking a step's tokens for several rows at once: greedy rows by one argmax, sampled rows
each from its own generator, the same tokens as row by row."""

from __future__ import annotations

import torch

from cuvil.generation.sampling import SamplingParams, greedy_picks, next_token, next_tokens


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


def test_greedy_picks_are_torch_argmax_with_ties_nans_and_strides() -> None:
    generator = torch.Generator().manual_seed(1)
    rounded = torch.randint(0, 4, (16, 300), generator=generator).float()  # many ties
    with_nan = torch.randn(3, 40, generator=generator)
    with_nan[0, 7] = with_nan[0, 30] = float("nan")
    with_nan[1, 5] = with_nan[1, 6] = float("inf")
    with_nan[2] = float("-inf")
    strided = torch.randn(8, 64, generator=generator)[:, ::3]
    transposed = torch.randn(50, 6, generator=generator).T
    cases = [rounded, with_nan, strided, transposed, rounded.double(), rounded.half()]
    cases += [rounded.bfloat16()]  # NumPy has no bf16: torch's own argmax
    for logits in cases:
        assert greedy_picks(logits) == torch.argmax(logits, dim=-1).tolist()
    with torch.inference_mode():
        inference = torch.randn(4, 33, generator=generator)
    assert greedy_picks(inference) == torch.argmax(inference, dim=-1).tolist()
    assert next_token(rounded[0], SamplingParams(), None) == int(torch.argmax(rounded[0]))
