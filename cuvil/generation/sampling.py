"""Picking the next token from logits, shared by ``generate`` and the sidecar's scheduler.

The order is transformers': the penalties first (``penalties.py``; they change greedy picks
too), then the warpers (temperature, top-k, top-p), so ``do_sample=False`` is argmax and
sampling draws from the same distribution transformers would. Each sequence carries its own
``torch.Generator``: seeded, a sequence draws the same tokens whether it runs alone or in a
batch that others join and leave.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from cuvil.generation.penalties import PenaltyState, apply_penalties


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


def next_token(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    penalty: PenaltyState | None = None,
) -> int:
    """The next token for one sequence from its 1-D logits (``penalty``: its tokens so far,
    needed when a penalty is on): ``next_tokens`` for a step of one row."""
    return next_tokens(logits.reshape(1, -1), [params], [generator], [penalty].__getitem__)[0]


def next_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    penalties: Callable[[int], PenaltyState | None] | None = None,
    failed: Callable[[int, Exception], None] | None = None,
) -> list[int]:
    """The next token of each row of ``logits`` [rows, vocab]: one argmax over all rows for the
    greedy ones (an all-greedy step runs no other Python), the penalties of the rows that have
    them applied together (``penalties(row)``: that row's state), then one argmax over those
    rows and the warpers and draws of the sampled rows together, each row drawing from its own
    generator, so a row picks the same token alone or among others. With ``failed``, a row
    that cannot be drawn from (no finite weight) is handed to it and gets -1, and the other
    rows their tokens; without, the error propagates."""
    picks = greedy_picks(logits)
    special = [row for row, p in enumerate(params) if p.do_sample or p.penalizes]
    if not special:
        return picks
    every = len(special) == len(params)  # no rows to leave out: no gather
    # on the CPU (where a GPU's logits come to be drawn from), a copy this may change
    work = (logits if every else logits[special]).to("cpu", torch.float32, copy=every)
    penalized = [k for k, row in enumerate(special) if params[row].penalizes]
    if penalized:
        states = [penalties(special[k]) if penalties is not None else None for k in penalized]
        held = [state for state in states if state is not None]
        if len(held) < len(states):
            raise ValueError("a penalty needs the rows' tokens so far (their PenaltyState)")
        rows = [params[special[k]] for k in penalized]
        if len(penalized) == len(special):
            work = apply_penalties(work, rows, held)
        else:
            work[penalized] = apply_penalties(work[penalized], rows, held)
        for k, best in zip(penalized, greedy_picks(work[penalized]), strict=True):
            picks[special[k]] = best
    sampled = [k for k, row in enumerate(special) if params[row].do_sample]
    if sampled:
        rows = [params[special[k]] for k in sampled]
        drawn = _draws(work[sampled], rows, [generators[special[k]] for k in sampled])
        for k, token in zip(sampled, drawn, strict=True):
            if isinstance(token, Exception):
                if failed is None:
                    raise token
                failed(special[k], token)
                token = -1
            picks[special[k]] = token
    return picks


# top-k rows with k up to this draw among their k likeliest tokens only (one ``topk`` for all
# of them, then the mask, exponent and cumulative sum over k columns, not the vocabulary)
CANDIDATES_AT_MOST = 256


def _draws(
    scores: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int | Exception]:
    """A draw for each row of (penalized) ``scores`` [rows, vocab] through its warpers
    (temperature, top-k, top-p), from one uniform number of its own generator (inverse CDF
    over the vocabulary in token order). Each warper is a threshold on the row's scores: top-k's
    is its k-th largest, top-p's the smallest score of the nucleus (found among the top-k
    survivors only); then one mask, exponent and cumulative sum serve all the rows, in place
    in ``scores`` (which this takes over). Rows with a small top-k and no tie at its threshold
    do all this over their k likeliest tokens, put back in token order, which gives the same
    token (the tokens left out weigh exactly 0). A row with no finite weight gets an exception
    instead of a token."""
    scores = scores.div_(torch.tensor([p.temperature for p in params]).unsqueeze(1))  # in place:
    values = scores.numpy()  # a step's tensors of rows x vocabulary cost page faults to make
    uniform = torch.cat([torch.rand(1, generator=g) for g in generators])
    candidates = {row: _top_k(values[row], p.top_k) for row, p in enumerate(params)}
    narrow = [row for row, tokens in candidates.items() if tokens is not None]
    wide = [row for row in range(len(params)) if candidates[row] is None]
    drawn: list[int | Exception] = [0] * len(params)
    if wide:
        rows = scores if len(wide) == len(params) else scores[wide]
        picked = _draw_wide(rows, [params[r] for r in wide], uniform[wide])
        for row, token in zip(wide, picked, strict=True):
            drawn[row] = token
    if narrow:
        kept = [(values[r], candidates[r], params[r]) for r in narrow]
        picked = _draw_among(kept, uniform[narrow])  # type: ignore[arg-type]
        for row, token in zip(narrow, picked, strict=True):
            drawn[row] = token
    return drawn


def _top_k(values: np.ndarray, k: int) -> np.ndarray | None:
    """The tokens of the ``k`` largest ``values``, in token order, where they are exactly the
    tokens at or above the k-th largest (no tie across it, no NaN) and k is small; else None."""
    if not 0 < k <= min(CANDIDATES_AT_MOST, values.size - 1):
        return None
    kth = np.partition(values, values.size - k)[values.size - k]  # NaN sorts last: in the top
    if np.isnan(kth):
        return None
    tokens = np.flatnonzero(values >= kth)
    return tokens if tokens.size == k else None


def _draw_among(
    rows: list[tuple[np.ndarray, np.ndarray, SamplingParams]], uniform: torch.Tensor
) -> list[int | Exception]:
    """The draws of rows with a small, untied top-k (each its values, its k likeliest tokens
    in token order, its parameters): over those tokens only."""
    width = max(len(tokens) for _, tokens, _ in rows)
    columns = np.full((len(rows), width), -np.inf, dtype=np.float32)
    ids = np.zeros((len(rows), width), dtype=np.int64)
    for row, (values, tokens, p) in enumerate(rows):
        kept = values[tokens]
        if p.top_p < 1:
            kept = np.where(kept < _nucleus_floor(kept, float(kept.min()), p), -np.inf, kept)
        columns[row, : len(kept)] = kept
        ids[row, : len(kept)] = tokens
    return _inverse_cdf(torch.from_numpy(columns), uniform, torch.from_numpy(ids))


def _draw_wide(
    scores: torch.Tensor, params: Sequence[SamplingParams], uniform: torch.Tensor
) -> list[int | Exception]:
    """The draws over whole rows: thresholds by NumPy's selection (not a sort)."""
    vocab = scores.shape[1]
    values = scores.numpy()  # a step's tensors of rows x vocabulary cost page faults to make
    thresholds = np.full(len(params), -np.inf, dtype=np.float32)
    for row, p in enumerate(params):
        if 0 < p.top_k < vocab:
            thresholds[row] = np.partition(values[row], vocab - p.top_k)[vocab - p.top_k]
        if p.top_p < 1:
            thresholds[row] = max(thresholds[row], _nucleus_floor(values[row], thresholds[row], p))
    if bool((thresholds > -np.inf).any()):
        scores.masked_fill_(scores < torch.from_numpy(thresholds).unsqueeze(1), float("-inf"))
    return _inverse_cdf(scores, uniform, None)


