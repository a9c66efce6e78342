"""What a generate request asks for, read the same way from REST JSON and gRPC parameters.

Parameters (Triton's generate extension and vLLM's names, with transformers' aliases):
``max_tokens`` or ``max_new_tokens`` (int ≥ 1, default 20), ``temperature`` (≥ 0; 0 is greedy),
``do_sample`` (default: true when a positive ``temperature`` is given, else greedy),
``top_k`` (0 is off, default 50), ``top_p`` (in (0, 1]), ``seed`` (int),
``repetition_penalty`` (> 0, 1 is off: transformers', over the prompt and the generated
tokens), ``presence_penalty`` and ``frequency_penalty`` (in [-2, 2], 0 is off: OpenAI's, over
the generated tokens; ``sampling.py``), ``eos_token_id`` or
``stop_token_ids`` (an id or a list; default: the model's), ``ignore_eos`` (bool), ``stop``
(a string or a list: generation ends once the text holds one; needs a tokenizer), and the
transport's own keys (``stream``, ``timeout``, ``priority``, ``triton_*``), which are read
elsewhere or ignored. Any other key is refused, so a misspelt parameter never silently falls
back to a default. What a request leaves out of ``temperature``, ``top_k``, ``top_p`` and
``repetition_penalty`` comes from the model's generation config where it sets them (an
instruct model's ``generation_config.json``), and whether it samples from that config's
``do_sample`` unless the request gives a temperature, as transformers' ``generate`` reads it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cuvil.generation.sampling import SamplingParams
from cuvil_sidecar.errors import InvalidInput

SAMPLING_KEYS = frozenset(
    {
        "max_tokens", "max_new_tokens", "temperature", "do_sample", "top_k", "top_p", "seed",
        "eos_token_id", "stop_token_ids", "ignore_eos", "stop", "repetition_penalty",
        "presence_penalty", "frequency_penalty",
    }
)  # fmt: skip
TRANSPORT_KEYS = frozenset(
    {"stream", "timeout", "priority", "sequence_id", "sequence_start", "sequence_end", "headers"}
)


@dataclass(frozen=True)
class GenerateRequest:
    prompt: tuple[int, ...] | None  # token ids, or None when ``text`` is given
    text: str | None
    params: SamplingParams
    stop: tuple[str, ...] = ()
    id: str = ""
    # whether the client has gone (any thread): asked when the request's turn comes and while
    # its prompt is written, by transports that cannot cancel the stream when it goes (the
    # native gRPC front end learns it only from the call)
    client_gone: Callable[[], bool] | None = None
    logprobs: int | None = None  # each token's log-probability and this many top ones' (OpenAI)


def read_parameters(
    parameters: Mapping[str, Any],
    default_eos: Sequence[int],
    defaults: Mapping[str, Any] | None = None,
) -> tuple[SamplingParams, tuple[str, ...]]:
    """The request's sampling parameters and stop strings; ``defaults``: the model's
    generation config's sampling options (``sampling_defaults``)."""
    given = parameters
    parameters = {**(defaults or {}), **parameters}
    unknown = sorted(
        key
        for key in parameters
        if key not in SAMPLING_KEYS and key not in TRANSPORT_KEYS and not key.startswith("triton_")
    )
    if unknown:
        raise InvalidInput(
            f"unknown generate parameter(s) {unknown}; accepted: {sorted(SAMPLING_KEYS)}"
        )
    if "max_tokens" in parameters and "max_new_tokens" in parameters:
        raise InvalidInput("give max_tokens or max_new_tokens, not both")
    max_new = _integer(parameters, "max_tokens", None)
    if max_new is None:
        max_new = _integer(parameters, "max_new_tokens", 20)
    temperature = _number(parameters, "temperature", 1.0)
    if not 0 <= temperature < math.inf:
        raise InvalidInput(
            f"temperature must be 0 (greedy) or a finite number above, not {temperature}"
        )
    if "temperature" in given:
        sampled_by_default = temperature > 0
    else:
        sampled_by_default = _flag(parameters, "do_sample", False)
    do_sample = _flag(given, "do_sample", sampled_by_default)
    if do_sample and temperature == 0:
        raise InvalidInput("do_sample with temperature 0: give a positive temperature")
    eos: list[int] = []
    for key in ("eos_token_id", "stop_token_ids"):
        eos += _ids(parameters, key)
    if not eos and not _flag(parameters, "ignore_eos", False):
        eos = list(default_eos)
    seed = _integer(parameters, "seed", None)
    try:
        params = SamplingParams(
            max_new_tokens=max_new,
            do_sample=do_sample,
            temperature=temperature if do_sample else 1.0,
            top_k=_integer(parameters, "top_k", 50),
            top_p=_number(parameters, "top_p", 1.0),
            seed=seed,
            eos_token_id=tuple(eos),
            repetition_penalty=_number(parameters, "repetition_penalty", 1.0),
            presence_penalty=_number(parameters, "presence_penalty", 0.0),
            frequency_penalty=_number(parameters, "frequency_penalty", 0.0),
        )
    except ValueError as error:
        raise InvalidInput(str(error)) from None
    return params, _strings(parameters, "stop")


def read_prompt(value: Any, key: str) -> tuple[int, ...]:
    """Token ids from JSON (a list of ints, or a list holding one such list)."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], list):
        value = value[0]
    if not isinstance(value, list) or not all(_is_int(v) for v in value):
        raise InvalidInput(f"{key} must be a list of token ids (integers)")
    return tuple(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _integer(parameters: Mapping[str, Any], key: str, default: Any) -> Any:
    value = parameters.get(key, default)
    if value is not default and not _is_int(value):
        raise InvalidInput(f"{key} must be an integer, not {value!r}")
    return value


def _number(parameters: Mapping[str, Any], key: str, default: float) -> float:
    value = parameters.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidInput(f"{key} must be a number, not {value!r}")
    return float(value)


def _flag(parameters: Mapping[str, Any], key: str, default: bool) -> bool:
    value = parameters.get(key, default)
    if not isinstance(value, bool):
        raise InvalidInput(f"{key} must be true or false, not {value!r}")
    return value


def _ids(parameters: Mapping[str, Any], key: str) -> list[int]:
    value = parameters.get(key)
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(_is_int(v) and v >= 0 for v in values):
        raise InvalidInput(f"{key} must be a token id or a list of them, not {value!r}")
    return list(values)


def _strings(parameters: Mapping[str, Any], key: str) -> tuple[str, ...]:
    value = parameters.get(key)
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, str) and v for v in values):
        raise InvalidInput(f"{key} must be a non-empty string or a list of them")
    return tuple(values)
