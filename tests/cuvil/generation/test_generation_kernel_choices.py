"""A generation compile with two slots (the rows of a decode step then equal the cache's slots
in the export example) and its kernel choices made at compile time: every decode row bucket
and the example prompt's prefill, carried in the artifact and taken on load, so no step of a
loaded model times candidates."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import cuvil
from cuvil.backends.cpu.kernel_choices import CONFIG_KEY, cpu_family
from cuvil.runtime.generation import (
    PREFILL_CHOICES,
    GenerationModel,
    padded_lengths,
    prefill_buckets,
    row_buckets,
)
from cuvil.runtime.signature import InputError
from tests.cuvil.generation.families import VOCAB, build

PROMPT = 7


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return build("llama")


@pytest.fixture(scope="module")
def generation(model: torch.nn.Module) -> GenerationModel:
    example = {"input_ids": _ids(1, PROMPT, seed=0)}
    compiled = cuvil.jit(
        model, example, task="text-generation", max_batch=2, max_seq=32, choose_kernels=True
    )
    assert isinstance(compiled, GenerationModel)
    return compiled


def _ids(rows: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(6, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


def test_row_buckets_are_powers_of_two_then_max_batch() -> None:
    assert row_buckets(1) == [1]
    assert row_buckets(2) == [1, 2]
    assert row_buckets(6) == [1, 2, 4, 6]
    assert row_buckets(16) == [1, 2, 4, 8, 16]


def test_prefill_buckets_are_powers_of_two_then_the_longest_chunk() -> None:
    assert prefill_buckets(32, 128) == [1, 2, 4, 8, 16, 32]
    assert prefill_buckets(4096, 100) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert prefill_buckets(5, 9) == [1, 2, 4, 5]


def test_padded_lengths_are_small_powers_of_two_then_multiples_of_sixteen() -> None:
    assert padded_lengths(4096, 128) == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 112, 128]
    assert padded_lengths(4096, 40) == [1, 2, 4, 8, 16, 32, 40]
    assert padded_lengths(24, 128) == [1, 2, 4, 8, 16, 24]
    assert padded_lengths(5, 9) == [1, 2, 4, 5]


def test_two_slots_compile_and_generate_as_transformers(
    generation: GenerationModel, model: torch.nn.Module
) -> None:
    assert [symbol.name for symbol in generation.graph.symbols] == ["batch"]
    ids = _ids(2, 6, seed=1)
    ours = generation.generate(ids, max_new_tokens=6, eos_token_id=None)
    theirs = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None)
    assert torch.equal(ours, theirs)
    caches = dict(zip(generation.cache_names, generation.caches, strict=True))
    mismatched = {
        "input_ids": torch.zeros(2, 1, dtype=torch.int64),
        "slots": torch.zeros(1, dtype=torch.int64),
        "positions": torch.zeros(2, dtype=torch.int64),
        **caches,
    }
    with pytest.raises(InputError):  # the rows of one Dim must agree
        generation.run(mismatched)


def test_choices_for_every_bucket_are_carried_and_taken_on_load(
    generation: GenerationModel, tmp_path: Path
) -> None:
    family = cpu_family()
    decode = generation.config[CONFIG_KEY][family]
    prefill = generation.config[PREFILL_CHOICES][CONFIG_KEY][family]
    assert decode and prefill
    assert all(set(buckets) == {"1", "2"} for buckets in decode.values())
    assert any("8" in buckets for buckets in prefill.values())  # the 7-token prompt's bucket
    assert any("32" in buckets for buckets in prefill.values())  # a chunk of up to max_seq
    loaded = cuvil.load(generation.save(tmp_path / "llama.cuvil"))
    assert isinstance(loaded, GenerationModel)
    assert loaded.execution()["tactics_from_artifact"]
    assert loaded.prefill_model.execution()["tactics_from_artifact"]
    loaded.generate(_ids(2, PROMPT, seed=2), max_new_tokens=4, eos_token_id=None)
    loaded.prefill(0, _ids(1, 21, seed=3)[0], 0)  # a prompt of another length: its bucket is made
    assert not loaded.plan.kernel_trials()  # no decode step timed a candidate
    assert not loaded.prefill_plan.kernel_trials()


def test_warm_up_makes_every_row_count_and_prefill_bucket_run_as_it_serves(
    generation: GenerationModel, model: torch.nn.Module
) -> None:
    assert generation.warm_up(prefill_tokens=16) >= 2 + 5  # each row count, each length
    assert set(generation._decode_calls) >= {
        (1, torch.get_num_threads()),
        (2, torch.get_num_threads()),
    }
    shapes = generation.prefill_model.execution()["plan_loop"]["shapes"]
    threads = torch.get_num_threads()
    assert all(f"seq={n} threads={threads}" in shapes for n in (1, 2, 4, 8, 16))
    assert all(c.abs().sum() == 0 for c in generation.caches)  # nothing left in the cache
    ids = _ids(1, 6, seed=4)
    ours = generation.generate(ids, max_new_tokens=5, eos_token_id=None)
    assert torch.equal(
        ours, model.generate(ids, max_new_tokens=5, do_sample=False, eos_token_id=None)
    )


def test_extended_prompts_run_prepared_shapes_and_decode_their_last_token_as_prefill_does(
    generation: GenerationModel, model: torch.nn.Module
) -> None:
    """A prompt's all-but-last tokens written with ``extend`` (padded to a warmed length) and its
    last token decoded give the logits prefill gives, and greedy tokens equal transformers';
    chunk lengths of their own add no prefill shape. Pads past the chunk are never read."""
    generation.warm_up(prefill_tokens=16)
    runner = generation.prefill_model.runner
    prompt = _ids(1, 12, seed=6)[0]
    generation.reset_cache()
    whole = generation.prefill(0, prompt, 0)  # its own length, 12
    generation.reset_cache()
    shapes = len(runner._shapes)
    generation.extend(1, prompt[:5], 0)  # padded to 8
    generation.extend(1, prompt[5:11], 5)  # padded to 8: positions 11, 12 get pads
    logits = generation.decode([1], prompt[11:], torch.tensor([11]))
    torch.testing.assert_close(logits[0], whole, atol=1e-4, rtol=1e-4)
    tokens = [int(logits[0].argmax())]
    for step in range(4):  # greedy, each step over the pads' positions
        logits = generation.decode([1], torch.tensor(tokens[-1:]), torch.tensor([12 + step]))
        tokens.append(int(logits[0].argmax()))
    expected = model.generate(prompt[None], max_new_tokens=5, do_sample=False, eos_token_id=None)[
        0, 12:
    ]
    assert tokens == expected.tolist()
    assert len(runner._shapes) == shapes  # 5 and 6 tokens ran the 8-token schedule
    with pytest.raises(InputError, match="do not fit"):
        generation.extend(0, prompt, 32 - 4)
    generation.extend(0, prompt[:3], 32 - 3)  # no room to pad: the exact length runs
    generation.reset_cache()
