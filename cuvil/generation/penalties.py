"""The penalties ``sampling`` applies before it picks, batched over a step's rows.

``repetition_penalty`` is transformers' (CTRL's): every token a sequence holds, prompt and
generated, has its logit divided by the penalty where positive and multiplied where negative.
``presence_penalty`` and ``frequency_penalty`` are OpenAI's (as vLLM applies them, after the
repetition penalty): each generated token's logit is lowered by the frequency penalty per time
it was generated, then by the presence penalty once. Each sequence keeps a ``PenaltyState``,
updated token by token, and a step's penalties touch only the ids its penalized rows hold,
gathered across the rows into one operation (a pass of boolean masks over a 32000-token
vocabulary costs more, on the CPU, than a small model's whole decode step).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from cuvil.generation.sampling import SamplingParams


class _IdSet:
    """Distinct token ids in order of arrival, as a tensor grown in place."""

    def __init__(self, ids: torch.Tensor | None = None) -> None:
        """``ids``: distinct ids to start with."""
        start = torch.empty(0, dtype=torch.int64) if ids is None else ids.to(torch.int64)
        self._seen: set[int] = set(start.tolist())
        self._ids = torch.cat([start, torch.empty(max(64, start.numel()), dtype=torch.int64)])

    @property
    def ids(self) -> torch.Tensor:
        return self._ids[: len(self._seen)]

    def add(self, token: int) -> None:
        if token in self._seen:
            return
        if len(self._seen) == self._ids.numel():
            self._ids = torch.cat([self._ids, torch.empty_like(self._ids)])
        self._ids[len(self._seen)] = token
        self._seen.add(token)


class PenaltyState:
    """One sequence's tokens as the penalties count them: the distinct ids it holds (prompt
    and generated), the distinct ids it generated, and how often it generated each
    (``counts``, over the vocabulary). Ids past ``vocab`` (the logits' width) are ignored, as
    transformers ignores them."""

    def __init__(self, vocab: int, prompt: Iterable[int] = ()) -> None:
        self.vocab = vocab
        self.counts = torch.zeros(vocab)
        ids = torch.tensor(list(prompt), dtype=torch.int64)
        self._held = _IdSet(ids[(ids >= 0) & (ids < vocab)].unique())  # a long prompt: no loop
        self._generated = _IdSet()

    @property
    def held_ids(self) -> torch.Tensor:
        return self._held.ids

    @property
    def generated_ids(self) -> torch.Tensor:
        return self._generated.ids

    def add(self, token: int) -> None:
        """A token the sequence generated."""
        if 0 <= token < self.vocab:
            self._held.add(token)
            self._generated.add(token)
            self.counts[token] += 1


def apply_penalties(
    scores: torch.Tensor, params: Sequence[SamplingParams], states: Sequence[PenaltyState]
) -> torch.Tensor:
    """``scores`` [rows, vocab] (float32) with each row's penalties applied by its state: a
    repeated token's ``s * p`` or ``s / p`` as transformers computes it, then ``s - f * count
    - presence`` for each generated token."""
    scores = scores.clone()
    flat, vocab = scores.view(-1), scores.shape[1]
    repeating = [row for row, p in enumerate(params) if p.repetition_penalty != 1]
    if repeating:
        where, per_id = _gathered(repeating, [states[r].held_ids for r in repeating], vocab)
        factor = per_id([params[row].repetition_penalty for row in repeating])
        picked = flat.index_select(0, where)
        flat.index_copy_(0, where, torch.where(picked < 0, picked * factor, picked / factor))
    lowered = [row for row, p in enumerate(params) if p.frequency_penalty or p.presence_penalty]
    if lowered:
        generated = [states[row].generated_ids for row in lowered]
        where, per_id = _gathered(lowered, generated, vocab)
        counts = torch.cat(
            [states[row].counts[ids] for row, ids in zip(lowered, generated, strict=True)]
        )
        frequency = per_id([params[row].frequency_penalty for row in lowered])
        presence = per_id([params[row].presence_penalty for row in lowered])
        flat.index_copy_(0, where, flat.index_select(0, where) - frequency * counts - presence)
    return scores


def _gathered(
    rows: list[int], ids: list[torch.Tensor], vocab: int
) -> tuple[torch.Tensor, Callable[[list[float]], torch.Tensor]]:
    """The flat positions of each row's ``ids``, and a function spreading one value per row
    over its ids."""
    where = torch.cat([row_ids + row * vocab for row, row_ids in zip(rows, ids, strict=True)])
    lengths = torch.tensor([len(row_ids) for row_ids in ids])

    def per_id(values: list[float]) -> torch.Tensor:
        return torch.repeat_interleave(torch.tensor(values), lengths)

    return where, per_id
