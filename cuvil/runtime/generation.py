"""GenerationModel: a decoder LLM compiled for generation, as a ``DecoderEngine``.

What ``cuvil.jit(..., task="text-generation")`` returns and ``cuvil.load`` brings back from an
artifact whose config has a ``generation`` entry. It holds two plans over one set of weights:
the decode step (the artifact's ``graph.json``, also what ``CompiledModel`` runs) and the prefill
step (``prefill_graph.json``, run as a ``CompiledModel`` of its own, ``prefill_model``), and
owns the KV cache both read and write. Kernel choices made at compile time (``choose_kernels``:
every decode row bucket and the example prompt's prefill) are carried in the config, the
prefill's under ``PREFILL_CHOICES``, and taken on load. A decode step whose row count has a
whole-plan native schedule calls it directly, without the signature check (the row count
decides its outcome). Past 16 rows a step is padded up to one of a few row counts
(``decode_row_counts``), each pad row writing a position of a real row's slot that nothing has
read yet, so that many slots do not mean many shapes.

The cache is static per slot: per layer, a key and a value tensor of
[max_batch, kv_heads, max_seq, head_dim], allocated once when the model loads. A sequence owns
one slot; its keys and values sit at its own positions ``0 .. length-1``, and the compiled
attention reads only that prefix. Static slots rather than paged blocks, because on a CPU the
cache is ordinary memory that costs nothing until touched (zeroed pages are mapped lazily), a
slot's prefix is one strided view that attention reads without gathering, and the write is one
``index_put_``: paging would add a block table, a gather per layer and step, and fragmentation
bookkeeping to save memory that a CPU's small ``max_batch`` does not spend. A scheduler admits
against ``kv_bytes_per_token`` times tokens just the same.

Inputs of both graphs, in order: ``input_ids`` [batch, tokens], ``slots``, ``positions``, then
the caches (keys of layer 0, values of layer 0, …). The decode graph has a symbolic batch and
one token, ``slots`` and ``positions`` [batch]. The prefill graph has one row and a symbolic
number of tokens, ``slots`` and ``positions`` [tokens], one per token (``prefill_positions:
per_token`` in the config; an artifact without it has one per row, [1]): ``extend_many`` packs
chunks of several prompts into one call, so a burst of short prompts is written in one pass over
the weights rather than one pass each. Each call checks slots and positions against the cache
before it runs.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cuvil.artifact.files import ArtifactContents
from cuvil.dtypes import dtype_name, torch_dtype
from cuvil.runtime.model import CompiledModel, Direct
from cuvil.runtime.signature import InputBinder, InputError, Signature

STEP_INPUTS = ("input_ids", "slots", "positions")
# the generation config's ``prefill_positions``: the prefill graph's slots and positions are
# one per token (chunks of several prompts packed together), or one per row (an artifact
# without the entry is so)
PER_TOKEN, PER_ROW = "per_token", "per_row"
# the config entry holding the prefill plan's own backend entries (its kernel choices)
PREFILL_CHOICES = "prefill_kernel_choices"


# prefill lengths whose kernel choices a compile makes: up to the sidecar's default prefill chunk
PREFILL_CHOICE_TOKENS = 128
# past the small powers of two, ``extend`` pads chunks to multiples of this many tokens
PAD_STEP = 16
# decode row counts a warm-up prepares one by one (the CPU keeps native schedules for 32
# shapes a model); past them, steps are padded to a few counts (``decode_row_counts``)
WARM_ROW_COUNTS = 16
# row counts a decode step runs at, at most: within the native schedules a model keeps, with
# room for the thread-count probe's
DECODE_SHAPES = 30


def row_buckets(max_batch: int) -> list[int]:
    """Decode row counts whose kernel choices stand for all: powers of two, then max_batch."""
    buckets = [1 << power for power in range(max_batch.bit_length()) if 1 << power < max_batch]
    return [*buckets, max_batch]


def decode_row_counts(max_batch: int) -> list[int]:
    """The row counts a decode step runs at: every count up to ``WARM_ROW_COUNTS``, then a few
    evenly spaced in each doubling past it (20, 24, 28, 32, 40, 48, …: four while that keeps
    the counts within ``DECODE_SHAPES``, fewer for hundreds of slots) and ``max_batch``. A step
    with a count between them is padded up to the next, so a model with many slots runs a few
    prepared shapes (native schedules) rather than one per count; a pad row costs what a
    real row does (a step's time grows with its rows), so the counts stay close together."""
    counts = set(range(1, min(max_batch, WARM_ROW_COUNTS) + 1))
    doublings = max(0, (max_batch - 1) // WARM_ROW_COUNTS).bit_length()
    if doublings:
        per_doubling = max(1, min(4, (DECODE_SHAPES - WARM_ROW_COUNTS) // doublings))
        for doubling in range(doublings):
            size = WARM_ROW_COUNTS << doubling
            counts |= {size + size * k // per_doubling for k in range(1, per_doubling + 1)}
    return sorted({count for count in counts if count < max_batch} | {max_batch})


def prefill_buckets(max_seq: int, longest: int) -> list[int]:
    """Prefill lengths whose kernel choices stand for every chunk of up to ``longest`` tokens
    (a GEMM's choice holds for a power-of-two bucket of rows): the powers of two up to it (or
    ``max_seq``), and that length itself."""
    top = max(1, min(longest, max_seq))
    return sorted({1 << power for power in range(top.bit_length())} | {top})


def padded_lengths(max_seq: int, longest: int) -> list[int]:
    """The lengths ``extend`` pads a chunk of up to ``longest`` tokens to: the powers of two up
    to ``PAD_STEP``, then every multiple of it, and ``longest`` itself (a chunk pays for at most
    ``PAD_STEP - 1`` pad tokens past the smallest ones), each one shape with a native schedule
    after ``warm_up``."""
    top = max(1, min(longest, max_seq))
    small = {1 << power for power in range(PAD_STEP.bit_length()) if 1 << power <= top}
    return sorted(small | set(range(PAD_STEP, top + 1, PAD_STEP)) | {top})


def _prefill_contents(contents: ArtifactContents) -> ArtifactContents:
    """The prefill step as a model of its own over the same weights, with its own backend
    entries (kernel choices) from the artifact's config."""
    assert contents.prefill_graph is not None
    config = {
        "target": contents.config.get("target", "cpu"),
        **contents.config.get(PREFILL_CHOICES, {}),
    }
    return ArtifactContents(config, contents.prefill_graph, contents.weights)


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
        self.prefill_model = CompiledModel(_prefill_contents(contents))
        self.prefill_plan = self.prefill_model.plan
        self._prefill_binder = InputBinder(Signature.of_graph(contents.prefill_graph))
        self._decode_calls: dict[tuple[int, int], Direct] = {}  # (rows, threads) -> direct call
        self.cache_names = tuple(self.generation_config["cache_inputs"])
        for graph in (contents.graph, contents.prefill_graph):
            if tuple(graph.inputs) != (*STEP_INPUTS, *self.cache_names):
                raise ValueError(f"graph {graph.name} takes {list(graph.inputs)}, not a step")
        self.caches = self.layout.allocate(self.device)
        self._vocab_size = int(self.generation_config["vocab_size"])
        self._pad_lengths = padded_lengths(self.max_seq, PREFILL_CHOICE_TOKENS)
        self._row_counts = decode_row_counts(self.max_batch)
        self.packs_prompts = self.generation_config.get("prefill_positions") == PER_TOKEN

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
        tokens = self._check_chunk("prefill", slot, token_ids, position)
        rows = self._chunk_rows(slot, tokens, position)
        return self._run_chunk(*rows, token_ids.reshape(tokens))[0].float()

    def extend(self, slot: int, token_ids: torch.Tensor, position: int) -> None:
        """Write the cache of ``token_ids`` as ``prefill`` does, without logits: the chunk is
        padded (token 0) to the next of ``padded_lengths`` that fits the slot, so that every
        chunk length runs one of a few prepared shapes (native schedules, kernel choices made)
        instead of a shape of its own. The pad tokens' keys and values land past the chunk,
        where nothing reads them before the sequence's own later tokens overwrite them."""
        if self.packs_prompts:
            self.extend_many([(slot, token_ids, position)])
            return
        tokens = self._check_chunk("extend", slot, token_ids, position)
        room = self.max_seq - position
        padded = next((n for n in self._pad_lengths if tokens <= n <= room), tokens)
        ids = token_ids.to(torch.int64)
        if padded > tokens:
            ids = torch.cat([ids, ids.new_zeros(padded - tokens)])
        self._run_chunk(*self._chunk_rows(slot, padded, position), ids)

    def extend_many(self, chunks: Sequence[tuple[int, torch.Tensor, int]]) -> None:
        """``extend`` of (slot, token_ids, position) chunks, one per slot, their tokens packed
        together where the artifact's prefill takes a slot and position per token (one call
        each otherwise): calls of up to the longest of ``padded_lengths`` tokens, each padded
        to the next of them by tokens written after a chunk's end in its slot, as ``extend``
        pads one chunk, where nothing reads them before that sequence's own later tokens
        overwrite them."""
        if len({slot for slot, _, _ in chunks}) != len(chunks):
            raise InputError(f"extend_many takes one chunk per slot, not {[c[0] for c in chunks]}")
        if not self.packs_prompts:
            for slot, token_ids, position in chunks:
                self.extend(slot, token_ids, position)
            return
        ids, slots, positions = [], [], []
        for slot, token_ids, position in chunks:
            tokens = self._check_chunk("extend_many", slot, token_ids, position)
            ids.append(token_ids.reshape(tokens).to(torch.int64))
            slots.append(torch.full((tokens,), slot, dtype=torch.int64))
            positions.append(torch.arange(position, position + tokens, dtype=torch.int64))
        flat = torch.stack([torch.cat(ids), torch.cat(slots), torch.cat(positions)])
        longest = self._pad_lengths[-1]
        pads = self._pad_tokens(chunks, longest)
        for begin in range(0, flat.shape[1], longest):
            call = flat[:, begin : begin + longest]
            tokens = call.shape[1]
            padded = next(n for n in self._pad_lengths if n >= tokens)
            if padded > tokens and pads.shape[1] >= padded - tokens:
                call = torch.cat([call, pads[:, : padded - tokens]], dim=1)
            self._run_chunk(call[1], call[2], call[0])

    def _pad_tokens(
        self, chunks: Sequence[tuple[int, torch.Tensor, int]], wanted: int
    ) -> torch.Tensor:
        """Up to ``wanted`` pad tokens as [3, pads] (token 0, slot, position): the positions
        after each chunk's end in its slot, the last chunk's first, within ``max_seq``."""
        room: list[tuple[int, int, int]] = []
        for slot, token_ids, position in reversed(chunks):
            end = position + int(token_ids.numel())
            room += [(0, slot, after) for after in range(end, min(end + wanted, self.max_seq))]
            if len(room) >= wanted:
                break
        return torch.tensor(room[:wanted], dtype=torch.int64).reshape(-1, 3).T

    def _check_chunk(self, call: str, slot: int, token_ids: torch.Tensor, position: int) -> int:
        tokens = int(token_ids.numel())
        if token_ids.dim() != 1 or tokens < 1:
            raise InputError(f"{call} takes a non-empty 1-D token tensor, not {token_ids.shape}")
        self._check_slot(slot)
        self._check_span(position, tokens)
        return tokens

    def _chunk_rows(
        self, slot: int, tokens: int, position: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefill graph's ``slots`` and ``positions`` for one slot's chunk."""
        if self.packs_prompts:
            slots = torch.full((tokens,), slot, dtype=torch.int64)
            return slots, torch.arange(position, position + tokens, dtype=torch.int64)
        return torch.tensor([slot], dtype=torch.int64), torch.tensor([position], dtype=torch.int64)

    def _run_chunk(
        self, slots: torch.Tensor, positions: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """The prefill graph on a chunk: its last token's logits [1, vocab]."""
        inputs = self._step_inputs(ids.reshape(1, -1), slots, positions)
        symbols = self._prefill_binder.bind(inputs)
        with torch.inference_mode():
            return self.prefill_model.runner.run(inputs, symbols)["output"]

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
        ids = token_ids.reshape(rows, 1).to(torch.int64)
        slots = list(slots)
        pads = self._pad_rows(slots, starts)
        if pads:
            ids = torch.cat([ids, ids.new_zeros(len(pads), 1)])
            slots += [slot for slot, _ in pads]
            starts += [position for _, position in pads]
        rows_in = torch.tensor(slots, dtype=torch.int64)
        starts_in = torch.tensor(starts, dtype=torch.int64)
        key = (len(slots), torch.get_num_threads())
        direct = self._decode_calls.get(key)
        with torch.inference_mode():
            if direct is not None:  # this row count's whole plan as one native schedule
                logits = direct([ids, rows_in, starts_in, *self.caches])[0]
            else:
                inputs = self._step_inputs(ids, rows_in, starts_in)
                symbols = self._binder.bind(inputs)
                logits = self.runner.run(inputs, symbols)["output"]
                self._remember_decode(key, symbols)
        return (logits[:rows] if pads else logits).float()

    def _pad_rows(self, slots: list[int], starts: list[int]) -> list[tuple[int, int]]:
        """The (slot, position) of each pad row that brings a step up to the next of
        ``decode_row_counts``: the position after a real row's, in that row's slot. A pad row
        writes its keys and values there, which no token reads before the row's own next
        step overwrites them (the contract ``extend``'s pad tokens keep), and attends only
        within that slot, so the real rows' logits and caches are those of the step unpadded.
        No pad rows when the count is one of them, or when too few real rows have a position
        after theirs (all at ``max_seq - 1``): that step runs its own count."""
        wanted = self._run_count(len(slots)) - len(slots)
        if not wanted:
            return []
        room = [(slot, start + 1) for slot, start in zip(slots, starts, strict=True)]
        pads = [(slot, after) for slot, after in room if after < self.max_seq]
        return pads[:wanted] if len(pads) >= wanted else []

    def _remember_decode(self, key: tuple[int, int], symbols: dict[str, int]) -> None:
        """Keep the runner's direct call for this row count once it has one: later steps skip
        the signature check, whose outcome depends only on the row count."""
        offer = getattr(self.runner, "direct", None)
        if offer is None or key in self._decode_calls:
            return
        direct = offer(symbols, self._input_names, self._output_names)
        if direct is not None:
            self._decode_calls[key] = direct

    def release(self, slot: int) -> None:
        """Nothing to free: a slot's next sequence overwrites the positions it reads."""
        self._check_slot(slot)

    def copy_prefix(self, source: int, target: int, length: int) -> None:
        """Positions ``0..length-1`` of slot ``source``'s keys and values into slot
        ``target`` (``DecoderEngine``'s optional method); nothing to do when they are one
        slot, whose cache stays as written until a later call writes over it."""
        self._check_slot(source)
        self._check_slot(target)
        self._check_span(0, length)
        if source == target:
            return
        with torch.inference_mode():
            for cache in self.caches:  # [slots, kv_heads, max_seq, head_dim]
                cache[target, :, :length].copy_(cache[source, :, :length])

    # -- generation

    def generate(self, input_ids: torch.Tensor, **options: Any) -> torch.Tensor:
        """transformers' ``generate`` for greedy and sampled decoding (cuvil/generation/
        generate.py says what it takes and what it refuses). As transformers does, what a call
        leaves out comes from the source model's generation config: its end and pad tokens,
        and the sampling options it set (``sampling_defaults``: an instruct model's
        ``do_sample``, temperature, top-k, top-p, repetition penalty)."""
        from cuvil.generation.generate import generate

        defaults = {
            key: self.generation_config[key]
            for key in ("eos_token_id", "pad_token_id")
            if self.generation_config.get(key) is not None
        }
        defaults |= self.generation_config.get("sampling_defaults") or {}
        return generate(self, input_ids, **{**defaults, **options})

    def choose_kernels(self, prompt_tokens: int) -> dict[str, Any]:
        """Make the kernel choices a decode step meets at every row bucket (1, 2, 4, …,
        ``max_batch``) and a prefill meets at every length bucket up to
        ``PREFILL_CHOICE_TOKENS`` (the chunks a scheduler sends) and at ``prompt_tokens``, the
        backend's way, so generation runs at full speed from its first step whatever the
        prompts' lengths; returns the config entries that carry them, the prefill's under
        ``PREFILL_CHOICES`` (the graphs' node names overlap). The cache is zeroed after."""
        position = min(prompt_tokens, self.max_seq - 1)
        entries: dict[str, Any] = {}
        for rows in row_buckets(self.max_batch):
            inputs = self._step_inputs(
                torch.zeros(rows, 1, dtype=torch.int64),
                torch.arange(rows, dtype=torch.int64),
                torch.full((rows,), position, dtype=torch.int64),
            )
            entries = dict(self.backend.choose_kernels(self, inputs))
            self.config.update(entries)  # the next bucket's entry merges with these
        prefill: dict[str, Any] = {}
        lengths = set(prefill_buckets(self.max_seq, PREFILL_CHOICE_TOKENS))
        for tokens in sorted(lengths | {max(1, min(prompt_tokens, self.max_seq))}):
            prefill_inputs = self._step_inputs(
                torch.zeros(1, tokens, dtype=torch.int64), *self._chunk_rows(0, tokens, 0)
            )
            prefill = dict(self.backend.choose_kernels(self.prefill_model, prefill_inputs))
            self.prefill_model.config.update(prefill)  # the next length's entry merges
        entries[PREFILL_CHOICES] = prefill
        self.config[PREFILL_CHOICES] = prefill
        self.reset_cache()
        return entries

    def warm_up(self, prefill_tokens: int = PREFILL_CHOICE_TOKENS) -> int:
        """Prepare a decode step at every row count a step runs at (``decode_row_counts``:
        1, 2, …, 16, 20, 24, …, ``max_batch``), and a prefill at every length
        ``extend`` pads to up to ``prefill_tokens`` (``padded_lengths``) to run as it will
        serve (kernel choices made, native schedule built and checked), as a server does before
        it reports ready: a scheduler meets every row count as streams join and leave, and its
        first requests should not pay for building them. Returns the steps run; the cache is
        zeroed after."""
        steps = 0
        for rows in self._row_counts:
            steps += self._prepare_decode(rows)
        self._pad_lengths = padded_lengths(self.max_seq, prefill_tokens)
        for tokens in self._pad_lengths:
            ids = torch.zeros(1, tokens, dtype=torch.int64)
            slots, positions = self._chunk_rows(0, tokens, 0)
            steps += self.prefill_model.prepare(self._step_inputs(ids, slots, positions))
        self.reset_cache()
        return steps

    def step_seconds(self, rows: int, runs: int = 7) -> float:
        """The median wall time of a decode step of ``rows`` rows at the calling thread's
        thread count, the shape prepared first (kernel choices made, native schedule built) so
        that only the step is timed; what a server weighs when it decides how many threads
        its engine gets. The cache is zeroed after."""
        if not 1 <= rows <= self.max_batch:
            raise InputError(f"a decode step takes 1..{self.max_batch} rows, not {rows}")
        self._prepare_decode(rows)
        zeros = torch.zeros(rows, dtype=torch.int64)
        times = []
        for _ in range(runs):
            started = time.perf_counter()
            self.decode(list(range(rows)), zeros, zeros)
            times.append(time.perf_counter() - started)
        self.reset_cache()
        return sorted(times)[len(times) // 2]

    def _run_count(self, rows: int) -> int:
        """The row count a decode step of ``rows`` rows runs at (``decode_row_counts``)."""
        return self._row_counts[bisect.bisect_left(self._row_counts, rows)]

    def _prepare_decode(self, rows: int) -> int:
        """Prepare a decode step of ``rows`` rows (slots 0.., position 0), at the count it
        runs at, at the calling thread's thread count, and run it once, which keeps that
        count's direct call; returns the steps run. The cache is left written."""
        count = self._run_count(rows)
        zeros = torch.zeros(count, dtype=torch.int64)
        steps = self.prepare(self._step_inputs(zeros[:, None], torch.arange(count), zeros))
        self.decode(list(range(rows)), zeros[:rows], zeros[:rows])
        return steps + 1

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
