"""Prompts packed into one prefill call: the prefill graph takes a slot and a position per
token, so chunks of several prompts are written together, each token attending over its own
slot up to its own position, padded to a prepared length by tokens past a chunk's end."""

from __future__ import annotations

import pytest
import torch

from cuvil.generation import compile as generation_compile
from cuvil.generation.step import DecoderStep
from cuvil.runtime.generation import PER_ROW, PER_TOKEN, GenerationModel
from tests.cuvil.generation.families import VOCAB, build, warmed_generation

MAX_BATCH, MAX_SEQ = 4, 48


def _compiled(model: torch.nn.Module) -> GenerationModel:
    return warmed_generation(model, MAX_BATCH, MAX_SEQ)


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def family(request: pytest.FixtureRequest) -> tuple[torch.nn.Module, GenerationModel]:
    torch.manual_seed(0)
    model = build(request.param).eval()
    return model, _compiled(model)


def _prompt(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


def _expected(model: torch.nn.Module, sequence: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=sequence[None]).logits[0, -1]


def test_packed_chunks_give_each_prompt_its_own_logits(
    family: tuple[torch.nn.Module, GenerationModel],
) -> None:
    model, compiled = family
    assert compiled.packs_prompts and compiled.config["generation"]["prefill_positions"]
    compiled.reset_cache()
    prompts = {2: _prompt(9, 1), 0: _prompt(12, 2), 3: _prompt(2, 3)}
    compiled.extend(0, prompts[0][:5], 0)  # slot 0's prompt arrives in two chunks
    chunks = [(2, prompts[2][:-1], 0), (0, prompts[0][5:-1], 5), (3, prompts[3][:-1], 0)]
    before = [cache.clone() for cache in compiled.caches]

    compiled.extend_many(chunks)

    slots = list(prompts)
    last = torch.stack([prompts[slot][-1] for slot in slots])
    positions = torch.tensor([len(prompts[slot]) - 1 for slot in slots])
    logits = compiled.decode(slots, last, positions)
    for row, slot in enumerate(slots):
        expected = _expected(model, prompts[slot])
        torch.testing.assert_close(logits[row], expected, rtol=1e-4, atol=1e-4)
    # the packed call wrote each chunk's positions and, as pads, only positions past a chunk
    written = {(slot, p) for slot, ids, start in chunks for p in range(start, start + len(ids))}
    for old, new in zip(before, compiled.caches, strict=True):
        changed = (old[:, :, : MAX_SEQ - 1] != new[:, :, : MAX_SEQ - 1]).any(dim=-1).any(dim=1)
        places = {(int(s), int(p)) for s, p in changed.nonzero().tolist()}
        assert written <= places
        ends = {slot: start + len(ids) for slot, ids, start in chunks}
        assert all(slot in ends and p >= ends[slot] for slot, p in places - written)


def test_packed_calls_run_only_prepared_lengths(
    family: tuple[torch.nn.Module, GenerationModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, compiled = family
    compiled.reset_cache()
    lengths: list[int] = []
    run_chunk = compiled._run_chunk

    def recording(slots: torch.Tensor, positions: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        assert slots.shape == positions.shape == (ids.numel(),)
        lengths.append(ids.numel())
        return run_chunk(slots, positions, ids)

    monkeypatch.setattr(compiled, "_run_chunk", recording)
    chunks = [(slot, _prompt(n, slot), 0) for slot, n in enumerate((7, 11, 3, 20))]

    compiled.extend_many(chunks)  # 41 tokens: calls of 16, 16 and 9 padded to 16

    assert lengths == [16, 16, 16]
    with pytest.raises(ValueError, match="one chunk per slot"):
        compiled.extend_many([(1, _prompt(2, 0), 0), (1, _prompt(2, 1), 2)])


def test_an_artifact_with_a_prefill_per_row_still_extends_and_generates(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Artifacts compiled before prefill took a position per token: their prefill graph takes
    one slot and position per row, and extend_many writes their chunks one call each."""
    monkeypatch.setattr(
        generation_compile, "DecoderStep", lambda model, per_token=False: DecoderStep(model)
    )
    torch.manual_seed(0)
    model = build("llama").eval()
    compiled = _compiled(model)
    assert compiled.config["generation"]["prefill_positions"] == PER_ROW != PER_TOKEN
    assert not compiled.packs_prompts
    prompts = {1: _prompt(6, 4), 2: _prompt(10, 5)}

    compiled.extend_many([(slot, prompt[:-1], 0) for slot, prompt in prompts.items()])

    last = torch.stack([prompt[-1] for prompt in prompts.values()])
    positions = torch.tensor([len(prompt) - 1 for prompt in prompts.values()])
    logits = compiled.decode(list(prompts), last, positions)
    for row, prompt in enumerate(prompts.values()):
        torch.testing.assert_close(logits[row], _expected(model, prompt), rtol=1e-4, atol=1e-4)
    compiled.reset_cache()
    ids = torch.stack([_prompt(5, 6), _prompt(5, 7)])
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None)
    assert torch.equal(compiled.generate(ids, max_new_tokens=6, eos_token_id=None), expected)
