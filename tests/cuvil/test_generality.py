"""Generality: models built from other transformers configs (vision and text, encoders and
decoders) compile with the full pass pipeline and match eager fp32 at several shapes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import transformers as tf

import cuvil
from cuvil.verify import compare_output

TOLERANCE = 1e-4
batch = cuvil.Dim("batch", min=1, max=8)
seq = cuvil.Dim("seq", min=2, max=64)


def _text(vocab: int) -> Callable[[int, int], dict[str, torch.Tensor]]:
    def make(b: int, s: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.randint(0, vocab, (b, s))}

    return make


def _image(size: int, channels: int = 3) -> Callable[[int, int], dict[str, torch.Tensor]]:
    def make(b: int, s: int) -> dict[str, torch.Tensor]:
        return {"pixel_values": torch.randn(b, channels, size, size)}

    return make


def _text_with_padding(vocab: int) -> Callable[[int, int], dict[str, torch.Tensor]]:
    def make(b: int, s: int) -> dict[str, torch.Tensor]:
        mask = torch.ones(b, s, dtype=torch.int64)
        mask[0, -2:] = 0  # the first sequence is padded: the mask reaches attention
        return {"input_ids": torch.randint(0, vocab, (b, s)), "attention_mask": mask}

    return make


TEXT_SHAPES = {"input_ids": {0: batch, 1: seq}}
PADDED_TEXT_SHAPES = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}}
SMALL = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 128,
}
IMAGE_SHAPES = {"pixel_values": {0: batch}}


def bert_eager() -> Any:
    config = tf.BertConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=500,
    )
    return tf.BertModel._from_config(config, attn_implementation="eager")


def gpt2() -> Any:
    return tf.GPT2Model(
        tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=500, use_cache=False)
    )


def qwen2() -> Any:
    config = tf.Qwen2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=500,
        use_cache=False,
    )
    return tf.Qwen2ForCausalLM(config)


def vit() -> Any:
    config = tf.ViTConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        image_size=32,
        patch_size=8,
    )
    return tf.ViTModel(config)


def convnext() -> Any:
    return tf.ConvNextModel(tf.ConvNextConfig(hidden_sizes=[16, 32], depths=[1, 1], num_stages=2))


def resnet_basic() -> Any:
    config = tf.ResNetConfig(
        hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic", embedding_size=16
    )
    return tf.ResNetModel(config)


def mobilenet_v2() -> Any:
    return tf.MobileNetV2Model(tf.MobileNetV2Config(depth_multiplier=0.35, image_size=64))


def distilbert() -> Any:
    config = tf.DistilBertConfig(dim=64, n_layers=2, n_heads=4, hidden_dim=128, vocab_size=500)
    return tf.DistilBertModel(config)


def t5_encoder() -> Any:
    config = tf.T5Config(d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16, vocab_size=500)
    return tf.T5EncoderModel(config)


def deberta_v2() -> Any:
    return tf.DebertaV2Model(tf.DebertaV2Config(vocab_size=500, **SMALL))


def phi() -> Any:
    return tf.PhiForCausalLM(tf.PhiConfig(vocab_size=500, use_cache=False, **SMALL))


def bloom() -> Any:
    """ALiBi attention written with baddbmm over [batch*heads] rows; Bloom's tanh GELU."""
    config = tf.BloomConfig(hidden_size=64, n_layer=2, n_head=4, vocab_size=500, use_cache=False)
    return tf.BloomModel(config)


def mpt() -> Any:
    """ALiBi added to the scaled scores, then the causal mask filled in with the dtype's min."""
    return tf.MptModel(tf.MptConfig(d_model=64, n_layers=2, n_heads=4, vocab_size=500))


def falcon_alibi() -> Any:
    """Linears written ``x @ W.T + b`` (FalconLinear), ALiBi as an attention mask."""
    config = tf.FalconConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=500,
        alibi=True,
        new_decoder_architecture=False,
        multi_query=False,
        parallel_attn=True,
        bias=True,
        use_cache=False,
    )
    return tf.FalconModel(config)


def swin() -> Any:
    config = tf.SwinConfig(
        image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4
    )
    return tf.SwinModel(config)


def segformer() -> Any:
    config = tf.SegformerConfig(
        num_encoder_blocks=2,
        depths=[1, 1],
        sr_ratios=[2, 1],
        hidden_sizes=[16, 32],
        num_attention_heads=[1, 2],
        patch_sizes=[7, 3],
        strides=[4, 2],
        mlp_ratios=[2, 2],
    )
    return tf.SegformerModel(config)


def gemma2() -> Any:
    """Sliding-window and full attention in one model; with a padding mask its two mask chains
    share shape-only values after CSE (the executor once freed one too early)."""
    config = tf.Gemma2Config(
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=8,
        vocab_size=500,
        use_cache=False,
        **SMALL,
    )
    return tf.Gemma2ForCausalLM(config)


