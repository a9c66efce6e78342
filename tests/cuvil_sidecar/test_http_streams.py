"""Streamed HTTP responses (server-sent events' framing): parts go out as chunks in order when
the client reads slower than the server writes, and a client that hangs up mid-stream has the
stream closed while the server goes on serving."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

from cuvil_sidecar.http_server import HttpLimits, HttpRequest, HttpResponse, HttpServer

PART_BYTES = 64 * 1024
PARTS = 160  # 10 MB: more than the sockets' buffers hold, so the transport buffers


def _part(index: int) -> bytes:
    return index.to_bytes(4, "big") * (PART_BYTES // 4)


async def _read_chunks(reader: asyncio.StreamReader) -> list[bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"Transfer-Encoding: chunked" in head
    chunks = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).strip(), 16)
        data = await reader.readexactly(size + 2)
        if not size:
            return chunks
        chunks.append(data[:-2])


async def _request(port: int, path: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)  # a window that fills
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    reader, writer = await asyncio.open_connection(sock=sock, limit=2**20)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: test\r\n\r\n".encode())
    await writer.drain()
    return reader, writer


async def _hang_up_mid_stream(port: int, path: str) -> None:
    """Request ``path``, read up to its first chunk's size line (the stream is running), hang up."""
    reader, writer = await _request(port, path)
    await reader.readuntil(b"\r\n\r\n")
    await reader.readuntil(b"\r\n")
    writer.close()


def test_parts_arrive_whole_and_in_order_past_the_socket_buffers() -> None:
    closed: list[str] = []
    produced: list[int] = []

    async def parts(count: int, tag: str) -> AsyncIterator[bytes]:
        try:
            for index in range(count):
                produced.append(index)
                yield _part(index)
                if index % 16 == 0:
                    await asyncio.sleep(0)
        finally:
            closed.append(tag)

    async def handler(request: HttpRequest) -> HttpResponse:
        count = PARTS if request.path == "/big" else 3
        return HttpResponse(
            200, content_type="text/event-stream", stream=parts(count, request.path)
        )

    async def run() -> tuple[list[bytes], list[bytes], int]:
        server = HttpServer(handler, HttpLimits(timeout_s=10.0))
        port = await server.start("127.0.0.1", 0)
        try:
            reader, writer = await _request(port, "/big")
            await asyncio.sleep(0.5)  # the client reads nothing while the server writes
            waiting = len(produced)
            big = await _read_chunks(reader)
            writer.close()
            reader, writer = await _request(port, "/small")
            small = await _read_chunks(reader)
            writer.close()
            return big, small, waiting
        finally:
            await server.stop()

    big, small, waiting = asyncio.run(run())
    # the stream waited for the socket rather than queue every part in the server's memory
    assert waiting < PARTS, waiting
    assert big == [_part(index) for index in range(PARTS)]
    assert small == [_part(index) for index in range(3)]
    assert closed == ["/big", "/small"]


def test_a_client_hanging_up_mid_stream_closes_the_stream_and_the_server_goes_on() -> None:
    events: dict[str, asyncio.Event] = {}  # per request path: set when its stream is closed

    async def endless(path: str) -> AsyncIterator[bytes]:
        try:
            index = 0
            while True:
                yield _part(index % 7)[:64]
                index += 1
                await asyncio.sleep(0.001)
        finally:
            events[path].set()

    async def handler(request: HttpRequest) -> HttpResponse:
        events[request.path] = asyncio.Event()
        return HttpResponse(200, content_type="text/event-stream", stream=endless(request.path))

    async def run() -> bool:
        server = HttpServer(handler, HttpLimits(timeout_s=10.0))
        port = await server.start("127.0.0.1", 0)
        try:
            await _hang_up_mid_stream(port, "/first")
            await asyncio.wait_for(events["/first"].wait(), 5.0)
            reader, writer = await _request(port, "/second")
            await reader.readuntil(b"\r\n\r\n")
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            writer.close()
            await asyncio.wait_for(events["/second"].wait(), 5.0)
            return size == 64
        finally:
            await server.stop()

    assert asyncio.run(run())


class _Pushed:
    """A pushed stream (http_server.PushedStream): ``parts`` parts pushed from loop callbacks,
    one per ``interval_s``, the last ending it; ``None``: it never ends by itself."""

    def __init__(self, parts: int | None, interval_s: float = 0.001) -> None:
        self.parts, self.interval_s = parts, interval_s
        self.pushed = 0
        self.closed = asyncio.Event()
        self._ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._timer: asyncio.TimerHandle | None = None

    def start(self, write):  # type: ignore[no-untyped-def]
        self._write = write
        self._next()
        return self._ended

    def _next(self) -> None:
        self._write(_part(self.pushed)[:64])
        self.pushed += 1
        if self.parts is not None and self.pushed == self.parts:
            self._ended.set_result(None)
            return
        self._timer = asyncio.get_running_loop().call_later(self.interval_s, self._next)

    async def aclose(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self.closed.set()


def test_pushed_parts_arrive_in_order_then_the_last_chunk() -> None:
    async def run() -> tuple[list[bytes], bool]:
        pushed: list[_Pushed] = []

        async def handler(request: HttpRequest) -> HttpResponse:
            pushed.append(_Pushed(40))
            return HttpResponse(200, content_type="text/event-stream", stream=pushed[-1])

        server = HttpServer(handler, HttpLimits(timeout_s=10.0))
        port = await server.start("127.0.0.1", 0)
        try:
            reader, writer = await _request(port, "/pushed")
            chunks = await _read_chunks(reader)
            writer.close()
            await asyncio.wait_for(pushed[0].closed.wait(), 5.0)  # closed once ended too
            return chunks, pushed[0].pushed == 40
        finally:
            await server.stop()

    chunks, all_pushed = asyncio.run(run())
    assert chunks == [_part(index)[:64] for index in range(40)]
    assert all_pushed


def test_a_client_hanging_up_closes_a_pushed_stream_and_the_server_goes_on() -> None:
    async def run() -> tuple[bool, list[bytes]]:
        pushed: list[_Pushed] = []

        async def handler(request: HttpRequest) -> HttpResponse:
            pushed.append(_Pushed(None if request.path == "/endless" else 3))
            return HttpResponse(200, content_type="text/event-stream", stream=pushed[-1])

        server = HttpServer(handler, HttpLimits(timeout_s=10.0))
        port = await server.start("127.0.0.1", 0)
        try:
            await _hang_up_mid_stream(port, "/endless")
            await asyncio.wait_for(pushed[0].closed.wait(), 5.0)
            stopped_at = pushed[0].pushed
            await asyncio.sleep(0.05)
            still = pushed[0].pushed == stopped_at  # nothing pushed once closed
            reader, writer = await _request(port, "/three")
            chunks = await _read_chunks(reader)
            writer.close()
            return still, chunks
        finally:
            await server.stop()

    still, chunks = asyncio.run(run())
    assert still
    assert chunks == [_part(index)[:64] for index in range(3)]
