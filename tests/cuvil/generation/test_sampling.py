"""Picking a step's tokens for several rows at once: greedy rows by one argmax, sampled and
penalized rows each on its own, the same tokens as row by row; the penalties as transformers
(repetition) and OpenAI (presence, frequency) define them."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
import torch

from cuvil.generation.penalties import PenaltyState, apply_penalties
from cuvil.generation.sampling import (
    SamplingParams,
    greedy_picks,
    next_token,
    next_tokens,
    token_logprobs,
)


def test_a_mixed_step_picks_what_each_row_picks_alone() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    greedy = SamplingParams()
    sampled = SamplingParams(do_sample=True, top_k=10, seed=3)
    params = [greedy, sampled, greedy, sampled]
    before = logits.clone()
    together = next_tokens(logits, params, [p.generator() for p in params])
    assert torch.equal(logits, before)  # the step's logits are the caller's: left as they were
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


def _state(vocab: int, held: list[int], generated: Iterable[int] = ()) -> PenaltyState:
    """A sequence that holds ``held`` (its prompt) and generated ``generated`` after it."""
    state = PenaltyState(vocab, held)
    for token in generated:
        state.add(token)
    return state


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_the_repetition_penalty_is_transformers(penalty: float) -> None:
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    generator = torch.Generator().manual_seed(2)
    scores = torch.randn(3, 100, generator=generator)
    held = torch.randint(0, 100, (3, 30), generator=generator)  # repeats among them
    theirs = RepetitionPenaltyLogitsProcessor(penalty)(held, scores.clone())
    params = [SamplingParams(repetition_penalty=penalty)] * 3
    states = [_state(100, held[row].tolist()) for row in range(3)]
    assert torch.equal(apply_penalties(scores, params, states), theirs)  # all rows at once
    states = [_state(100, held[row, :20].tolist(), held[row, 20:].tolist()) for row in range(3)]
    assert torch.equal(apply_penalties(scores, params, states), theirs)  # prompt + generated
    beyond = _state(100, [5, 5, 7, 250])  # an id past the vocabulary is ignored
    changed = apply_penalties(scores[:1], params[:1], [beyond])[0]
    assert set(torch.nonzero(changed != scores[0]).flatten().tolist()) == {5, 7}


def test_presence_and_frequency_penalties_count_the_generated_tokens() -> None:
    scores = torch.zeros(2, 10)
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), SamplingParams()]
    states = [_state(10, [1, 2, 3, 3, 3], [3, 3, 4]), _state(10, [1], [1, 1])]
    ours = apply_penalties(scores, params, states)
    expected = torch.zeros(2, 10)
    expected[0, 3] = -0.5 - 2 * 0.25
    expected[0, 4] = -0.5 - 0.25
    assert torch.equal(ours, expected)  # the prompt's tokens (1, 2) are not counted


def test_penalized_rows_pick_alone_what_they_pick_in_a_step() -> None:
    logits = torch.randn(4, 60, generator=torch.Generator().manual_seed(4))
    top = logits.argmax(-1).tolist()
    states = [_state(60, [top[row], 1], [top[row]]) for row in range(4)]  # each row's best, seen
    params = [
        SamplingParams(),
        SamplingParams(repetition_penalty=4.0),
        SamplingParams(frequency_penalty=2.0),
        SamplingParams(do_sample=True, presence_penalty=1.0, seed=5),
    ]
    together = next_tokens(logits, params, [p.generator() for p in params], states.__getitem__)
    generators = [p.generator() for p in params]
    alone = [next_token(logits[row], params[row], generators[row], states[row]) for row in range(4)]
    assert together == alone
    assert together[0] == top[0]  # no penalty
    assert together[1] != top[1] and together[2] != top[2]  # their best was seen
    with pytest.raises(ValueError, match="PenaltyState"):
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


@pytest.mark.parametrize(
    ("options", "kept"),
    [
        ({"temperature": 0.7, "top_k": 0}, [0, 1, 2, 3, 4, 5]),
        ({"top_k": 3}, [0, 1, 2]),
        ({"top_p": 0.75}, [0, 1]),  # 0.51 + 0.25 reach 0.75: the third goes
        ({"top_k": 4, "top_p": 0.9}, [0, 1, 2]),
    ],
)
def test_draws_follow_the_warped_distribution(options: dict, kept: list[int]) -> None:
    """Many draws from one generator land on each token as often as transformers' warpers
    (temperature, top-k, top-p, in that order) weigh it, and never outside them."""
    probabilities = torch.tensor([0.51, 0.25, 0.12, 0.06, 0.04, 0.02])
    logits = probabilities.log()
    params = SamplingParams(do_sample=True, seed=3, **options)
    generator = params.generator()
    draws = 4000
    counts = torch.bincount(
        torch.tensor([next_token(logits, params, generator) for _ in range(draws)]), minlength=6
    )
    weights = torch.zeros(6)
    weights[kept] = (logits[kept] / params.temperature).softmax(-1)
    assert torch.all(counts[weights == 0] == 0)
    assert (counts.float() / draws - weights).abs().max() < 0.03


@pytest.mark.parametrize("vocab", [64, 2048])
def test_draws_among_the_top_k_pick_what_whole_rows_pick(
    monkeypatch: pytest.MonkeyPatch, vocab: int
) -> None:
    """Rows with a small top-k draw over their k likeliest tokens only; the tokens are those of
    the whole-row draw from the same uniform numbers, with top-p, with a tie at the k-th score
    (that row draws over its whole row) and beside rows without top-k."""
    from cuvil.generation import sampling

    logits = torch.randn(12, vocab, generator=torch.Generator().manual_seed(4)) * 3
    logits[10, :4] = logits[10].topk(4).values[-1]  # ties with row 10's 4th score (k 4)
    params = [
        SamplingParams(do_sample=True, top_k=k, top_p=p, temperature=t)
        for k, p, t in (
            [(50, 1.0, 1.0), (4, 1.0, 0.7), (20, 0.9, 1.0), (0, 1.0, 1.0), (1, 1.0, 1.0)] * 2
            + [(4, 1.0, 1.0), (50, 0.5, 1.3)]
        )
    ]
    whole = [
        row for row, p in enumerate(params) if sampling._top_k(logits[row].numpy(), p.top_k) is None
    ]
    assert whole == [3, 8, 10]  # no top-k, and the tie
    picks = {}
    for way, limit in (("top k", sampling.CANDIDATES_AT_MOST), ("whole rows", 0)):
        monkeypatch.setattr(sampling, "CANDIDATES_AT_MOST", limit)
        picks[way] = [
            next_tokens(logits, params, [_seeded(100 * draw + row) for row in range(12)])
            for draw in range(40)
        ]
    assert picks["top k"] == picks["whole rows"]
    assert len({tuple(step) for step in picks["top k"]}) > 30  # the draws differ draw to draw


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)
