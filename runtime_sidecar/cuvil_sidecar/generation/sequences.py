"""A generation request inside the scheduler (``Sequence``), the events it sends its stream
(``TokenEvent``), why it ends (``FINISH_*``), and the scheduler's usage figures (``Usage``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from cuvil.generation.penalties import PenaltyState
from cuvil.generation.sampling import SamplingParams, TokenLogprobs

# why a sequence ended: its eos token, its token limit (max_new_tokens or max_seq), its client
# went away, the engine failed, or the sidecar stopped
FINISH_STOP, FINISH_LENGTH, FINISH_CANCELLED, FINISH_ERROR = "stop", "length", "cancelled", "error"
FINISH_SHUTDOWN = "shutdown"


@dataclass(frozen=True)
class TokenEvent:
    """One generated token (``token``; None on an end without one), and ``finish`` set on the
    sequence's last event."""

    token: int | None
    index: int
    finish: str | None = None
    error: str = ""
    at_ns: int = 0  # when the token was picked (time.perf_counter_ns)
    logprobs: TokenLogprobs | None = None  # where the request asked for them


Sink = Callable[[TokenEvent], None]


@dataclass(eq=False)
class Sequence:
    prompt: list[int]
    params: SamplingParams
    sink: Sink
    max_new_tokens: int  # the request's, cut to what max_seq leaves
    generator: torch.Generator | None
    submitted_ns: int
    slot: int = -1
    prefilled: int = 0  # prompt positions in the cache before its decode steps (all but one)
    tokens: list[int] = field(default_factory=list)
    cancelled: bool = False
    client_gone: Callable[[], bool] | None = None
    reused: int = 0  # prompt tokens copied from a slot's cache rather than prefilled
    logprobs: int | None = None  # report each token's log-probability and this many others'
    penalty: PenaltyState | None = None  # its tokens as its penalties count them, if it has any

    def abandoned(self) -> bool:
        """Cancelled, or its client gone (asked of the transport, for one that can tell)."""
        if not self.cancelled and self.client_gone is not None and self.client_gone():
            self.cancelled = True
        return self.cancelled

    @property
    def reserved(self) -> int:
        return len(self.prompt) + self.max_new_tokens

    def written(self) -> list[int]:
        """The tokens whose keys and values its slot holds, from position 0: the prompt's
        prefilled part, then each decode step's input (a prompt's last token, then every
        generated token but the newest)."""
        count = self.prefilled + len(self.tokens)
        held = self.prompt if count <= len(self.prompt) else self.prompt + self.tokens
        return held[:count]


def decode_ready(sequence: Sequence) -> bool:
    """Its prompt but the last token is in the cache: it joins the next decode step."""
    return sequence.prefilled == len(sequence.prompt) - 1


@dataclass(frozen=True)
class Usage:
    running: int  # sequences holding a slot
    waiting: int
    reserved_positions: int
    budget_positions: int
    reused_tokens: int = 0  # prompt tokens taken from a slot's cache rather than prefilled

    @property
    def fraction(self) -> float:
        return self.reserved_positions / self.budget_positions if self.budget_positions else 0.0
