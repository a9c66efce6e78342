"""``generate``: transformers' ``generate`` for greedy and sampled decoding, over any
``DecoderEngine``.

Takes what transformers takes for what it covers — ``input_ids`` [batch, prompt], an optional
``attention_mask`` for left padding, ``max_new_tokens``, ``do_sample``, ``temperature``,
``top_k``, ``top_p``, ``repetition_penalty``, ``eos_token_id`` (one id or several),
``pad_token_id`` — plus ``seed``, and
returns what it returns: [batch, prompt + new] int64, the prompt (pads included) followed by the
new tokens, rows that stopped early filled with ``pad_token_id`` after their end token, as many
new columns as the longest row ran (all rows stop at once when every one has ended).

Each row's real tokens go into a slot of their own at positions 0, 1, …, the positions
transformers derives from a left-padded mask, so a padded batch gives every row the tokens it
gets alone. A prompt's tokens but its last are written with the engine's ``extend`` (all rows'
in one ``extend_many`` where the engine has it: packed into few calls); the last tokens of all
rows go in with one decode step, whose logits pick each row's first token. A ``streamer``
(transformers' protocol: ``put``, ``end``) gets the prompt, then each step's new tokens, one per
running row. With ``seed``, every row draws from its own generator seeded with
it (the sidecar does the same per request). A batch larger than the engine's slots runs in
groups of ``max_batch`` rows. The repetition penalty counts a row's own tokens, not its left
pads, as transformers does. Beam search, right padding, the other penalties and the other
options of transformers' ``generate`` are refused by name (``UnsupportedGenerationError``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from cuvil.generation.engine import DecoderEngine
from cuvil.generation.penalties import PenaltyState
from cuvil.generation.sampling import SamplingParams, next_tokens

TAKEN = (
    "max_new_tokens",
    "do_sample",
    "temperature",
    "top_k",
    "top_p",
    "repetition_penalty",
    "seed",
    "eos_token_id",
    "pad_token_id",
    "attention_mask",
    "streamer",
)
# what a model's generation config may set for ``generate`` where a call gives none
SAMPLING_DEFAULT_KEYS = ("do_sample", "temperature", "top_k", "top_p", "repetition_penalty")
# transformers' options that keep their neutral value here, and that value.
NEUTRAL = {
    "num_beams": 1,
    "num_return_sequences": 1,
    "use_cache": True,
    "return_dict_in_generate": False,
}


def sampling_defaults(generation_config: Any) -> dict[str, Any]:
    """What a transformers ``GenerationConfig`` (or its JSON as a dict) sets of
    ``SAMPLING_DEFAULT_KEYS``: an instruct model's temperature, top-p, repetition penalty,
    which transformers' ``generate`` uses where a call gives none; unset ones are left out."""
    read = generation_config.get if isinstance(generation_config, dict) else None
    found = {
        key: read(key) if read else getattr(generation_config, key, None)
        for key in SAMPLING_DEFAULT_KEYS
    }
    return {key: value for key, value in found.items() if isinstance(value, bool | int | float)}


class UnsupportedGenerationError(ValueError):
    """A ``generate`` option or input this driver does not cover."""


def generate(
    engine: DecoderEngine,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int = 20,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int = 50,
    top_p: float = 1.0,
    repetition_penalty: float = 1.0,
    seed: int | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    attention_mask: torch.Tensor | None = None,
    streamer: Any = None,
    **others: Any,
) -> torch.Tensor:
    _refuse_others(others)
    if input_ids.dim() != 2 or input_ids.shape[1] < 1:
        raise UnsupportedGenerationError(
            f"input_ids must be [batch, prompt] with a prompt, not {list(input_ids.shape)}"
        )
    eos = _ids(eos_token_id)
    if pad_token_id is None and eos:
        pad_token_id = eos[0]  # what transformers does, with a warning
    if attention_mask is None:
        attention_mask = _inferred_mask(input_ids, pad_token_id, eos)
    prompts = _left_padded_prompts(input_ids, attention_mask)
    try:
        params = SamplingParams(
            max_new_tokens, do_sample, temperature, top_k, top_p, seed, eos, repetition_penalty
        )
    except ValueError as error:
        raise UnsupportedGenerationError(str(error)) from None
    longest = max(len(prompt) for prompt in prompts)
    if longest + max_new_tokens - 1 > engine.max_seq:
        raise UnsupportedGenerationError(
            f"a prompt of {longest} tokens and {max_new_tokens} new ones do not fit the "
            f"{engine.max_seq} positions the model was compiled for (max_seq)"
        )
    fill = pad_token_id if pad_token_id is not None else 0
    if streamer is not None:
        streamer.put(input_ids)
    rows: list[list[int]] = []
    for start in range(0, len(prompts), engine.max_batch):
        group = prompts[start : start + engine.max_batch]
        rows += _generate_group(engine, group, params, streamer)
    if streamer is not None:
        streamer.end()
    width = max(len(row) for row in rows)
    new = torch.full((len(rows), width), fill, dtype=torch.int64)
    for index, row in enumerate(rows):
        new[index, : len(row)] = torch.tensor(row, dtype=torch.int64)
    return torch.cat([input_ids.to(torch.int64), new], dim=1)


