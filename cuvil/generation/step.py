"""A causal LM as one step over an explicit KV cache: the module the generation compile exports.

``DecoderStep(model)(input_ids, slots, positions, *caches)`` runs the model's own forward
(transformers' code: embeddings, RoPE or learned positions, norms, MLPs) on ``input_ids``
[batch, tokens] at positions ``positions[b] + 0 .. tokens-1`` and returns the last token's logits
[batch, vocab]. ``DecoderStep(model, per_token=True)`` takes one row of tokens, each with its own
slot and position (``slots`` and ``positions`` [tokens]): tokens of several sequences packed into
one call, each attending over its own slot up to its own position, as the rows of a decode step
do, so that a few short prompts are written with one pass over the weights.

Attention goes through an attention implementation registered with transformers
(``cuvil_kv_cache``) that writes each layer's keys and values into that layer's caches and
attends over the slot (cuvil/frontend/kv_cache_ops.py): the caches are inputs, one
key and one value tensor per layer, so the exported graph reads and writes them explicitly.

``probe_layout`` finds what the cache must hold (layers, KV heads, head size, dtype) by running
the model once on two tokens and watching the keys its attention receives, so that any model
whose attention goes through transformers' attention interface fits without per-family code.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from cuvil.frontend.kv_cache_ops import cached_attention, kv_cache_write
from cuvil.runtime.generation import KVCacheLayout

ATTENTION_NAME = "cuvil_kv_cache"
PROBE_NAME = "cuvil_kv_probe"


@dataclass
class _StepState:
    caches: tuple[torch.Tensor, ...]
    slots: torch.Tensor
    positions: torch.Tensor
    per_token: bool  # slots and positions give each token's, not each row's first


_current: list[_StepState] = []  # the step being traced or run (a stack of one)
_probed: dict[int, tuple[int, int, torch.dtype]] = {}


def _layer_of(module: torch.nn.Module) -> int:
    layer = getattr(module, "layer_idx", None)
    if not isinstance(layer, int):
        raise TypeError(f"{type(module).__name__} has no integer layer_idx to pick its cache by")
    return layer


def _cached_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: keys and values into this layer's cache, then
    attention over the slot; returns [batch, tokens, heads, head] like its sdpa function."""
    state = _current[-1]
    layer = _layer_of(module)
    if state.per_token:  # [1, heads, tokens, head] -> [tokens, heads, 1, head]: a row a token
        query, key, value = (t.transpose(0, 2) for t in (query, key, value))
    key_cache = kv_cache_write(state.caches[2 * layer], key, state.slots, state.positions)
    value_cache = kv_cache_write(state.caches[2 * layer + 1], value, state.slots, state.positions)
    out = cached_attention(query, key_cache, value_cache, state.slots, state.positions, scaling)
    if state.per_token:
        return out.permute(2, 0, 1, 3).contiguous(), None  # [1, tokens, heads, head]
    return out.transpose(1, 2).contiguous(), None


def _probe_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    _probed[_layer_of(module)] = (int(key.shape[1]), int(key.shape[3]), key.dtype)
    out = F.scaled_dot_product_attention(
        query, key, value, is_causal=True, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


@contextmanager
def attention_implementation(model: torch.nn.Module, name: str) -> Iterator[None]:
    """Run ``model`` with the attention implementation ``name`` (registered on first use)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, _cached_attention)
    AttentionInterface.register(PROBE_NAME, _probe_attention)
    configs: list[Any] = [m.config for m in model.modules() if hasattr(m, "config")]
    before = [getattr(config, "_attn_implementation", None) for config in configs]
    try:
        for config in configs:
            config._attn_implementation = name
        yield
    finally:
        for config, previous in zip(configs, before, strict=True):
            config._attn_implementation = previous


def probe_layout(model: torch.nn.Module, max_batch: int, max_seq: int) -> KVCacheLayout:
    """The cache the model needs, from one eager forward over two tokens."""
    _probed.clear()
    with torch.no_grad(), attention_implementation(model, PROBE_NAME):
        model(input_ids=torch.zeros(1, 2, dtype=torch.int64), use_cache=False)
    if not _probed or sorted(_probed) != list(range(len(_probed))):
        raise ValueError(
            f"{type(model).__name__}: its attention does not go through transformers' attention "
            "interface with layer indices 0..n-1; it cannot be compiled for generation"
        )
    shapes = set(_probed.values())
    if len(shapes) != 1:
        raise ValueError(f"layers need caches of different shapes {sorted(map(str, shapes))}")
    kv_heads, head_dim, dtype = shapes.pop()
    return KVCacheLayout(len(_probed), kv_heads, head_dim, dtype, max_batch, max_seq)


class DecoderStep(torch.nn.Module):
    """One prefill or decode step of ``model`` over the caches given as inputs; ``per_token``:
    one row of tokens with a slot and a position each."""

    def __init__(self, model: torch.nn.Module, *, per_token: bool = False) -> None:
        super().__init__()
        self.model = model
        self.per_token = per_token

    def forward(
        self,
        input_ids: torch.Tensor,
        slots: torch.Tensor,
        positions: torch.Tensor,
        *caches: torch.Tensor,
    ) -> torch.Tensor:
        if self.per_token:
            position_ids = positions[None, :]
        else:
            tokens = input_ids.shape[1]
            position_ids = positions[:, None] + torch.arange(tokens, device=input_ids.device)
        _current.append(_StepState(caches, slots, positions, self.per_token))
        try:
            with attention_implementation(self.model, ATTENTION_NAME):
                out = self.model(
                    input_ids=input_ids,
                    position_ids=position_ids,
                    use_cache=False,
                    logits_to_keep=1,
                )
        finally:
            _current.pop()
        logits: torch.Tensor = out.logits
        return logits[:, -1, :]
