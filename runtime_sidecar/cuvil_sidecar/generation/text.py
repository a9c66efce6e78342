"""Text in and out of a generation model, through its ``tokenizer.json`` (Hugging Face's
``tokenizers``: a Rust library reading the file as data, never code).

Streams send text as it becomes whole: a token may end in the middle of a multi-byte character
(byte-level BPE), so ``Detokenizer`` holds text back while its end is an incomplete character.
It decodes a window, not the whole output: the tokens not yet sent plus the few sent before
them (their context: a SentencePiece word's leading space, a character split across tokens),
so each token costs the same however long the stream has run (incremental detokenization, as
vLLM and TGI do it).
"""

from __future__ import annotations

import json
from pathlib import Path

from cuvil_sidecar.errors import InvalidInput
from cuvil_sidecar.generation.chat import chat_template, special_tokens

TOKENIZER_FILE = "tokenizer.json"
_INCOMPLETE = "\ufffd"  # what decoding makes of a character whose bytes have not all come


class TextCodec:
    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(path))
        self.path = path
        self.chat_template = chat_template(path.parent)  # None: the tokenizer has none
        self.special_tokens = special_tokens(path.parent)  # what a chat template may write

    def encode(self, text: str, *, special: bool = True) -> tuple[int, ...]:
        """``special``: the tokenizer's own additions (a leading BOS), which a rendered chat
        template writes itself."""
        if not isinstance(text, str):
            raise InvalidInput("text_input must be a string")
        return tuple(self._tokenizer.encode(text, add_special_tokens=special).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=True))

    def token_text(self, token: int) -> str:
        """One token decoded alone, special tokens included (log-probabilities name tokens)."""
        return str(self._tokenizer.decode([token], skip_special_tokens=False))

    def token_id(self, token: str) -> int | None:
        found = self._tokenizer.token_to_id(token)
        return None if found is None else int(found)

    def detokenizer(self) -> Detokenizer:
        return Detokenizer(self)


class Detokenizer:
    def __init__(self, codec: TextCodec) -> None:
        self._codec = codec
        self._ids: list[int] = []
        self._context = 0  # where the decoded window starts: the tokens sent last time
        self._sent = 0  # tokens whose text has been sent
        self.text = ""  # what has been sent

    def add(self, token: int) -> str:
        """The new text ``token`` completes (may be empty)."""
        self._ids.append(token)
        return self._advance(hold_incomplete=True)

    def flush(self) -> str:
        """What is still held back, once no more tokens come (an incomplete last character
        stays as decoding renders it)."""
        return self._advance(hold_incomplete=False)

    def _advance(self, *, hold_incomplete: bool) -> str:
        decode = self._codec.decode
        before = decode(self._ids[self._context : self._sent])
        window = decode(self._ids[self._context :])
        if len(window) <= len(before) or not window.startswith(before):
            return ""
        if hold_incomplete and window.endswith(_INCOMPLETE):
            return ""
        piece = window[len(before) :]
        self._context, self._sent = self._sent, len(self._ids)
        self.text += piece
        return piece


def eos_from_files(folder: Path, codec: TextCodec | None) -> tuple[int, ...]:
    """The model's end-of-sequence ids: ``generation_config.json``'s, else ``config.json``'s,
    else the token ``tokenizer_config.json`` names as ``eos_token``."""
    for name in ("generation_config.json", "config.json"):
        found = _json(folder / name).get("eos_token_id")
        ids = found if isinstance(found, list) else [found]
        if ids and all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            return tuple(ids)
    token = _json(folder / "tokenizer_config.json").get("eos_token")
    if isinstance(token, dict):
        token = token.get("content")
    if codec is not None and isinstance(token, str):
        found_id = codec.token_id(token)
        if found_id is not None:
            return (found_id,)
    return ()


def _json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