def _inverse_cdf(
    scores: torch.Tensor, uniform: torch.Tensor, tokens: torch.Tensor | None
) -> list[int | Exception]:
    """Each row's draw from the softmax of its (masked, in place) ``scores``: the first column
    whose cumulative weight passes its uniform number times the row's total, as a token
    (``tokens``: each column's, where the columns are not the vocabulary itself)."""
    width = scores.shape[1]
    # the softmax's numerators, summed along the row: the inverse CDF needs no normalising
    cdf = scores.sub_(scores.amax(-1, keepdim=True)).exp_().cumsum_(-1)
    totals = cdf[:, -1:]
    found = torch.searchsorted(cdf, uniform.unsqueeze(1) * totals, right=True).clamp_(max=width - 1)
    below = cdf.gather(1, (found - 1).clamp_(min=0)).masked_fill_(found == 0, 0.0)
    weights = (cdf.gather(1, found) - below).flatten().tolist()
    picked = (found if tokens is None else tokens.gather(1, found)).flatten().tolist()
    drawn: list[int | Exception] = []
    for row, total in enumerate(totals.flatten().tolist()):
        if not (math.isfinite(total) and total > 0):
            error = "the probability distribution has no finite weight to draw from"
            drawn.append(RuntimeError(error))
            continue
        if weights[row] > 0:
            drawn.append(picked[row])
            continue
        # u * total rounded up to the total: the last column with any weight
        steps = torch.diff(cdf[row], prepend=cdf.new_zeros(1))
        column = int(torch.nonzero(steps).flatten()[-1])
        drawn.append(column if tokens is None else int(tokens[row, column]))
    return drawn


def _nucleus_floor(values: np.ndarray, floor: float, params: SamplingParams) -> float:
    """The smallest score top-p keeps of a row's ``values`` at or above ``floor``: the least
    likely tokens whose probabilities sum to at most ``1 - top_p`` go, the likeliest stays."""
    kept = np.sort(values[values >= floor]) if floor > -np.inf else np.sort(values)
    if not kept.size or not np.isfinite(kept[-1]):
        return float(floor)
    weights = np.exp(kept - kept[-1], dtype=np.float64)
    cumulative = np.cumsum(weights / weights.sum())
    dropped = min(int(np.count_nonzero(cumulative <= 1 - params.top_p)), kept.size - 1)
    return float(kept[dropped])


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
