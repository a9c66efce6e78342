"""The compiled model as a DecoderEngine (chunked prefill, slots in any order, the cache written
in place), its artifact (both graphs, the cache layout, tokenizer files; the same tokens after
save and load), and what ``generate`` refuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

import cuvil
from cuvil.artifact import media_types as mt
from cuvil.generation.generate import UnsupportedGenerationError
from cuvil.runtime.generation import GenerationModel
from cuvil.runtime.signature import InputError
from tests.cuvil.generation.families import VOCAB, build

MAX_SEQ = 48
TOKENIZER = {"version": "1.0", "model": {"type": "WordLevel", "vocab": {"a": 0, "b": 1}}}
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def source_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory as transformers writes it, with tokenizer files beside the weights."""
    directory = tmp_path_factory.mktemp("tiny-llama")
    build("llama").save_pretrained(directory)
    (directory / "tokenizer.json").write_text(json.dumps(TOKENIZER))
    (directory / "tokenizer_config.json").write_text(json.dumps({"model_max_length": MAX_SEQ}))
    (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return directory


@pytest.fixture(scope="module")
def model(source_dir: Path) -> torch.nn.Module:
    return LlamaForCausalLM.from_pretrained(source_dir).eval()


@pytest.fixture(scope="module")
def generation(model: torch.nn.Module) -> GenerationModel:
    example = {"input_ids": torch.randint(0, VOCAB, (1, 6))}
    compiled = cuvil.jit(model, example, task="text-generation", max_batch=4, max_seq=MAX_SEQ)
    assert isinstance(compiled, GenerationModel)
    return compiled


def _ids(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


def test_a_prompt_in_two_chunks_gives_the_logits_of_one(generation: GenerationModel) -> None:
    prompt = _ids(13, seed=1)
    whole = generation.prefill(0, prompt, 0)
    generation.prefill(2, prompt[:8], 0)
    chunked = generation.prefill(2, prompt[8:], 8)
    torch.testing.assert_close(chunked, whole, rtol=1e-4, atol=1e-5)
    assert whole.shape == (generation.vocab_size,) and whole.dtype == torch.float32


def test_decode_over_slots_in_any_order_matches_each_alone(
    generation: GenerationModel, model: torch.nn.Module
) -> None:
    prompts = {3: _ids(5, seed=2), 1: _ids(9, seed=3)}
    for slot, prompt in prompts.items():
        generation.prefill(slot, prompt, 0)
    tokens = torch.tensor([7, 11])
    logits = generation.decode([3, 1], tokens, torch.tensor([5, 9]))
    with torch.no_grad():
        for row, prompt in enumerate(prompts.values()):
            sequence = torch.cat([prompt, tokens[row : row + 1]])[None]
            expected = model(input_ids=sequence).logits[0, -1]
            torch.testing.assert_close(logits[row], expected, rtol=1e-4, atol=1e-4)


def test_steps_write_the_cache_in_place(generation: GenerationModel) -> None:
    pointers = [cache.data_ptr() for cache in generation.caches]
    generation.prefill(0, _ids(4, seed=4), 0)
    before = generation.caches[0][0, :, 4].clone()
    generation.decode([0], torch.tensor([5]), torch.tensor([4]))
    assert [cache.data_ptr() for cache in generation.caches] == pointers
    assert not torch.equal(generation.caches[0][0, :, 4], before)  # position 4 was written


def test_steps_refuse_slots_and_positions_outside_the_cache(generation: GenerationModel) -> None:
    with pytest.raises(InputError, match="slot 4"):
        generation.prefill(4, _ids(3, seed=5), 0)
    with pytest.raises(InputError, match="do not fit"):
        generation.prefill(0, _ids(3, seed=5), MAX_SEQ - 2)
    with pytest.raises(InputError, match="distinct slots"):
        generation.decode([1, 1], torch.tensor([1, 2]), torch.tensor([0, 0]))


def test_the_artifact_round_trip_generates_the_same_tokens(
    generation: GenerationModel, tmp_path: Path
) -> None:
    ids = _ids(7, seed=6)[None]
    before = generation.generate(ids, max_new_tokens=10)
    path = generation.save(tmp_path / "llama.cuvil")
    loaded = cuvil.load(path)
    assert isinstance(loaded, GenerationModel)
    assert torch.equal(loaded.generate(ids, max_new_tokens=10), before)
    config = loaded.config["generation"]
    assert config["kv_cache"]["kind"] == "static-per-slot"
    assert (config["kv_cache"]["max_batch"], config["kv_cache"]["max_seq"]) == (4, MAX_SEQ)
    assert config["cache_inputs"][:2] == ["key_cache_0", "value_cache_0"]
    assert loaded.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # layers, K+V, KV heads, head, fp32
    assert json.loads(loaded.tokenizer_files["tokenizer.json"]) == TOKENIZER
    assert set(loaded.tokenizer_files) == {"tokenizer.json", "tokenizer_config.json"}
    # the template file of transformers' newer layout travels inside the config's JSON
    tokenizer_config = json.loads(loaded.tokenizer_files["tokenizer_config.json"])
    assert tokenizer_config == {"model_max_length": MAX_SEQ, "chat_template": CHAT_TEMPLATE}
    directory = generation.save(tmp_path / "as-dir", directory=True)
    names = {p.name for p in directory.iterdir()}
    assert {mt.GRAPH_FILE, mt.PREFILL_GRAPH_FILE, mt.WEIGHTS_FILE, "tokenizer.json"} <= names
    assert not any(name.endswith((".pt", ".pkl", ".bin")) for name in names)


def test_weights_are_stored_once_for_both_graphs(generation: GenerationModel) -> None:
    prefill = generation.contents.prefill_graph
    assert prefill is not None
    keys = {
        str(n.arg("key")) for g in (generation.graph, prefill) for n in g.nodes if n.op == "const"
    }
    assert keys == set(generation.contents.weights)
    assert not any(key.startswith("prefill.") for key in keys)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"num_beams": 4}, "num_beams"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be positive"),
        ({"no_repeat_ngram_size": 2}, "no_repeat_ngram_size"),
        ({"attention_mask": torch.tensor([[1, 1, 1, 0]])}, "not left padding"),
        ({"max_new_tokens": MAX_SEQ}, "do not fit"),
    ],
)
def test_generate_refuses_what_it_does_not_cover(
    generation: GenerationModel, options: dict, message: str
) -> None:
    with pytest.raises(UnsupportedGenerationError, match=message):
        generation.generate(_ids(4, seed=7)[None], **options)


