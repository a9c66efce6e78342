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
            reader, writer = await _request(port, "/first")
            await reader.readuntil(b"\r\n\r\n")
            await reader.readuntil(b"\r\n")  # the stream is running
            writer.close()
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
