"""Many server-sent-event streams read by one thread: the load generator of
``generate_streams.py``.

Each request is one HTTP/1.1 POST on its own connection; the answers (chunked transfer
encoding, ``data: {json}`` events) are read as they come with a selector over every socket,
and each event is stamped with ``time.perf_counter()`` when its bytes arrive. One thread with
non-blocking sockets costs the host a fraction of what a thread per stream with
``http.client`` does, which matters when the load generator shares the served model's cores.
"""

from __future__ import annotations

import json
import selectors
import socket
import time
from dataclasses import dataclass, field
from typing import Any

READ_BYTES = 1 << 16


@dataclass
class _Stream:
    sock: socket.socket
    buffer: bytes = b""
    headers_done: bool = False
    chunk_left: int = -1  # bytes of the current chunk still to come; -1: a size line is next
    body: bytes = b""  # decoded chunk bytes not yet split into events
    finished: bool = False
    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)

    def feed(self, data: bytes, now: float) -> None:
        self.buffer += data
        if not self.headers_done:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            status = self.buffer.split(b"\r\n", 1)[0]
            if b" 200 " not in status + b" ":
                raise RuntimeError(f"the server answered {status!r}: {self.buffer[end + 4 :]!r}")
            self.buffer = self.buffer[end + 4 :]
            self.headers_done = True
        self._unchunk()
        self._events(now)

    def _unchunk(self) -> None:
        while self.buffer and not self.finished:  # after the last chunk: its empty trailer
            if self.chunk_left < 0:
                end = self.buffer.find(b"\r\n")
                if end < 0:
                    return
                size = int(self.buffer[:end].split(b";", 1)[0], 16)
                self.buffer = self.buffer[end + 2 :]
                if size == 0:
                    self.finished = True
                    return
                self.chunk_left = size
            taken = self.buffer[: self.chunk_left]
            self.body += taken
            self.buffer = self.buffer[len(taken) :]
            self.chunk_left -= len(taken)
            if self.chunk_left:
                return
            if len(self.buffer) < 2:  # the chunk's closing CRLF
                self.chunk_left = 0
                return
            self.buffer = self.buffer[2:]
            self.chunk_left = -1

    def _events(self, now: float) -> None:
        while (end := self.body.find(b"\n\n")) >= 0:
            event, self.body = self.body[:end], self.body[end + 2 :]
            if not event.startswith(b"data: "):
                continue
            value = json.loads(event[6:])
            if "error" in value:
                raise RuntimeError(value["error"])
            self.tokens += value["output_ids"]
            self.times.append(now)


def read_streams(
    port: int, path: str, bodies: list[dict[str, Any]], timeout_s: float = 600.0
) -> list[tuple[list[int], list[float]]]:
    """POST each body to ``path`` on 127.0.0.1:``port`` at once; every stream's tokens and
    the ``perf_counter`` time each event arrived, in the bodies' order."""
    selector = selectors.DefaultSelector()
    streams = []
    for body in bodies:
        payload = json.dumps(body).encode()
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        sock.setblocking(False)
        stream = _Stream(sock)
        selector.register(sock, selectors.EVENT_READ, stream)
        streams.append(stream)
    deadline = time.monotonic() + timeout_s
    open_streams = len(streams)
    try:
        while open_streams:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{open_streams} stream(s) did not finish in {timeout_s} s")
            for key, _ in selector.select(timeout=1.0):
                stream = key.data
                data = stream.sock.recv(READ_BYTES)
                now = time.perf_counter()
                if data:
                    stream.feed(data, now)
                if stream.finished or not data:
                    if not stream.finished:
                        raise RuntimeError("the server closed a stream before its end")
                    selector.unregister(stream.sock)
                    open_streams -= 1
    finally:
        for stream in streams:
            stream.sock.close()
        selector.close()
    return [(stream.tokens, stream.times) for stream in streams]
