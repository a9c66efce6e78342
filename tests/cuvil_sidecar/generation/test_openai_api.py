"""OpenAI's API on a real sidecar process, called through OpenAI's own Python client: a tiny
transformers checkpoint with a byte-level BPE tokenizer and a chat template.

- greedy completions and chat completions give transformers' ``generate`` text (the chat
  prompt rendered as transformers' ``apply_chat_template`` renders it), whole and streamed,
  with usage counts (a repeated prompt's cached tokens: prefix reuse); a token-id prompt
  answers as its text does; seeded sampling repeats; the penalties as transformers and OpenAI
  define them; ``logprobs`` as the model's log-softmax, whole and streamed;
- stop strings cut the text; a chat template's own refusal, fields this server does not do,
  unknown fields and another model's name get OpenAI's error answers, and the server goes on;
- the api key is checked as a bearer token; a model without a tokenizer refuses, naming the
  generate extension's route.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from cuvil_sidecar.generation.scheduler import PREFIX_MIN_TOKENS

from tests.cuvil_sidecar.conftest import Sidecar, ready_sidecar
from tests.cuvil_sidecar.generation.checkpoints import VOCAB, tiny_llama_checkpoint

TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if loop.first and message['role'] == 'assistant' %}"
    "{{ raise_exception('a conversation starts with the user or the system') }}{% endif %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
PROMPT = "the quick brown fox jumps over the lazy dog, then the quick brown fox"  # 16 tokens
LONG = 16_000  # tokens a stream asks for when it must still run while the test looks
LOGPROB_TOKENS = 10
MESSAGES = [
    {"role": "system", "content": "answer in one word"},
    {"role": "user", "content": "what jumps over the lazy dog?"},
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("ckpt") / "tiny"
    return tiny_llama_checkpoint(folder, tokenizer=True, chat_template=TEMPLATE)


@pytest.fixture(scope="module")
def sidecar(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecar]:
    log = tmp_path_factory.mktemp("openai") / "sidecar.log"
    served = Sidecar(
        checkpoint, log, CUVIL_GENERATION_SLOTS="4", CUVIL_GENERATION_MAX_SEQ=str(LONG + 64)
    )
    with ready_sidecar(served) as ready:
        yield ready


@pytest.fixture(scope="module")
def client(sidecar: Sidecar) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"http://{sidecar.http_url}/v1", api_key="none") as opened:
        yield opened


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> Any:
    """transformers' model and tokenizer over the same files."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(checkpoint / "tokenizer.json"),
        bos_token="<s>",
        eos_token="</s>",
        chat_template=TEMPLATE,
    )
    model = AutoModelForCausalLM.from_pretrained(checkpoint, local_files_only=True).eval()
    return model, tokenizer


def greedy(reference: Any, ids: list[int], new_tokens: int) -> tuple[str, str]:
    """transformers' greedy text for ``ids``, and why it ended (OpenAI's finish_reason)."""
    model, tokenizer = reference
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)
    tokens = out[0, len(ids) :].tolist()
    finish = "stop" if tokens[-1] == model.generation_config.eos_token_id else "length"
    return tokenizer.decode(tokens, skip_special_tokens=True), finish


def test_models_lists_the_generation_model(client: openai.OpenAI) -> None:
    assert [model.id for model in client.models.list()] == ["tiny"]


def test_completions_match_transformers_whole_and_streamed(
    client: openai.OpenAI, reference: Any
) -> None:
    ids = reference[1].encode(PROMPT)
    assert len(ids) - 1 >= PREFIX_MIN_TOKENS  # long enough to be reused
    expected, finish = greedy(reference, ids, 12)
    answer = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    assert answer.object == "text_completion" and answer.id.startswith("cmpl-")
    assert (answer.choices[0].text, answer.choices[0].finish_reason) == (expected, finish)
    assert answer.usage is not None and answer.usage.prompt_tokens == len(ids)
    assert answer.usage.total_tokens == len(ids) + answer.usage.completion_tokens
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == expected
    # the same prompt again: all of it but its last token copied from the first one's slot
    assert by_ids.usage is not None and by_ids.usage.prompt_tokens_details is not None
    assert by_ids.usage.prompt_tokens_details.cached_tokens == len(ids) - 1
    chunks = list(
        client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    texts = [chunk.choices[0].text for chunk in chunks if chunk.choices]
    assert "".join(texts) == expected and len(texts) > 1
    finishes = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices]
    assert finishes[-1] == finish and set(finishes[:-1]) == {None}
    assert chunks[-1].usage == by_ids.usage and not chunks[-1].choices


