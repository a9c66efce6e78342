"""OpenAI's ``logprobs`` for the generated tokens of an answer, as vLLM serves them.

A completion asks with ``logprobs: k`` (0..20) and gets, per token, its text, its
log-probability, a dict of the ``k`` most likely tokens' by their text (the picked one added
where it is not among them; of two tokens with one text, such as a partial character's
"\ufffd", the likelier) and the token's offset in the answer's text. A chat asks with
``logprobs: true`` and ``top_logprobs: k`` and gets ``content``: per token its text,
log-probability, UTF-8 bytes and the ``k`` most likely tokens alike. Log-probabilities are
the model's own (the log-softmax of its logits before penalties, temperature and top-k/p;
``sampling.token_logprobs``). A streamed answer carries, in each chunk, the tokens since the
previous chunk (a token that completes no text yet waits for the next). The prompt's
log-probabilities (``echo``) are not served.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cuvil_sidecar.errors import InvalidInput
from cuvil_sidecar.generation.servable import GeneratedToken
from cuvil_sidecar.generation.text import TextCodec

MAX_TOP = 20  # OpenAI's bound on top_logprobs (vLLM's default bound as well)


def requested(body: dict[str, Any], chat: bool) -> int | None:
    """How many top tokens' log-probabilities each token gets, None when none were asked for."""
    asked = body.get("logprobs")
    if chat:
        if asked is not None and not isinstance(asked, bool):
            raise InvalidInput("logprobs must be true or false")
        top = body.get("top_logprobs")
        if top is not None and not asked:
            raise InvalidInput("top_logprobs needs logprobs: true")
        return _count(top or 0, "top_logprobs") if asked else None
    if asked is None or asked is False:
        return None
    return _count(asked, "logprobs")


def completion_logprobs(
    tokens: Sequence[GeneratedToken], codec: TextCodec, offset: int = 0
) -> dict[str, Any]:
    """A completion choice's ``logprobs`` for ``tokens``, the first at text ``offset``."""
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token.text)
    tops = []
    for token in tokens:
        assert token.logprobs is not None and token.token is not None
        chosen, alternatives = token.logprobs
        top: dict[str, float] = {}
        for i, logprob in alternatives:  # likeliest first: two tokens of one text keep the first
            top.setdefault(codec.token_text(i), logprob)
        if token.token not in dict(alternatives):  # a pick outside them is added, as vLLM does
            top.setdefault(codec.token_text(token.token), chosen)
        tops.append(top)
    return {
        "tokens": [codec.token_text(token.token) for token in tokens if token.token is not None],
        "token_logprobs": [token.logprobs[0] for token in tokens if token.logprobs is not None],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(tokens: Sequence[GeneratedToken], codec: TextCodec) -> dict[str, Any]:
    """A chat choice's ``logprobs``: ``content``, one entry per token."""
    content = []
    for token in tokens:
        assert token.logprobs is not None and token.token is not None
        chosen, alternatives = token.logprobs
        entry = _entry(codec.token_text(token.token), chosen)
        entry["top_logprobs"] = [_entry(codec.token_text(i), lp) for i, lp in alternatives]
        content.append(entry)
    return {"content": content}


def _entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def _count(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOP:
        raise InvalidInput(f"{key} must be an integer from 0 to {MAX_TOP}, not {value!r}")
    return value
