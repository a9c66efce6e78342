"""Compiled generation against transformers' ``generate`` on four decoder families: greedy
token for token (batch 1, a left-padded batch of mixed prompt lengths, an end token that stops
rows early, a repetition penalty), seeded sampling run to run, and the fusions the decode
graph keeps."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import cuvil
from cuvil.allowed_ops import op_problems
from cuvil.runtime.generation import GenerationModel
from tests.cuvil.generation.families import FAMILIES, VOCAB, build

MAX_SEQ = 64
NEW = 12


@pytest.fixture(scope="module")
def compiled() -> Iterator[dict[str, tuple[torch.nn.Module, GenerationModel]]]:
    cache: dict[str, tuple[torch.nn.Module, GenerationModel]] = {}
    yield cache


def _compiled(
    cache: dict[str, tuple[torch.nn.Module, GenerationModel]], family: str
) -> tuple[torch.nn.Module, GenerationModel]:
    if family not in cache:
        model = build(family)
        example = {"input_ids": _prompts(1, 7, seed=1)}
        generation = cuvil.jit(model, example, task="text-generation", max_batch=4, max_seq=MAX_SEQ)
        assert isinstance(generation, GenerationModel)
        cache[family] = (model, generation)
    return cache[family]


def _prompts(rows: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(6, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


def _left_padded(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Three prompts of 5, 7 and 9 tokens, padded on the left with token 0."""
    ids = _prompts(3, 9, seed)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[1, :2] = 0
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_batch_one_matches_transformers(compiled: dict, family: str) -> None:
    model, generation = _compiled(compiled, family)
    ids = _prompts(1, 11, seed=3)
    ours = generation.generate(ids, max_new_tokens=NEW, eos_token_id=None)
    theirs = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None)
    assert ours.shape == (1, 11 + NEW)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_left_padded_batch_matches_transformers(compiled: dict, family: str) -> None:
    model, generation = _compiled(compiled, family)
    ids, mask = _left_padded(seed=4)
    options = {"max_new_tokens": NEW, "pad_token_id": 0, "eos_token_id": None}
    ours = generation.generate(ids, attention_mask=mask, **options)
    theirs = model.generate(ids, attention_mask=mask, do_sample=False, **options)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("penalty", [1.6, 0.6])
def test_a_repetition_penalty_matches_transformers(
    compiled: dict, family: str, penalty: float
) -> None:
    """transformers' penalty over each row's own tokens (not its left pads), alone and in a
    padded batch; it changes what greedy picks."""
    model, generation = _compiled(compiled, family)
    ids, mask = _left_padded(seed=9)
    options = {"max_new_tokens": NEW, "pad_token_id": 0, "eos_token_id": None}
    plain = generation.generate(ids, attention_mask=mask, **options)
    ours = generation.generate(ids, attention_mask=mask, repetition_penalty=penalty, **options)
    theirs = model.generate(
        ids, attention_mask=mask, do_sample=False, repetition_penalty=penalty, **options
    )
    assert torch.equal(ours, theirs)
    assert not torch.equal(ours, plain)
    alone = generation.generate(ids[2:], max_new_tokens=NEW, repetition_penalty=penalty)
    single = model.generate(
        ids[2:], max_new_tokens=NEW, do_sample=False, repetition_penalty=penalty, pad_token_id=0
    )
    assert torch.equal(alone, single)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_an_end_token_stops_rows_and_pads_them_like_transformers(
    compiled: dict, family: str
) -> None:
    model, generation = _compiled(compiled, family)
    ids, mask = _left_padded(seed=5)
    free = generation.generate(ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=None)
    eos = int(free[0, 9 + 3])  # the fourth token row 0 generates: it stops there
    options = {"max_new_tokens": NEW, "pad_token_id": 0, "eos_token_id": eos}
    ours = generation.generate(ids, attention_mask=mask, **options)
    theirs = model.generate(ids, attention_mask=mask, do_sample=False, **options)
    assert torch.equal(ours, theirs)
    assert ours[0, 9 + 3] == eos and (ours[0, 9 + 4 :] == 0).all()


def test_seeded_sampling_repeats_and_a_row_draws_alike_alone_or_batched(compiled: dict) -> None:
    _, generation = _compiled(compiled, "llama")
    ids, mask = _left_padded(seed=6)
    options = {"do_sample": True, "temperature": 1.5, "top_k": 40, "top_p": 0.9, "seed": 7}
    first = generation.generate(ids, attention_mask=mask, max_new_tokens=16, **options)
    again = generation.generate(ids, attention_mask=mask, max_new_tokens=16, **options)
    other = generation.generate(
        ids, attention_mask=mask, max_new_tokens=16, **{**options, "seed": 8}
    )
    alone = generation.generate(ids[2:], max_new_tokens=16, **options)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    assert torch.equal(alone[0], first[2])


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_decode_graph_keeps_the_forward_fusions_and_the_allowlist(
    compiled: dict, family: str
) -> None:
    _, generation = _compiled(compiled, family)
    layers = generation.layout.layers
    for graph in (generation.graph, generation.contents.prefill_graph):
        assert graph is not None
        ops = graph.op_histogram()
        assert ops["cuvil.rope"] == 2 * layers  # queries and keys, at per-row positions
        assert ops["cuvil.rms_norm"] == 2 * layers + 1
        assert ops["cuvil.swiglu"] == layers
        assert ops["cuvil.cached_attention"] == layers
        assert ops["cuvil.kv_cache_write"] == 2 * layers
        assert not any("scaled_dot_product" in op for op in ops)
        assert op_problems(graph) == []
    batch = {symbol.name: symbol for symbol in generation.graph.symbols}["batch"]
    assert (batch.min, batch.max) == (1, 4)
    assert generation.layout.kv_heads == 2  # grouped-query: fewer KV heads than query heads


def test_gpt2_learned_positions_follow_the_row_offsets(compiled: dict) -> None:
    """GPT-2's position embeddings are looked up at each row's own positions: the graph
    indexes its position table with the positions input, and a padded row gets what it gets
    alone."""
    _, generation = _compiled(compiled, "gpt2")
    ids, mask = _left_padded(seed=9)
    batched = generation.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=None)
    alone = generation.generate(ids[:1, 4:], max_new_tokens=8, eos_token_id=None)
    assert torch.equal(batched[0, 9:], alone[0, 5:])
    embeddings = [n for n in generation.graph.nodes if n.op == "aten.embedding.default"]
    assert len(embeddings) == 2  # tokens and positions
