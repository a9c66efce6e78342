"""GenerationModel: a decoder LLM compiled for generation, as a ``DecoderEngine``.

What ``cuvil.jit(..., task="text-generation")`` returns and ``cuvil.load`` brings back from an
artifact whose config has a ``generation`` entry. It holds two plans over one set of weights:
the decode step (the artifact's ``graph.json``, also what ``CompiledModel`` runs) and the prefill
step (``prefill_graph.json``), and owns the KV cache both read and write.

The cache is static per slot: per layer, a key and a value tensor of
[max_batch, kv_heads, max_seq, head_dim], allocated once when the model loads. A sequence owns
one slot; its keys and values sit at its own positions ``0 .. length-1``, and the compiled
attention reads only that prefix. Static slots rather than paged blocks, because on a CPU the
cache is ordinary memory that costs nothing until touched (zeroed pages are mapped lazily), a
slot's prefix is one strided view that attention reads without gathering, and the write is one
``index_put_``: paging would add a block table, a gather per layer and step, and fragmentation
bookkeeping to save memory that a CPU's small ``max_batch`` does not spend. A scheduler admits
against ``kv_bytes_per_token`` times tokens just the same.

Inputs of both graphs, in order: ``input_ids`` [batch, tokens], ``slots`` [batch], ``positions``
[batch] (each row's first position), then the caches (keys of layer 0, values of layer 0, …).
The decode graph has a symbolic batch and one token; the prefill graph one row and a symbolic
number of tokens. Each call checks slots and positions against the cache before it runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cuvil.artifact.files import ArtifactContents
from cuvil.dtypes import dtype_name, torch_dtype
from cuvil.runtime.model import CompiledModel
from cuvil.runtime.plan import ExecutionPlan
from cuvil.runtime.signature import InputBinder, InputError, Signature

STEP_INPUTS = ("input_ids", "slots", "positions")


@dataclass(frozen=True)
class KVCacheLayout:
    """Static per-slot KV cache: per layer, keys and values [slots, kv_heads, max_seq, head]."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    max_batch: int
    max_seq: int

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.max_batch, self.kv_heads, self.max_seq, self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one position of one slot takes, all layers, keys and values."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype.itemsize

    def allocate(self, device: torch.device | str = "cpu") -> list[torch.Tensor]:
        """Zeroed caches in the graphs' input order: keys then values, layer by layer."""
        return [
            torch.zeros(self.shape, dtype=self.dtype, device=device) for _ in range(2 * self.layers)
        ]

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "static-per-slot",
            "layers": self.layers,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "dtype": dtype_name(self.dtype),
            "max_batch": self.max_batch,
            "max_seq": self.max_seq,
            "order": "per layer: keys then values, each [max_batch, kv_heads, max_seq, head_dim]",
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> KVCacheLayout:
        if data.get("kind") != "static-per-slot":
            raise ValueError(f"unknown KV cache layout {data.get('kind')!r}")
        return cls(
            int(data["layers"]),
            int(data["kv_heads"]),
            int(data["head_dim"]),
            torch_dtype(str(data["dtype"])),
            int(data["max_batch"]),
            int(data["max_seq"]),
        )


