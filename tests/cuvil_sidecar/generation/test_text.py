"""The incremental detokenizer against decoding the whole output at once."""

from __future__ import annotations

from pathlib import Path

import pytest
from cuvil_sidecar.generation.text import TextCodec

from tests.cuvil_sidecar.generation.checkpoints import train_tokenizer

TEXTS = [
    "plain words, spaced and punctuated: the model says hello to the world.",
    "multi-byte characters split across tokens: naïve café, 東京タワー, emoji 🚀🎉 done",
    "  leading spaces\tand tabs\nand new lines  ",
]


@pytest.fixture(scope="module")
def codec(tmp_path_factory: pytest.TempPathFactory) -> TextCodec:
    path = Path(tmp_path_factory.mktemp("tok")) / "tokenizer.json"
    train_tokenizer().save(str(path))  # type: ignore[attr-defined]
    return TextCodec(path)


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_pieces_join_to_the_whole_decoding(codec: TextCodec, text: str) -> None:
    ids = list(codec.encode(text))
    detokenizer = codec.detokenizer()
    pieces = [detokenizer.add(token) for token in ids]
    pieces.append(detokenizer.flush())
    whole = codec.decode(ids)
    assert "".join(pieces) == whole == detokenizer.text
    assert not any("\ufffd" in piece for piece in pieces)  # no half character is ever sent


def test_single_bytes_of_one_character_are_held_until_it_is_whole(codec: TextCodec) -> None:
    byte_tokens = [codec.token_id(ch) for ch in ("æ", "Ŀ", "±")]  # "東" as byte-level symbols
    if any(token is None for token in byte_tokens):
        pytest.fail("the byte-level alphabet lacks the bytes of 東")
    detokenizer = codec.detokenizer()
    assert detokenizer.add(byte_tokens[0]) == ""  # type: ignore[arg-type]
    assert detokenizer.add(byte_tokens[1]) == ""  # type: ignore[arg-type]
    assert detokenizer.add(byte_tokens[2]) == "東"  # type: ignore[arg-type]


def test_cost_per_token_does_not_grow_with_the_output(codec: TextCodec) -> None:
    calls: list[int] = []
    decode = codec.decode

    def counting(ids: list[int]) -> str:
        calls.append(len(ids))
        return decode(ids)

    codec.decode = counting  # type: ignore[method-assign]
    try:
        detokenizer = codec.detokenizer()
        for token in list(codec.encode(TEXTS[0] * 20)):
            detokenizer.add(token)
    finally:
        del codec.decode
    assert len(calls) > 200 and max(calls) <= 8  # a window of a few tokens, never the output
