"""Generation compiled with ``precision="bf16"``: bf16 weights for the GEMMs, a bf16 KV cache,
logits within bf16's error budget of the fp32 model's at every step, seeded sampling the same
run to run. Greedy tokens are not compared with fp32 eager: bf16's rounding may flip a close
argmax after a few steps, and from there the sequences differ by design."""

from __future__ import annotations

import pytest
import torch

import cuvil
from cuvil.precisions import precision
from cuvil.runtime.generation import GenerationModel
from tests.cuvil.generation.families import VOCAB, build

MAX_SEQ = 48
STEPS = 8


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return build("llama")


@pytest.fixture(scope="module")
def generation(model: torch.nn.Module) -> GenerationModel:
    example = {"input_ids": _ids(6, seed=0)[None]}
    compiled = cuvil.jit(
        model, example, task="text-generation", max_batch=4, max_seq=MAX_SEQ, precision="bf16"
    )
    assert isinstance(compiled, GenerationModel)
    return compiled


def _ids(length: int, seed: int) -> torch.Tensor:
    return torch.randint(6, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).abs().max() / expected.abs().max())


def test_the_gemm_weights_and_the_cache_are_bf16(generation: GenerationModel) -> None:
    assert generation.config["precision"] == "bf16"
    assert generation.config["report"]["fusions"].get("bf16_weights", 0) > 0
    dtypes = {tensor.dtype for tensor in generation.contents.weights.values()}
    assert torch.bfloat16 in dtypes
    assert {cache.dtype for cache in generation.caches} == {torch.bfloat16}
    assert generation.config["generation"]["kv_cache"]["dtype"] == "bf16"
    layout = generation.layout
    keys_and_values = 2 * layout.layers * layout.kv_heads * layout.head_dim
    assert generation.config["generation"]["kv_bytes_per_token"] == keys_and_values * 2


def test_logits_stay_within_the_bf16_budget_step_by_step(
    generation: GenerationModel, model: torch.nn.Module
) -> None:
    """Prefill, then decode on the fp32 model's own greedy tokens (teacher forcing), each step's
    logits against the fp32 model's full forward over the same sequence."""
    budget = precision("bf16").budget
    sequence = _ids(9, seed=1)
    errors = []
    with torch.no_grad():
        logits = generation.prefill(1, sequence, 0)
        for _ in range(STEPS):
            expected = model(input_ids=sequence[None]).logits[0, -1]
            errors.append(_relative(logits, expected))
            token = expected.argmax().reshape(1)
            position = torch.tensor([sequence.numel()])
            sequence = torch.cat([sequence, token])
            logits = generation.decode([1], token, position)[0]
    assert max(errors) <= budget, errors
    assert max(errors) > 1e-5  # the weights really are bf16: fp32 would agree to ~1e-6


def test_seeded_sampling_is_reproducible(generation: GenerationModel) -> None:
    ids = torch.stack([_ids(7, seed=2), _ids(7, seed=3)])
    options = {"max_new_tokens": 10, "do_sample": True, "top_k": 20, "seed": 5}
    first = generation.generate(ids, **options, eos_token_id=None)
    again = generation.generate(ids, **options, eos_token_id=None)
    other = generation.generate(ids, **{**options, "seed": 6}, eos_token_id=None)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