def _generate_group(
    engine: DecoderEngine, prompts: list[torch.Tensor], params: SamplingParams, streamer: Any
) -> list[list[int]]:
    """New tokens per row, each row up to its end token or ``max_new_tokens``."""
    generators = [params.generator() for _ in prompts]
    lengths = [len(prompt) for prompt in prompts]
    slots = list(range(len(prompts)))
    try:
        prompt_chunks = [(slot, prompt[:-1], 0) for slot, prompt in enumerate(prompts)]
        _write_prompts(engine, [chunk for chunk in prompt_chunks if len(chunk[1])])
        last = torch.stack([prompt[-1] for prompt in prompts]).to(torch.int64)
        logits = engine.decode(slots, last, torch.tensor([n - 1 for n in lengths]))
        out: list[list[int]] = [[] for _ in prompts]
        vocab = logits.shape[-1]
        states = [PenaltyState(vocab, p.tolist()) for p in prompts] if params.penalizes else []
        tokens = next_tokens(logits, [params] * len(slots), generators, states.__getitem__)
        running = list(slots)
        for step in range(params.max_new_tokens):
            still = []
            for slot in running:
                out[slot].append(tokens[slot])
                if params.penalizes:
                    states[slot].add(tokens[slot])
                if tokens[slot] not in params.eos_token_id:
                    still.append(slot)
            if streamer is not None:
                streamer.put(torch.tensor([tokens[slot] for slot in running]))
            running = still
            if not running or step == params.max_new_tokens - 1:
                break
            positions = torch.tensor([lengths[slot] + step for slot in running])
            step_ids = torch.tensor([tokens[slot] for slot in running], dtype=torch.int64)
            rows = engine.decode(running, step_ids, positions)
            picked = next_tokens(
                rows,
                [params] * len(running),
                [generators[s] for s in running],
                [states[slot] for slot in running].__getitem__ if states else None,
            )
            for slot, token in zip(running, picked, strict=True):
                tokens[slot] = token
    finally:
        for slot in slots:
            engine.release(slot)
    return out


def _ids(eos_token_id: int | Sequence[int] | None) -> tuple[int, ...]:
    if eos_token_id is None:
        return ()
    if isinstance(eos_token_id, int):
        return (eos_token_id,)
    if isinstance(eos_token_id, torch.Tensor):
        return tuple(int(i) for i in eos_token_id.reshape(-1).tolist())
    return tuple(int(i) for i in eos_token_id)


def _inferred_mask(
    input_ids: torch.Tensor, pad_token_id: int | None, eos: tuple[int, ...]
) -> torch.Tensor:
    """transformers' rule: pads are masked when the pad token occurs and is not an end token."""
    if pad_token_id is not None and pad_token_id not in eos and (input_ids == pad_token_id).any():
        return (input_ids != pad_token_id).to(torch.int64)
    return torch.ones_like(input_ids)


def _left_padded_prompts(input_ids: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """Each row's real tokens; refuses masks that are not left padding."""
    if mask.shape != input_ids.shape:
        raise UnsupportedGenerationError(
            f"attention_mask {list(mask.shape)} does not match input_ids {list(input_ids.shape)}"
        )
    prompts = []
    for index, (ids, row) in enumerate(zip(input_ids, mask.to(torch.bool), strict=True)):
        real = int(row.sum())
        if real == 0:
            raise UnsupportedGenerationError(f"row {index} of attention_mask masks every token")
        if not bool(row[-real:].all()):
            raise UnsupportedGenerationError(
                f"row {index} of attention_mask is not left padding (pads then tokens): right "
                "or inner padding is not supported; pad on the left"
            )
        prompts.append(ids[-real:].to(torch.int64))
    return prompts


def _refuse_others(others: dict[str, Any]) -> None:
    refused = {
        key: value
        for key, value in others.items()
        if key not in NEUTRAL or (value is not None and value != NEUTRAL[key])
    }
    if refused:
        raise UnsupportedGenerationError(
            f"generate does not support {sorted(refused)}: it does greedy and sampled decoding "
            f"(no beam search, penalties or streamers); options: {list(TAKEN)}"
        )


def _write_prompts(engine: DecoderEngine, chunks: list[tuple[int, torch.Tensor, int]]) -> None:
    """(slot, tokens, position) chunks into the cache: one ``extend_many`` where the engine
    packs chunks together, one ``extend`` each otherwise."""
    pack = getattr(engine, "extend_many", None)
    if pack is not None:
        pack(chunks)
        return
    for chunk in chunks:
        engine.extend(*chunk)
