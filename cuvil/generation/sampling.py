"""Picking the next token from logits, shared by ``generate`` and the sidecar's scheduler.

The order of the warpers is transformers' (temperature, then top-k, then top-p), so
``do_sample=False`` is argmax and sampling draws from the same distribution transformers
would. Each sequence carries its own ``torch.Generator``: seeded, a sequence draws the same
tokens whether it runs alone or in a batch that others join and leave.
"""

from __future__ import annotations

from collections.abc import Sequence
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

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, not {self.max_new_tokens}")
        if self.do_sample and self.temperature <= 0:
            raise ValueError(f"temperature must be positive, not {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 (off) or more, not {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], not {self.top_p}")

    def generator(self) -> torch.Generator | None:
        """A fresh generator for one sequence; None when greedy."""
        if not self.do_sample:
            return None
        generator = torch.Generator()
        generator.manual_seed(self.seed if self.seed is not None else torch.seed())
        return generator


def next_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> int:
    """The next token for one sequence from its 1-D logits."""
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


def next_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """The next token of each row of ``logits`` [rows, vocab]: one argmax over all rows for the
    greedy ones (a step's per-row Python is what a small model's decode pays for; an all-greedy
    step has none), each sampled row from its own generator, as ``next_token``."""
    picks = greedy_picks(logits)
    if not any(row_params.do_sample for row_params in params):
        return picks
    return [
        next_token(logits[row], row_params, generator) if row_params.do_sample else picks[row]
        for row, (row_params, generator) in enumerate(zip(params, generators, strict=True))
    ]


def greedy_picks(logits: torch.Tensor) -> list[int]:
    """Each row's argmax of ``logits`` [rows, vocab], the first index of its largest value
    (a NaN counting as largest), as ``torch.argmax`` picks it. On the CPU through NumPy, whose
    argmax is vectorised: ATen's row-wise argmax takes several times as long, a cost every
    decode step pays (a tenth of a small model's step at 16 rows)."""
    if logits.device.type != "cpu" or logits.dtype not in _NUMPY_ARGMAX:
        return list(torch.argmax(logits, dim=-1).tolist())
    return list(logits.detach().numpy().argmax(axis=-1).tolist())


_NUMPY_ARGMAX = (torch.float32, torch.float64, torch.float16)
