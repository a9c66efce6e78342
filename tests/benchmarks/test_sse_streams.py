"""The load generator's SSE reader takes an answer however TCP splits it: headers, chunk sizes,
events spanning chunks, the closing chunk."""

from __future__ import annotations

import json
import socket

import pytest

from benchmarks.sse_streams import _Stream


def _answer(events: list[dict], chunk_bytes: int) -> bytes:
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    chunks = [body[at : at + chunk_bytes] for at in range(0, len(body), chunk_bytes)]
    framed = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks)
    return b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + framed + b"0\r\n\r\n"


@pytest.mark.parametrize("chunk_bytes", [7, 1000])
def test_events_are_read_from_an_answer_split_anywhere(chunk_bytes: int) -> None:
    events = [{"output_ids": [t], "index": i} for i, t in enumerate((11, 12, 13))]
    answer = _answer(events, chunk_bytes)
    with socket.socket() as unused:
        stream = _Stream(unused)
        for at in range(len(answer)):  # one byte at a time
            stream.feed(answer[at : at + 1], now=float(at))
    assert stream.finished and stream.tokens == [11, 12, 13]
    assert len(stream.times) == 3 and stream.times == sorted(stream.times)


def test_an_error_answer_or_event_is_raised() -> None:
    with socket.socket() as unused:
        with pytest.raises(RuntimeError, match="429"):
            _Stream(unused).feed(b"HTTP/1.1 429 Too Many Requests\r\n\r\nfull", now=0.0)
        with pytest.raises(RuntimeError, match="the model failed"):
            _Stream(unused).feed(_answer([{"error": "the model failed"}], 100), now=0.0)