def test_penalties_change_the_text_as_transformers_and_openai_define_them(
    client: openai.OpenAI, reference: Any
) -> None:
    """vLLM's ``repetition_penalty`` is transformers'; OpenAI's presence and frequency
    penalties lower each generated token's logit (a greedy loop over transformers' logits
    with their formula gives the same text)."""
    model, tokenizer = reference
    ids = tokenizer.encode(PROMPT)
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=24, do_sample=False, repetition_penalty=1.5
        )
    expected = tokenizer.decode(out[0, len(ids) :].tolist(), skip_special_tokens=True)
    body = {"model": "tiny", "prompt": ids, "max_tokens": 24, "temperature": 0}
    answer = client.completions.create(**body, extra_body={"repetition_penalty": 1.5})
    assert answer.choices[0].text == expected
    tokens: list[int] = []
    with torch.inference_mode():
        for _ in range(24):
            logits = model(torch.tensor([ids + tokens])).logits[0, -1]
            counts = torch.bincount(torch.tensor(tokens, dtype=torch.int64), minlength=VOCAB)
            logits = logits - 0.8 * counts[:VOCAB] - 1.2 * (counts[:VOCAB] > 0).float()
            tokens.append(int(logits.argmax()))
            if tokens[-1] == model.generation_config.eos_token_id:
                break
    answer = client.completions.create(**body, presence_penalty=1.2, frequency_penalty=0.8)
    assert answer.choices[0].text == tokenizer.decode(tokens, skip_special_tokens=True)
    assert answer.choices[0].text != greedy(reference, ids, 24)[0]


def test_chat_renders_the_template_as_transformers_and_matches_its_text(
    client: openai.OpenAI, reference: Any, sidecar: Sidecar
) -> None:
    """The second, streamed, request starts from the first one's keys (prefix reuse) and
    answers the same."""
    from tests.cuvil_sidecar.generation.clients import metric

    ids = list(
        reference[1].apply_chat_template(
            MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )
    expected, finish = greedy(reference, ids, 10)
    answer = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_completion_tokens=10,
        temperature=0,
    )
    message = answer.choices[0].message
    assert (message.role, message.content, answer.choices[0].finish_reason) == (
        "assistant", expected, finish,
    )  # fmt: skip
    assert answer.usage is not None and answer.usage.prompt_tokens == len(ids)
    reused = metric(sidecar, "cuvil_prefix_reused_tokens")
    stream = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=10,
        temperature=0,
        stream=True,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == finish
    assert metric(sidecar, "cuvil_prefix_reused_tokens") - reused == len(ids) - 1


def test_seeded_sampling_repeats_and_stop_strings_cut(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        answer = client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=16, temperature=1.5, seed=seed,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        return answer.choices[0].text

    first = sample(7)
    assert sample(7) == first and len(first) > 4
    assert any(sample(seed) != first for seed in (8, 9, 10))
    stop = first[2:4]
    cut = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=16, temperature=1.5, seed=7, stop=[stop],
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert cut.choices[0].text == first[: first.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_a_client_that_leaves_a_chat_stream_frees_its_slot(
    client: openai.OpenAI, sidecar: Sidecar
) -> None:
    from tests.cuvil_sidecar.generation.clients import metric

    before = metric(sidecar, "cuvil_generation_tokens")
    stream = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=LONG, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    pieces = iter(stream)
    next(pieces), next(pieces)  # the role, then the first text
    assert metric(sidecar, "cuvil_generation_running") == 1
    stream.close()  # the client goes away mid-stream
    deadline = time.monotonic() + 60
    while metric(sidecar, "cuvil_generation_running") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(sidecar, "cuvil_generation_running") == 0
    assert metric(sidecar, "cuvil_generation_tokens") - before < LONG / 2


@pytest.mark.parametrize(
    ("extra", "expected", "match"),
    [
        ({"n": 2}, openai.BadRequestError, "n=2 is not supported"),
        ({"echo": True}, openai.BadRequestError, "echo=True is not supported"),
        ({"presence_penalty": 2.5}, openai.BadRequestError, "presence_penalty must be in"),
        ({"extra_body": {"best_of_all": 1}}, openai.BadRequestError, "unknown field.*best_of_all"),
        ({"max_tokens": 0}, openai.BadRequestError, "max_new_tokens"),
        ({"model": "other"}, openai.NotFoundError, "other"),
    ],
)
def test_what_is_not_served_gets_openai_errors(
    client: openai.OpenAI, extra: dict[str, Any], expected: type[Exception], match: str
) -> None:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4} | extra
    with pytest.raises(expected, match=match):
        client.completions.create(**body)
    again = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
    assert again.choices[0].finish_reason in ("stop", "length")  # the server goes on


def test_the_chat_templates_refusal_is_a_bad_request(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="starts with the user or the system"):
        client.chat.completions.create(
            model="tiny", messages=[{"role": "assistant", "content": "hi"}], max_tokens=2
        )
    with pytest.raises(openai.BadRequestError, match="messages\\[0\\] needs a role"):
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "robot", "content": "hi"}],
            max_tokens=2,
        )