def test_a_batch_larger_than_the_slots_runs_in_groups(
    generation: GenerationModel, model: torch.nn.Module
) -> None:
    ids = torch.stack([_ids(6, seed=10 + row) for row in range(6)])  # 6 rows, 4 slots
    ours = generation.generate(ids, max_new_tokens=6, eos_token_id=None)
    theirs = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None)
    assert torch.equal(ours, theirs)


def test_the_models_generation_config_gives_what_a_call_leaves_out(tmp_path: Path) -> None:
    """An instruct model's ``generation_config.json`` (sampling, a repetition penalty) is
    recorded in the artifact and used where a call gives no value, as transformers does."""
    model = build("llama").eval()
    model.generation_config.update(
        do_sample=True, temperature=0.7, top_k=20, repetition_penalty=1.4
    )
    example = {"input_ids": torch.randint(0, VOCAB, (1, 6))}
    compiled = cuvil.jit(model, example, task="text-generation", max_batch=2, max_seq=MAX_SEQ)
    assert isinstance(compiled, GenerationModel)
    ids = _ids(9, seed=11)[None]
    greedy = compiled.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None)
    theirs = model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None)
    assert torch.equal(greedy, theirs)  # the config's penalty applies to a greedy call too
    plain = compiled.generate(
        ids, max_new_tokens=16, do_sample=False, eos_token_id=None, repetition_penalty=1.0
    )
    assert not torch.equal(greedy, plain)
    sampled = compiled.generate(ids, max_new_tokens=16, eos_token_id=None, seed=3)
    assert not torch.equal(sampled, greedy)  # the config samples by default
    loaded = cuvil.load(compiled.save(tmp_path / "instruct.cuvil"))
    assert isinstance(loaded, GenerationModel)
    defaults = loaded.generation_config["sampling_defaults"]
    assert defaults == {
        "do_sample": True,
        "temperature": 0.7,
        "top_k": 20,
        "repetition_penalty": 1.4,
    }
    assert torch.equal(loaded.generate(ids, max_new_tokens=16, eos_token_id=None, seed=3), sampled)