class GenerationModel(CompiledModel):
    """A compiled decoder LLM: ``prefill``/``decode``/``release`` (the ``DecoderEngine``
    contract of cuvil/generation/engine.py) and ``generate`` on top of them."""

    def __init__(self, contents: ArtifactContents, **kwargs: Any) -> None:
        super().__init__(contents, **kwargs)
        if contents.prefill_graph is None or "generation" not in contents.config:
            raise ValueError("not a generation artifact: no prefill graph or generation config")
        self.generation_config: dict[str, Any] = dict(contents.config["generation"])
        self.layout = KVCacheLayout.from_json(self.generation_config["kv_cache"])
        factories = {
            **self.backend.kernels,
            **self.backend.load_kernels({}),
        }
        self.prefill_plan = ExecutionPlan(
            contents.prefill_graph, contents.weights, self.device, factories
        )
        self._prefill_binder = InputBinder(Signature.of_graph(contents.prefill_graph))
        self.cache_names = tuple(self.generation_config["cache_inputs"])
        for graph in (contents.graph, contents.prefill_graph):
            if tuple(graph.inputs) != (*STEP_INPUTS, *self.cache_names):
                raise ValueError(f"graph {graph.name} takes {list(graph.inputs)}, not a step")
        self.caches = self.layout.allocate(self.device)
        self._vocab_size = int(self.generation_config["vocab_size"])

    # -- the DecoderEngine contract

    @property
    def max_batch(self) -> int:
        return self.layout.max_batch

    @property
    def max_seq(self) -> int:
        return self.layout.max_seq

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layout.bytes_per_token

    def prefill(self, slot: int, token_ids: torch.Tensor, position: int) -> torch.Tensor:
        tokens = int(token_ids.numel())
        if token_ids.dim() != 1 or tokens < 1:
            raise InputError(f"prefill takes a non-empty 1-D token tensor, not {token_ids.shape}")
        self._check_slot(slot)
        self._check_span(position, tokens)
        inputs = self._step_inputs(
            token_ids.reshape(1, tokens),
            torch.tensor([slot], dtype=torch.int64),
            torch.tensor([position], dtype=torch.int64),
        )
        symbols = self._prefill_binder.bind(inputs)
        with torch.inference_mode():
            logits = self.prefill_plan.run(inputs, symbols)["output"]
        return logits[0].float()

    def decode(
        self, slots: Sequence[int], token_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        rows = len(slots)
        if not 1 <= rows <= self.max_batch or len(set(slots)) != rows:
            raise InputError(f"decode takes 1..{self.max_batch} distinct slots, not {list(slots)}")
        for slot in slots:
            self._check_slot(slot)
        starts = [int(p) for p in positions.reshape(-1).tolist()]
        if token_ids.numel() != rows or len(starts) != rows:
            raise InputError(f"decode needs one token and one position per slot ({rows})")
        for start in starts:
            self._check_span(start, 1)
        inputs = self._step_inputs(
            token_ids.reshape(rows, 1).to(torch.int64),
            torch.tensor(list(slots), dtype=torch.int64),
            torch.tensor(starts, dtype=torch.int64),
        )
        symbols = self._binder.bind(inputs)
        with torch.inference_mode():
            logits = self.runner.run(inputs, symbols)["output"]
        return logits.float()

    def release(self, slot: int) -> None:
        """Nothing to free: a slot's next sequence overwrites the positions it reads."""
        self._check_slot(slot)

    # -- generation

    def generate(self, input_ids: torch.Tensor, **options: Any) -> torch.Tensor:
        """transformers' ``generate`` for greedy and sampled decoding (cuvil/generation/
        generate.py says what it takes and what it refuses)."""
        from cuvil.generation.generate import generate

        defaults = {
            key: self.generation_config[key]
            for key in ("eos_token_id", "pad_token_id")
            if self.generation_config.get(key) is not None
        }
        return generate(self, input_ids, **{**defaults, **options})

    def reset_cache(self) -> None:
        for cache in self.caches:
            cache.zero_()

    # -- helpers

    def _step_inputs(
        self, input_ids: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        inputs = {"input_ids": input_ids.to(torch.int64), "slots": slots, "positions": positions}
        inputs.update(zip(self.cache_names, self.caches, strict=True))
        return inputs

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_batch:
            raise InputError(f"slot {slot} is outside 0..{self.max_batch - 1}")

    def _check_span(self, position: int, tokens: int) -> None:
        if position < 0 or position + tokens > self.max_seq:
            raise InputError(
                f"positions {position}..{position + tokens - 1} do not fit a cache of "
                f"{self.max_seq} positions per slot"
            )

    @property
    def tokenizer_files(self) -> dict[str, bytes]:
        """The source model's tokenizer files (JSON), when it had them."""
        return dict(self.contents.data_files)