def test_api_keys_are_bearer_tokens_and_a_model_without_a_tokenizer_refuses(
    tmp_path: Path,
) -> None:
    """OpenAI's client sends its api_key as a bearer token: the sidecar's token file decides."""
    checkpoint = tiny_llama_checkpoint(tmp_path / "tiny-ids", tokenizer=False)
    (tmp_path / "tokens").write_text("s3cret\n")
    served = Sidecar(
        checkpoint, tmp_path / "sidecar.log", CUVIL_AUTH_TOKENS_FILE=str(tmp_path / "tokens")
    )
    with ready_sidecar(served) as sidecar:
        base = f"http://{sidecar.http_url}/v1"
        unknown = pytest.raises(openai.AuthenticationError, match="not valid")
        with openai.OpenAI(base_url=base, api_key="wrong") as client, unknown:
            client.models.list()
        refused = pytest.raises(openai.BadRequestError, match="/v2/models/tiny-ids/generate")
        with openai.OpenAI(base_url=base, api_key="s3cret") as client, refused:
            client.completions.create(model="tiny-ids", prompt=[5, 6, 7], max_tokens=2)


def _scored(model: Any, prompt: list[int]) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens for ``prompt`` and each one's log-probability."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=LOGPROB_TOKENS, do_sample=False)
        tokens = out[0, len(prompt) :].tolist()
        logits = model(out[:, :-1]).logits[0, len(prompt) - 1 :]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
    return tokens, [float(logprobs[i, token]) for i, token in enumerate(tokens)]


def test_a_completions_logprobs_are_the_models(client: openai.OpenAI, reference: Any) -> None:
    """Each generated token's log-probability is transformers' log-softmax over the same
    tokens; the top ones hold the greedy pick."""
    model, tokenizer = reference
    greedy = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=LOGPROB_TOKENS, temperature=0, logprobs=3
    )
    logprobs = greedy.choices[0].logprobs
    assert logprobs is not None and greedy.usage is not None
    tokens, expected = _scored(model, tokenizer.encode(PROMPT))
    assert logprobs.tokens == [tokenizer.decode([t]) for t in tokens]
    assert logprobs.token_logprobs == pytest.approx(expected, abs=1e-4)
    assert logprobs.top_logprobs is not None and logprobs.text_offset is not None
    for chosen, top in zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        # three tokens, fewer where two decode to the same text (a partial character: "\ufffd")
        assert 1 <= len(top) <= 3 and max(top.values()) == pytest.approx(chosen, abs=1e-6)
    offsets = logprobs.text_offset
    assert (
        offsets[0] == 0
        and offsets == sorted(offsets)
        and offsets[-1] <= len(greedy.choices[0].text)
    )
    assert len(offsets) == greedy.usage.completion_tokens


def test_a_chats_logprobs_whole_and_streamed(client: openai.OpenAI) -> None:
    """Each token's entry holds its bytes and its top ones, the greedy pick first; a streamed
    chat carries in its chunks what the whole answer carries."""
    asked: dict[str, Any] = {"max_tokens": LOGPROB_TOKENS, "temperature": 0, "logprobs": True}
    whole = client.chat.completions.create(model="tiny", messages=MESSAGES, top_logprobs=2, **asked)
    logprobs = whole.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None and whole.usage is not None
    content = logprobs.content
    assert len(content) == whole.usage.completion_tokens
    for entry in content:
        assert entry.bytes == list(entry.token.encode())
        assert [top.logprob for top in entry.top_logprobs] == sorted(
            (top.logprob for top in entry.top_logprobs), reverse=True
        )
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)
    streamed = []
    for chunk in client.chat.completions.create(
        model="tiny", messages=MESSAGES, top_logprobs=2, stream=True, **asked
    ):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content or []
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"top_logprobs": 2}, "top_logprobs needs logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs must be an integer from 0 to 20"),
        ({"logprobs": 3}, "logprobs must be true or false"),
    ],
)
def test_bad_logprobs_asks_are_bad_requests(
    client: openai.OpenAI, extra: dict[str, Any], match: str
) -> None:
    with pytest.raises(openai.BadRequestError, match=match):
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, **extra)
    with pytest.raises(openai.BadRequestError, match="logprobs must be an integer from 0 to 20"):
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, logprobs=-1)
