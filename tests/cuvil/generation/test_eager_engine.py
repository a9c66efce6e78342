"""EagerDecoderEngine against transformers' own ``generate``: same tokens, greedy, on a tiny
Llama with random weights; chunked prefill and batched decode change nothing."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2LMHeadModel, LlamaForCausalLM, PreTrainedModel

from cuvil.generation.eager_engine import EagerDecoderEngine
from cuvil.generation.sampling import SamplingParams, next_token
from tests.cuvil.generation import families


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return families.llama().eval()


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return families.gpt2().eval()


def run_alone(
    engine: EagerDecoderEngine,
    slot: int,
    prompt: list[int],
    new_tokens: int,
    chunk: int = 0,
    params: SamplingParams | None = None,
) -> list[int]:
    params = params or SamplingParams(max_new_tokens=new_tokens)
    generator = params.generator()
    chunk = chunk or len(prompt)
    for start in range(0, len(prompt), chunk):
        logits = engine.prefill(slot, torch.tensor(prompt[start : start + chunk]), start)
    tokens = [next_token(logits, params, generator)]
    while len(tokens) < new_tokens:
        position = torch.tensor([len(prompt) + len(tokens) - 1])
        logits = engine.decode([slot], torch.tensor([tokens[-1]]), position)[0]
        tokens.append(next_token(logits, params, generator))
    engine.release(slot)
    return tokens


def reference(model: PreTrainedModel, prompt: list[int], new_tokens: int) -> list[int]:
    output = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return output[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return tiny_llama()


PROMPTS = [[5, 17, 33], list(range(40, 63)), [200] * 9 + [3, 4]]


@pytest.mark.parametrize("build", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
def test_greedy_matches_transformers_generate(build: object) -> None:
    model = build()  # type: ignore[operator]
    engine = EagerDecoderEngine(model, max_batch=2, max_seq=64)
    for prompt in PROMPTS:
        assert run_alone(engine, 1, prompt, 16) == reference(model, prompt, 16)


def test_chunked_prefill_gives_the_same_tokens(model: LlamaForCausalLM) -> None:
    engine = EagerDecoderEngine(model, max_batch=1, max_seq=64)
    prompt = PROMPTS[1]
    assert run_alone(engine, 0, prompt, 10, chunk=4) == run_alone(engine, 0, prompt, 10)


def test_batched_decode_matches_each_slot_alone(model: LlamaForCausalLM) -> None:
    engine = EagerDecoderEngine(model, max_batch=4, max_seq=64)
    alone = [run_alone(engine, 0, prompt, 8) for prompt in PROMPTS]
    slots = [3, 0, 2]
    last = []
    for slot, prompt in zip(slots, PROMPTS, strict=True):
        last.append(int(torch.argmax(engine.prefill(slot, torch.tensor(prompt), 0))))
    tokens = [[token] for token in last]
    for step in range(7):
        positions = torch.tensor([len(p) + step for p in PROMPTS])
        logits = engine.decode(slots, torch.tensor([t[-1] for t in tokens]), positions)
        for row, generated in enumerate(tokens):
            generated.append(int(torch.argmax(logits[row])))
    assert tokens == alone


def test_seeded_sampling_repeats(model: LlamaForCausalLM) -> None:
    engine = EagerDecoderEngine(model, max_batch=1, max_seq=64)
    params = SamplingParams(max_new_tokens=12, do_sample=True, temperature=0.9, top_k=20, seed=7)
    first = run_alone(engine, 0, PROMPTS[0], 12, params=params)
    assert run_alone(engine, 0, PROMPTS[0], 12, params=params) == first
    other = SamplingParams(max_new_tokens=12, do_sample=True, temperature=0.9, top_k=20, seed=8)
    assert run_alone(engine, 0, PROMPTS[0], 12, params=other) != first


def test_kv_bytes_per_token_counts_every_layer(model: LlamaForCausalLM) -> None:
    engine = EagerDecoderEngine(model, max_batch=2, max_seq=32)
    head_dim = 64 // 4
    assert engine.kv_bytes_per_token == 2 * 2 * 2 * head_dim * 4  # layers, k+v, kv heads, fp32
    assert engine.vocab_size == 256


def test_positions_outside_the_slot_are_refused(model: LlamaForCausalLM) -> None:
    engine = EagerDecoderEngine(model, max_batch=1, max_seq=8)
    with pytest.raises(ValueError, match="max_seq"):
        engine.prefill(0, torch.arange(9), 0)
    engine.prefill(0, torch.arange(3), 0)
    with pytest.raises(ValueError, match="holds 3"):
        engine.decode([0], torch.tensor([1]), torch.tensor([5]))
