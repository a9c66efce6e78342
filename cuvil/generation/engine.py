"""The contract between generation drivers and the model steps they run.

A ``DecoderEngine`` owns a KV cache of ``max_batch`` slots, each holding up to ``max_seq``
positions of one sequence. Drivers (``generate`` for a batch in process, the sidecar's
scheduler for streams that join and leave at any step) decide which slot a sequence uses and
which tokens go in; the engine writes their keys and values into the slot's cache at the given
positions and returns the logits of the next token. Positions are per slot, so a left-padded
batch and the same prompts run one by one see the same positions (transformers derives
``position_ids`` from the attention mask the same way).

An engine may also offer ``extend_many(chunks)``: ``extend`` of several ``(slot, token_ids,
position)`` chunks, one per slot, written together (a compiled model packs them into one call
over its weights). Drivers use it where it is there and call ``extend`` per chunk where not.

An engine may offer ``copy_prefix(source, target, length)``: positions ``0..length-1`` of slot
``source`` copied into slot ``target``, which then continues from position ``length`` as if
it had written them (one slot for both: it keeps what it holds). Such an engine keeps a slot's
keys and values after ``release`` until the slot is written again, so a driver may reuse a
finished sequence's prompt for the next that begins the same way (the sidecar's scheduler).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class DecoderEngine(Protocol):
    @property
    def max_batch(self) -> int:
        """How many sequences the cache holds at once (slots ``0..max_batch-1``)."""
        ...

    @property
    def max_seq(self) -> int:
        """Positions per slot: a sequence's prompt plus generated tokens fit in this many."""
        ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def kv_bytes_per_token(self) -> int:
        """Cache bytes one position of one slot takes (all layers, keys and values)."""
        ...

    def prefill(self, slot: int, token_ids: torch.Tensor, position: int) -> torch.Tensor:
        """Write the cache of ``token_ids`` (1-D int64) into ``slot`` at positions
        ``position .. position+len-1`` and return the last token's logits (1-D float32, vocab).

        A prompt may arrive in chunks: the second chunk starts where the first ended, and
        attends to everything before it in the slot.
        """
        ...

    def extend(self, slot: int, token_ids: torch.Tensor, position: int) -> None:
        """Write the cache of ``token_ids`` as ``prefill`` does, without the logits: what a
        driver calls for a prompt's tokens but its last, which then goes in with a decode step
        among the running sequences (its logits come from there). The engine may also write
        positions of the slot past these (a chunk padded to a prepared length): a later call
        writes each of them before any token attends to it.
        """
        ...

    def decode(
        self, slots: Sequence[int], token_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """One step for several slots at once: ``token_ids[i]`` goes into ``slots[i]`` at
        ``positions[i]``; returns logits ``[len(slots), vocab]`` float32."""
        ...

    def release(self, slot: int) -> None:
        """Forget the slot's sequence; its cache may be overwritten by the next one."""
        ...
