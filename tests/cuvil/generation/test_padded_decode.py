"""Decode steps past 16 rows run at a few prepared row counts: a step between them is padded
with rows that write only positions no token has read yet, and its real rows get the logits
and cache writes of the step unpadded."""

from __future__ import annotations

import itertools

import pytest
import torch

from cuvil.runtime.generation import DECODE_SHAPES, GenerationModel, decode_row_counts
from tests.cuvil.generation.families import VOCAB, build, warmed_generation

MAX_BATCH, MAX_SEQ = 20, 24
ROWS = 17  # between the prepared counts 16 and 20


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build("llama").eval()


@pytest.fixture(scope="module")
def generation(model: torch.nn.Module) -> GenerationModel:
    return warmed_generation(model, MAX_BATCH, MAX_SEQ)


def _prompt(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


def test_row_counts_are_every_count_to_16_then_a_few_per_doubling() -> None:
    assert decode_row_counts(1) == [1]
    assert decode_row_counts(16) == list(range(1, 17))
    assert decode_row_counts(20) == [*range(1, 17), 20]
    assert decode_row_counts(64) == [*range(1, 17), 20, 24, 28, 32, 40, 48, 56, 64]
    assert decode_row_counts(100)[-4:] == [64, 80, 96, 100]
    for max_batch in (256, 512, 4096):
        counts = decode_row_counts(max_batch)
        assert len(counts) <= DECODE_SHAPES and counts[-1] == max_batch
        gaps = [b / a for a, b in itertools.pairwise(counts[15:])]
        assert max(gaps) <= 2


def test_a_padded_step_gives_each_row_its_own_logits_and_writes_only_past_it(
    generation: GenerationModel, model: torch.nn.Module
) -> None:
    prepared = set(generation._decode_calls)
    assert (MAX_BATCH, torch.get_num_threads()) in prepared
    slots = list(range(MAX_BATCH - 1, MAX_BATCH - 1 - ROWS, -1))  # any slots, any order
    prompts = [_prompt(3 + row % 7, seed=row) for row in range(ROWS)]
    for slot, prompt in zip(slots, prompts, strict=True):
        generation.prefill(slot, prompt, 0)
    before = [cache.clone() for cache in generation.caches]
    tokens = torch.randint(0, VOCAB, (ROWS,), generator=torch.Generator().manual_seed(99))
    positions = torch.tensor([len(prompt) for prompt in prompts])

    logits = generation.decode(slots, tokens, positions)

    assert logits.shape == (ROWS, VOCAB)
    with torch.no_grad():
        for row, prompt in enumerate(prompts):
            sequence = torch.cat([prompt, tokens[row : row + 1]])[None]
            expected = model(input_ids=sequence).logits[0, -1]
            torch.testing.assert_close(logits[row], expected, rtol=1e-4, atol=1e-4)
    written = {(slot, int(p)) for slot, p in zip(slots, positions, strict=True)}
    allowed = written | {(slot, position + 1) for slot, position in written}
    for old, new in zip(before, generation.caches, strict=True):
        changed = (old != new).any(dim=-1).any(dim=1)  # [slot, position]
        places = {(int(s), int(p)) for s, p in changed.nonzero().tolist()}
        assert written <= places <= allowed
    assert set(generation._decode_calls) == prepared  # no shape of 17 rows was made


def test_greedy_generation_of_a_batch_between_counts_matches_transformers(
    generation: GenerationModel, model: torch.nn.Module
) -> None:
    ids = torch.stack([_prompt(5, seed=50 + row) for row in range(18)])
    ours = generation.generate(ids, max_new_tokens=8, eos_token_id=None)
    theirs = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert torch.equal(ours, theirs)


def test_rows_at_the_last_position_run_unpadded(
    generation: GenerationModel, model: torch.nn.Module
) -> None:
    """No position follows theirs to pad into: the step runs its own row count."""
    prompts = [_prompt(MAX_SEQ - 1, seed=200 + row) for row in range(ROWS)]
    for slot, prompt in enumerate(prompts):
        generation.prefill(slot, prompt, 0)
    tokens = torch.full((ROWS,), 7)
    logits = generation.decode(list(range(ROWS)), tokens, torch.full((ROWS,), MAX_SEQ - 1))
    with torch.no_grad():
        for row in (0, ROWS - 1):
            sequence = torch.cat([prompts[row], tokens[:1]])[None]
            expected = model(input_ids=sequence).logits[0, -1]
            torch.testing.assert_close(logits[row], expected, rtol=1e-4, atol=1e-4)