def mixtral() -> Any:
    """Mixture of experts: transformers' default grouped_mm experts export as an opaque custom
    op; Cuvil exports them as batched_mm (aten ops) and puts the setting back."""
    config = tf.MixtralConfig(
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=500,
        use_cache=False,
        **SMALL,
    )
    return tf.MixtralForCausalLM(config)


def wav2vec2() -> Any:
    config = tf.Wav2Vec2Config(
        conv_dim=(32, 32, 32),
        conv_stride=(5, 2, 2),
        conv_kernel=(10, 3, 3),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
        vocab_size=32,
        **SMALL,
    )
    return tf.Wav2Vec2Model(config)


# torch.export can only keep the conv stack's length dynamic as a derived dim (it suggests it)
samples = cuvil.Dim("samples", min=21, max=200)
AUDIO_SHAPES = {"input_values": {0: batch, 1: 20 * samples - 4}}


def _audio(b: int, s: int) -> dict[str, torch.Tensor]:
    return {"input_values": torch.randn(b, 20 * (21 + s) - 4)}


Factory = Callable[[], Any]
Inputs = Callable[[int, int], dict[str, torch.Tensor]]
MODELS: dict[str, tuple[Factory, Inputs, dict]] = {
    "bert_eager_attention": (bert_eager, _text(500), TEXT_SHAPES),
    "gpt2": (gpt2, _text(500), TEXT_SHAPES),
    "qwen2_gqa": (qwen2, _text(500), TEXT_SHAPES),
    "vit": (vit, _image(32), IMAGE_SHAPES),
    "convnext": (convnext, _image(64), IMAGE_SHAPES),
    "resnet18_basic": (resnet_basic, _image(64), IMAGE_SHAPES),
    "mobilenet_v2": (mobilenet_v2, _image(64), IMAGE_SHAPES),
    "distilbert_padded": (distilbert, _text_with_padding(500), PADDED_TEXT_SHAPES),
    "t5_encoder": (t5_encoder, _text(500), TEXT_SHAPES),
    "deberta_v2": (deberta_v2, _text(500), TEXT_SHAPES),
    "phi_partial_rotary": (phi, _text(500), TEXT_SHAPES),
    "swin_windows": (swin, _image(32), IMAGE_SHAPES),
    "segformer": (segformer, _image(64), IMAGE_SHAPES),
    "gemma2_padded_sliding_window": (gemma2, _text_with_padding(500), PADDED_TEXT_SHAPES),
    "wav2vec2_derived_dim": (wav2vec2, _audio, AUDIO_SHAPES),
    "mixtral_experts": (mixtral, _text(500), TEXT_SHAPES),
    "bloom_alibi_baddbmm": (bloom, _text(500), TEXT_SHAPES),
    "mpt_alibi_filled": (mpt, _text(500), TEXT_SHAPES),
    "falcon_alibi_matmul_linears": (falcon_alibi, _text(500), TEXT_SHAPES),
}
# The rules each family is built to exercise: they must fire on it.
EXPECTED_RULES = {
    "bloom_alibi_baddbmm": ("attention_alibi", "gelu_tanh", "linear_act"),
    "mpt_alibi_filled": ("attention_filled",),
    "falcon_alibi_matmul_linears": ("matmul_as_linear", "linear_bias_add", "linear_act"),
    "swin_windows": ("attention",),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_model_family_matches_eager(name: str) -> None:
    make_model, make_inputs, shapes = MODELS[name]
    torch.manual_seed(0)
    model = make_model().eval()
    experts = getattr(getattr(model, "config", None), "_experts_implementation", None)
    compiled = cuvil.jit(model, make_inputs(2, 8), dynamic_shapes=shapes, name=name)
    assert getattr(getattr(model, "config", None), "_experts_implementation", None) == experts
    assert compiled.report["verification"]["max_relative_to_scale"] <= TOLERANCE
    assert compiled.report["bisection"] is None  # every pass kept: none had to be dropped
    passes = compiled.report["passes"]
    assert passes[-1]["ops_after"] <= passes[0]["ops_before"], name  # no model grows
    fired = compiled.report["fusions"]
    assert all(fired.get(rule) for rule in EXPECTED_RULES.get(name, ())), (name, fired)
    for b, s in ((1, 5), (3, 17)):
        inputs = make_inputs(b, s)
        with torch.no_grad():
            expected = model(**inputs)
        outputs = compiled.run(inputs)
        for key, value in outputs.items():
            reference = expected.get(key)
            if reference is None:
                continue
            error = compare_output(key, value, reference)
            assert error.relative_to_scale <= TOLERANCE, (name, b, s, error)
