"""Picking a step's tokens for several rows at once: greedy rows by one argmax, sampled and
penalized rows each on its own, the same tokens as row by row; the penalties as transformers
(repetition) and OpenAI (presence, frequency) define them."""

from __future__ import annotations

import pytest
import torch

from cuvil.generation.sampling import (
    SamplingParams,
    greedy_picks,
    next_token,
    next_tokens,
    penalized,
    token_logprobs,
)


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


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_the_repetition_penalty_is_transformers(penalty: float) -> None:
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    generator = torch.Generator().manual_seed(2)
    scores = torch.randn(3, 100, generator=generator)
    held = torch.randint(0, 100, (3, 30), generator=generator)  # repeats among them
    theirs = RepetitionPenaltyLogitsProcessor(penalty)(held, scores.clone())
    params = SamplingParams(repetition_penalty=penalty)
    for row in range(3):
        ours = penalized(scores[row], params, held[row].tolist(), [])
        assert torch.equal(ours, theirs[row])
    changed = penalized(scores[0], params, [5, 5, 7, 250], [])  # an id past the vocabulary
    assert set(torch.nonzero(changed != scores[0]).flatten().tolist()) <= {5, 7}


def test_presence_and_frequency_penalties_count_the_generated_tokens() -> None:
    scores = torch.zeros(10)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    ours = penalized(scores, params, held=[1, 2, 3, 3, 3], generated=[3, 3, 4])
    expected = torch.zeros(10)
    expected[3] = -0.5 - 2 * 0.25
    expected[4] = -0.5 - 0.25
    assert torch.equal(ours, expected)  # the prompt's tokens (1, 2) are not counted
    assert torch.equal(penalized(scores, params, held=[1], generated=[]), scores)


def test_penalized_rows_pick_alone_what_they_pick_in_a_step() -> None:
    logits = torch.randn(4, 60, generator=torch.Generator().manual_seed(4))
    top = logits.argmax(-1).tolist()
    histories = [([top[row], 1], [top[row]]) for row in range(4)]  # each row's own best, seen
    params = [
        SamplingParams(),
        SamplingParams(repetition_penalty=4.0),
        SamplingParams(frequency_penalty=2.0),
        SamplingParams(do_sample=True, presence_penalty=1.0, seed=5),
    ]
    together = next_tokens(logits, params, [p.generator() for p in params], histories.__getitem__)
    generators = [p.generator() for p in params]
    alone = [
        next_token(logits[row], params[row], generators[row], histories[row]) for row in range(4)
    ]
    assert together == alone
    assert together[0] == top[0]  # no penalty
    assert together[1] != top[1] and together[2] != top[2]  # their best was seen
    with pytest.raises(ValueError, match="history"):
        next_tokens(logits, params, [None] * 4)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
    ],
)
def test_penalties_out_of_range_are_refused(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**options)


def test_token_logprobs_are_the_log_softmax_and_its_likeliest() -> None:
    logits = torch.randn(50, generator=torch.Generator().manual_seed(6))
    expected = torch.log_softmax(logits, -1)
    chosen, top = token_logprobs(logits, 7, 3)
    assert chosen == pytest.approx(float(expected[7]))
    assert [i for i, _ in top] == expected.topk(3).indices.tolist()
    assert [lp for _, lp in top] == pytest.approx(expected.topk(3).values.tolist())
    assert token_logprobs(logits.half(), 7, 0) == (pytest.approx(chosen, abs=1e-2), ())


def test_a_row_that_cannot_be_drawn_from_is_handed_over_and_the_others_picked() -> None:
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(8))
    logits[1] = float("nan")
    params = [SamplingParams(do_sample=True, seed=1)] * 3
    failed: dict[int, Exception] = {}
    picks = next_tokens(logits, params, [p.generator() for p in params], None, failed.__setitem__)
    alone = [next_token(logits[row], params[row], params[row].generator()) for row in (0, 2)]
    assert list(failed) == [1] and picks[1] == -1 and [picks[0], picks[2]] == alone
    with pytest.raises(RuntimeError, match="probability"):
        next_tokens(logits, params, [p.generator() for p in params])
    with pytest.raises(ValueError, match="temperature must be positive and finite"):
        SamplingParams(do_sample=True, temperature=float("nan"))
    with pytest.raises(ValueError, match="seed must be a 64-bit integer"):
        SamplingParams(seed=2**70)
