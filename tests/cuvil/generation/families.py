"""Small decoder LLMs of four families from configs, with random weights (no downloads)."""

from __future__ import annotations

from collections.abc import Callable

import torch

import cuvil
from cuvil.runtime.generation import GenerationModel

VOCAB = 256


def llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(config)


def qwen2() -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        eos_token_id=3,
        tie_word_embeddings=True,
    )
    return Qwen2ForCausalLM(config)


def mistral() -> torch.nn.Module:
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        sliding_window=128,
    )
    return MistralForCausalLM(config)


def gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_embd=64,
        n_layer=2,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=256,
        bos_token_id=4,
        eos_token_id=5,
    )
    return GPT2LMHeadModel(config)


FAMILIES: dict[str, Callable[[], torch.nn.Module]] = {
    "llama": llama,
    "qwen2": qwen2,
    "mistral": mistral,
    "gpt2": gpt2,
}


def build(family: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = FAMILIES[family]()
    with torch.no_grad():  # larger weights than the init's: logits far apart, greedy decided
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0.0, 0.15)
    return model.eval()


def warmed_generation(model: torch.nn.Module, max_batch: int, max_seq: int) -> GenerationModel:
    """``model`` compiled for generation and warmed up for prefill chunks of up to 16 tokens."""
    example = {"input_ids": torch.randint(0, VOCAB, (1, 6))}
    compiled = cuvil.jit(
        model, example, task="text-generation", max_batch=max_batch, max_seq=max_seq
    )
    assert isinstance(compiled, GenerationModel)
    compiled.warm_up(prefill_tokens=16)
    return compiled
