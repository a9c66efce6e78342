"""Models that must run as one native schedule at a settled shape (``describe()``: whole plan
native, no Python step), built from configs, and a generation model's decode step; with every
path a kernel may choose forced in turn (the Winograd and 1x1-GEMM convolutions, the split GEMM,
MKL and oneDNN linears), still answering as eager PyTorch does on inputs other than the
recorded ones."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers as tf
from torch.export import Dim

import cuvil
from cuvil.backends.cpu.backend import SETTLE_RUNS
from cuvil.backends.cpu.tactics import Tactics, bucket
from cuvil.runtime.model import CompiledModel


def _resnet(layer_type: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = tf.ResNetConfig(
        depths=[1, 1], layer_type=layer_type, hidden_sizes=[32, 64], embedding_size=16
    )
    model = tf.ResNetForImageClassification(config).eval()
    generator = torch.Generator().manual_seed(1)
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            assert module.running_mean is not None and module.running_var is not None
            module.running_mean.copy_(torch.randn(module.num_features, generator=generator) * 0.1)
            module.running_var.copy_(torch.rand(module.num_features, generator=generator) + 0.5)
    return model


def _bert() -> torch.nn.Module:
    torch.manual_seed(0)
    config = tf.BertConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        vocab_size=500,
    )  # fmt: skip
    return tf.BertModel(config).eval()


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = tf.LlamaConfig(
        hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=500, max_position_embeddings=128, use_cache=False,
    )  # fmt: skip
    return tf.LlamaForCausalLM(config).eval()


def _images(batch: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"pixel_values": torch.randn(batch, 3, 64, 64, generator=generator)}


def _text(batch: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 500, (batch, 24), generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones(batch, 24, dtype=torch.int64)}


def _tokens(batch: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, 500, (batch, 24), generator=generator)}


BATCH = Dim("batch", min=1, max=8)
SEQ = Dim("seq", min=8, max=64)
TEXT = {0: BATCH, 1: SEQ}
CNN_PATHS = ("timed", "onednn", "winograd", "gemm")
TEXT_PATHS = ("timed", "onednn", "mkl")
MODELS: dict[str, tuple[Any, Any, dict[str, Any], tuple[str, ...]]] = {
    "resnet18_shaped": (lambda: _resnet("basic"), _images, {"pixel_values": {0: BATCH}}, CNN_PATHS),
    "resnet50_shaped": (
        lambda: _resnet("bottleneck"),
        _images,
        {"pixel_values": {0: BATCH}},
        CNN_PATHS,
    ),
    "minilm_shaped": (_bert, _text, {"input_ids": TEXT, "attention_mask": TEXT}, TEXT_PATHS),
    "tiny_llama_shaped": (_llama, _tokens, {"input_ids": TEXT}, TEXT_PATHS),
}
CASES = [(name, path) for name, (*_, paths) in MODELS.items() for path in paths]


def _force(model: CompiledModel, rows: tuple[int, ...], path: str) -> int:
    """Preset every kernel choice offering ``path`` at these row buckets (a convolution's batch,
    a linear's rows) to it; returns how many were set."""
    taken = 0
    for step in model.plan.steps:
        choices = step.choices
        if not isinstance(choices, Tactics):
            continue
        for key in {bucket(count) for count in rows}:
            if path in dict(choices.candidates_for(key)):
                taken += choices.preset({key: path})
    return taken


def _outputs(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    items = value.values() if hasattr(value, "values") else value
    return [item for item in items if isinstance(item, torch.Tensor)]


def _settled_native(compiled: CompiledModel, recorded: dict[str, torch.Tensor]) -> None:
    compiled.prepare(recorded)
    shapes = compiled.execution()["plan_loop"]["shapes"]
    batch = next(iter(recorded.values())).shape[0]
    threads = torch.get_num_threads()
    (entry,) = [
        summary
        for key, summary in shapes.items()
        if key.startswith(f"batch={batch}") and key.endswith(f"threads={threads}")
    ]
    assert entry["whole_plan_native"], entry
    assert entry["python_steps"] == [] and entry["schedules"] == 1


@pytest.mark.parametrize(("name", "path"), CASES)
def test_the_model_is_one_foreign_call_and_matches_eager(name: str, path: str) -> None:
    build, inputs_of, dynamic, _ = MODELS[name]
    eager = build()
    compiled = cuvil.jit(eager, inputs_of(2, 0), dynamic_shapes=dynamic)
    recorded = inputs_of(1, 1)
    if path != "timed":
        assert _force(compiled, (1, 24), path) > 0  # the path is there to be taken
    _settled_native(compiled, recorded)
    if path != "timed":
        chosen = {name for bucket_choices in compiled.execution()["tactics"].values()
                  for name in bucket_choices.values()}  # fmt: skip
        assert path in chosen
    for seed in (2, 3):  # data other than the recorded call's, at the settled shape
        fresh = inputs_of(1, seed)
        with torch.inference_mode():
            expected = _outputs(eager(**fresh))
            got = _outputs(compiled(**fresh))
        assert got and len(got) <= len(expected)
        for want, have in zip(expected, got, strict=False):
            torch.testing.assert_close(have, want, atol=2e-4, rtol=2e-4)


def test_a_one_row_linear_on_the_split_gemm_is_one_foreign_call() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the split path needs two parts
    try:
        model = torch.nn.Sequential(
            torch.nn.Linear(96, 200), torch.nn.ReLU(), torch.nn.Linear(200, 30)
        ).eval()
        compiled = cuvil.jit(model, (torch.randn(2, 96),), dynamic_shapes={"input": {0: BATCH}})
        assert _force(compiled, (1,), "split") == 2
        _settled_native(compiled, {"input": torch.randn(1, 96)})
        for _ in range(2):
            x = torch.randn(1, 96)
            with torch.inference_mode():
                torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(threads)


def test_a_decode_step_is_one_foreign_call_and_matches_eager() -> None:
    from tests.cuvil.generation.families import VOCAB, build

    model = build("llama").eval()
    example = {"input_ids": torch.randint(0, VOCAB, (1, 6))}
    generation = cuvil.jit(model, example, task="text-generation", max_batch=4, max_seq=48)
    generator = torch.Generator().manual_seed(4)
    prompts = {3: torch.randint(0, VOCAB, (5,), generator=generator),
               1: torch.randint(0, VOCAB, (9,), generator=generator)}  # fmt: skip
    positions = torch.tensor([5, 9])
    for _ in range(2 * SETTLE_RUNS):  # the step's GEMM choices made, then one recorded
        for slot, prompt in prompts.items():
            generation.prefill(slot, prompt, 0)
        generation.decode([3, 1], torch.tensor([1, 2]), positions)
        if generation.runner.describe()["shapes"]:
            break
    (entry,) = generation.runner.describe()["shapes"].values()
    assert entry["whole_plan_native"] and entry["python_steps"] == [], entry
    tokens = torch.tensor([7, 11])
    for slot, prompt in prompts.items():
        generation.prefill(slot, prompt, 0)
    logits = generation.decode([3, 1], tokens, positions)
    follow = generation.decode([3, 1], torch.tensor([2, 3]), positions + 1)  # the cache written
    with torch.no_grad():
        for row, prompt in enumerate(prompts.values()):
            sequence = torch.cat([prompt, tokens[row : row + 1]])[None]
            torch.testing.assert_close(
                logits[row], model(input_ids=sequence).logits[0, -1], rtol=1e-4, atol=1e-4
            )
            longer = torch.cat([sequence[0], torch.tensor([2 + row])])[None]
            torch.testing.assert_close(
                follow[row], model(input_ids=longer).logits[0, -1], rtol=1e-4, atol=1e-4
            )


@pytest.mark.parametrize("name", ["resnet18_shaped", "minilm_shaped", "tiny_llama_shaped"])
def test_a_bf16_model_is_one_foreign_call_within_its_error_budget(name: str) -> None:
    build, inputs_of, dynamic, _ = MODELS[name]
    eager = build()
    compiled = cuvil.jit(eager, inputs_of(2, 0), dynamic_shapes=dynamic, precision="bf16")
    _settled_native(compiled, inputs_of(1, 1))
    fresh = inputs_of(1, 2)
    with torch.inference_mode():
        expected = _outputs(eager(**fresh))
        got = _outputs(compiled(**fresh))
    assert got
    for want, have in zip(expected, got, strict=False):
        scale = float(want.abs().max())
        assert float((have - want).abs().max()) <= 0.05 * scale + 1e-3  # bf16 weights' rounding
