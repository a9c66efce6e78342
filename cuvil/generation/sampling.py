"""Picking the next token from logits, shared by ``generate`` and the sidecar's scheduler.

The order is transformers': the penalties first (they change greedy picks too), then the
warpers (temperature, top-k, top-p), so ``do_sample=False`` is argmax and sampling draws from
the same distribution transformers would. ``repetition_penalty`` is transformers' (CTRL's):
every token the sequence holds, prompt and generated, has its logit divided by the penalty
where positive and multiplied where negative. ``presence_penalty`` and ``frequency_penalty``
are OpenAI's (as vLLM applies them, after the repetition penalty): each generated token's
logit is lowered by the presence penalty once and by the frequency penalty per time it was
generated. Each sequence carries its own ``torch.Generator``: seeded, a sequence draws the
same tokens whether it runs alone or in a batch that others join and leave.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 20
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    seed: int | None = None
    eos_token_id: tuple[int, ...] = ()
    repetition_penalty: float = 1.0  # 1 is off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, not {self.max_new_tokens}")
        if self.do_sample and not 0 < self.temperature < math.inf:
            raise ValueError(f"temperature must be positive and finite, not {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 (off) or more, not {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], not {self.top_p}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed must be a 64-bit integer, not {self.seed}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be positive, not {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], not {getattr(self, name)}")

    @property
    def penalizes(self) -> bool:
        """Whether a pick needs the sequence's tokens (some penalty is on)."""
        repeats = self.repetition_penalty != 1
        return repeats or self.presence_penalty != 0 or self.frequency_penalty != 0

    def generator(self) -> torch.Generator | None:
        """A fresh generator for one sequence; None when greedy."""
        if not self.do_sample:
            return None
        generator = torch.Generator()
        generator.manual_seed(self.seed if self.seed is not None else torch.seed())
        return generator


# a row's tokens so far, for the penalties: (every token it holds, prompt included, as
# transformers' input_ids row; the tokens it generated)
History = tuple[Sequence[int], Sequence[int]]


def next_token(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    history: History = ((), ()),
) -> int:
    """The next token for one sequence from its 1-D logits."""
    if params.penalizes:
        logits = penalized(logits.float(), params, *history)
    if not params.do_sample:
        return greedy_picks(logits.reshape(1, -1))[0]
    scores = logits.float() / params.temperature
    if 0 < params.top_k < scores.numel():
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1:
        ordered, order = torch.sort(scores, descending=False)
        cumulative = ordered.softmax(-1).cumsum(-1)
        dropped = cumulative <= 1 - params.top_p
        dropped[-1] = False  # the most likely token always stays
        scores = scores.masked_fill(dropped.scatter(0, order, dropped), float("-inf"))
    probabilities = scores.softmax(-1)
    return int(torch.multinomial(probabilities, 1, generator=generator))


def penalized(
    scores: torch.Tensor, params: SamplingParams, held: Sequence[int], generated: Sequence[int]
) -> torch.Tensor:
    """1-D ``scores`` with the penalties applied: the repetition penalty on the ``held``
    tokens (ids past the logits' end are ignored, as transformers does), then the presence and
    frequency penalties by the ``generated`` tokens' counts."""
    vocab = scores.numel()
    if params.repetition_penalty != 1 and len(held):
        ids = torch.tensor(held, dtype=torch.int64).unique()
        ids = ids[(ids >= 0) & (ids < vocab)]
        picked = scores[ids]
        penalty = params.repetition_penalty
        scores = scores.clone()
        scores[ids] = torch.where(picked < 0, picked * penalty, picked / penalty)
    if (params.presence_penalty or params.frequency_penalty) and len(generated):
        counts = torch.bincount(torch.tensor(generated, dtype=torch.int64), minlength=vocab)
        counts = counts[:vocab].to(scores.dtype)
        scores = scores - params.frequency_penalty * counts
        scores = scores - params.presence_penalty * (counts > 0).to(scores.dtype)
    return scores


def next_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    history: Callable[[int], History] | None = None,
    failed: Callable[[int, Exception], None] | None = None,
) -> list[int]:
    """The next token of each row of ``logits`` [rows, vocab]: one argmax over all rows for the
    greedy ones (a step's per-row Python is what a small model's decode pays for; an all-greedy
    step has none), each sampled or penalized row on its own, as ``next_token``, with
    ``history(row)`` its tokens so far (asked only of the rows a penalty applies to). With
    ``failed``, a row whose pick raises (no finite weight to draw from) is handed to it and
    gets -1, and the other rows their tokens; without, the error propagates."""
    picks = greedy_picks(logits)
    if not any(row_params.do_sample or row_params.penalizes for row_params in params):
        return picks
    for row, (row_params, generator) in enumerate(zip(params, generators, strict=True)):
        if row_params.do_sample or row_params.penalizes:
            if row_params.penalizes and history is None:
                raise ValueError("a penalty needs the rows' tokens so far (history)")
            tokens = history(row) if history is not None and row_params.penalizes else ((), ())
            try:
                picks[row] = next_token(logits[row], row_params, generator, tokens)
            except Exception as error:
                if failed is None:
                    raise
                failed(row, error)
                picks[row] = -1
    return picks


def greedy_picks(logits: torch.Tensor) -> list[int]:
    """Each row's argmax of ``logits`` [rows, vocab], the first index of its largest value
    (a NaN counting as largest), as ``torch.argmax`` picks it. On the CPU through NumPy, whose
    argmax is vectorised: ATen's row-wise argmax takes several times as long, a cost every
    decode step pays (a tenth of a small model's step at 16 rows)."""
    if logits.device.type != "cpu" or logits.dtype not in _NUMPY_ARGMAX:
        return list(torch.argmax(logits, dim=-1).tolist())
    return list(logits.detach().numpy().argmax(axis=-1).tolist())


_NUMPY_ARGMAX = (torch.float32, torch.float64, torch.float16)


# a picked token's log-probability and the ``top`` most likely tokens' (id, log-probability)
TokenLogprobs = tuple[float, tuple[tuple[int, float], ...]]


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> TokenLogprobs:
    """``token``'s log-probability under the model's distribution (the log-softmax of the raw
    1-D ``logits``, before penalties and warpers, as vLLM reports it by default) and the
    ``top`` most likely tokens', most likely first."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    best = torch.topk(logprobs, top) if top else None
    alternatives = (
        () if best is None else tuple(zip(best.indices.tolist(), best.values.tolist(), strict=True))
    )
    return float(logprobs[token]), alternatives
