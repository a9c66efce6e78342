"""A ``DecoderEngine`` over an eager transformers causal LM: the reference the compiled engine
is measured and checked against, and a way to serve a transformers checkpoint as it is.

The cache is static per slot: one key and one value tensor per layer,
``[max_batch, kv_heads, max_seq, head_dim]``, allocated once. A step gathers the slots it runs
into a transformers ``DynamicCache`` (right-padded to the longest of them), runs the model with
explicit ``position_ids`` and an attention mask that hides the padding, and writes the keys and
values the step appended back into each slot at its own positions. Padding is masked, never
attended, so a slot decoded beside others sees what it would see alone (up to the order of
floating-point sums in batched matrix products).

The shapes of the cache are learnt by running the model on one token when the engine is built,
so any architecture whose attention layers fill a ``DynamicCache`` works without per-model code.
Models whose layers are not all full attention (sliding windows, linear attention) are not
covered: the gathered cache treats every layer as full attention.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel


class EagerDecoderEngine:
    def __init__(self, model: PreTrainedModel, max_batch: int, max_seq: int) -> None:
        if max_batch < 1 or max_seq < 2:
            raise ValueError(f"max_batch must be ≥ 1 and max_seq ≥ 2, not {max_batch}, {max_seq}")
        self.model = model.eval()
        self._max_batch = max_batch
        self._max_seq = max_seq
        self._lengths = [0] * max_batch  # positions written per slot
        probe = DynamicCache()
        with torch.inference_mode():
            output = model(
                input_ids=torch.zeros(1, 1, dtype=torch.long), cache=probe, use_cache=True
            )
        self._vocab_size = int(output.logits.shape[-1])
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []
        for layer in probe.layers:
            keys, values = _layer_tensors(layer)
            self._keys.append(keys.new_zeros(max_batch, keys.shape[1], max_seq, keys.shape[3]))
            self._values.append(
                values.new_zeros(max_batch, values.shape[1], max_seq, values.shape[3])
            )

    @property
    def max_batch(self) -> int:
        return self._max_batch

    @property
    def max_seq(self) -> int:
        return self._max_seq

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def kv_bytes_per_token(self) -> int:
        pairs = zip(self._keys, self._values, strict=True)
        per_slot = sum(keys[0].nbytes + values[0].nbytes for keys, values in pairs)
        return per_slot // self._max_seq

    def prefill(self, slot: int, token_ids: torch.Tensor, position: int) -> torch.Tensor:
        count = int(token_ids.numel())
        self._check(slot, position, count)
        if position != self._lengths[slot]:
            raise ValueError(
                f"slot {slot} holds {self._lengths[slot]} positions; a chunk cannot start at "
                f"{position}"
            )
        positions = torch.arange(position, position + count).unsqueeze(0)
        logits = self._step([slot], token_ids.reshape(1, count).long(), positions, [position])
        return logits[0, -1]

    def extend(self, slot: int, token_ids: torch.Tensor, position: int) -> None:
        self.prefill(slot, token_ids, position)

    def decode(
        self, slots: Sequence[int], token_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        starts = [int(p) for p in positions.reshape(-1)]
        if len(starts) != len(slots) or len(set(slots)) != len(slots):
            raise ValueError("decode takes one position per slot, each slot once")
        for slot, start in zip(slots, starts, strict=True):
            self._check(slot, start, 1)
            if start != self._lengths[slot]:
                raise ValueError(f"slot {slot} holds {self._lengths[slot]} positions, not {start}")
        ids = token_ids.reshape(len(slots), 1).long()
        logits = self._step(list(slots), ids, torch.tensor(starts).unsqueeze(1), starts)
        return logits[:, -1]

    def release(self, slot: int) -> None:
        self._lengths[slot] = 0  # what the slot holds stays there for copy_prefix

    def copy_prefix(self, source: int, target: int, length: int) -> None:
        """Positions ``0..length-1`` of slot ``source`` into slot ``target``, which then
        holds ``length`` positions (``DecoderEngine``'s optional method)."""
        self._check(source, 0, length)
        self._check(target, 0, length)
        if source != target:
            with torch.inference_mode():
                for cache in (*self._keys, *self._values):
                    cache[target, :, :length].copy_(cache[source, :, :length])
        self._lengths[target] = length

    def _check(self, slot: int, position: int, count: int) -> None:
        if not 0 <= slot < self._max_batch:
            raise ValueError(f"slot {slot} is not in 0..{self._max_batch - 1}")
        if count < 1 or position < 0 or position + count > self._max_seq:
            raise ValueError(
                f"positions {position}..{position + count - 1} do not fit max_seq {self._max_seq}"
            )

    def _step(
        self,
        slots: list[int],
        token_ids: torch.Tensor,
        position_ids: torch.Tensor,
        starts: list[int],
    ) -> torch.Tensor:
        """Run ``token_ids`` ``[b, n]`` for ``slots`` whose caches hold ``starts`` positions."""
        held = max(starts)
        count = token_ids.shape[1]
        index = torch.tensor(slots)
        cache = DynamicCache()
        if held:
            for layer, (keys, values) in enumerate(zip(self._keys, self._values, strict=True)):
                cache.update(keys[index, :, :held], values[index, :, :held], layer)
        mask = torch.ones(len(slots), held + count, dtype=torch.long)
        for row, start in enumerate(starts):
            mask[row, start:held] = 0  # the shorter slots' padding
        with torch.inference_mode():
            output = self.model(
                input_ids=token_ids,
                attention_mask=mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=True,
                logits_to_keep=1,  # only the last position's logits are wanted
            )
        for layer, (keys, values) in enumerate(zip(self._keys, self._values, strict=True)):
            new_keys, new_values = _layer_tensors(cache.layers[layer])
            for row, (slot, start) in enumerate(zip(slots, starts, strict=True)):
                keys[slot, :, start : start + count] = new_keys[row, :, held:]
                values[slot, :, start : start + count] = new_values[row, :, held:]
        for slot, start in zip(slots, starts, strict=True):
            self._lengths[slot] = start + count
        return output.logits.float()


def _layer_tensors(layer: object) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache layer's keys and values ``[batch, kv_heads, positions, head_dim]``."""
    keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
    if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
        raise ValueError(
            f"{type(layer).__name__} holds no keys and values: only full-attention layers are "
            "covered"
        )
    return keys, values
