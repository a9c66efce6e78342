"""Tiny transformers checkpoints for the generation tests: a Llama from a config with random
weights (fixed seed) saved as safetensors, with or without a byte-level BPE ``tokenizer.json``
trained here on a few sentences. Nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 320
EOS = 2


def tiny_llama_checkpoint(
    folder: Path, *, tokenizer: bool, seed: int = 0, chat_template: str | None = None
) -> Path:
    """``chat_template``: written into ``tokenizer_config.json`` with the BOS and EOS tokens'
    names, as a Hugging Face tokenizer saves them."""
    import json

    from transformers import LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=EOS,
    )
    LlamaForCausalLM(config).eval().save_pretrained(folder)
    if tokenizer:
        train_tokenizer().save(str(folder / "tokenizer.json"))
    if chat_template is not None:
        config = {"chat_template": chat_template, "bos_token": "<s>", "eos_token": "</s>"}
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def train_tokenizer() -> object:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["the quick brown fox jumps over the lazy dog"] * 20 + ["héllo wörld ✓"] * 5
    tokenizer.train_from_iterator(corpus, trainer)
    return tokenizer
