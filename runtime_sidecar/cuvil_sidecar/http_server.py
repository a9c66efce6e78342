"""A small HTTP/1.1 server on asyncio streams, for the REST port and the metrics port.

Every connection is a coroutine on the event loop, never a thread, and every limit a slow or
hostile client could push is bounded: at most ``max_connections`` open at once (one more is
answered 503 and closed), the request line and headers must arrive within ``timeout_s`` (idle
keep-alive time included; a connection past it is closed without an answer) and within
``MAX_HEAD_BYTES``, and the body within ``timeout_s`` again
and within ``max_body_bytes`` (a larger ``Content-Length`` is answered 413 before any of it is
read). Bodies need a ``Content-Length``; a chunked one is answered 411. Connections are kept
alive as HTTP/1.1 says, and ``Expect: 100-continue`` is honoured (curl sends it for large
bodies). A client that hangs up while its request is served has the request cancelled: one
still queued for the model never runs. A response may stream (``HttpResponse.stream``, for
server-sent events): its parts go out as HTTP/1.1 chunks as they come, pulled by the server
(an async iterator) or pushed by their producer (``PushedStream``: no task wakes per part),
and a client that hangs up meanwhile has the stream closed (``aclose``), which ends whatever
produced it.
Errors of the server's own (bad framing) are answered
``{"error": "..."}`` with a 4xx status, and the connection is closed where its framing can no
longer be trusted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

log = logging.getLogger("cuvil_sidecar.http")

MAX_HEAD_BYTES = 64 * 1024  # request line and headers together
REASONS = {
    100: "Continue",
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    409: "Conflict",
    411: "Length Required",
    413: "Content Too Large",
    415: "Unsupported Media Type",
    429: "Too Many Requests",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    501: "Not Implemented",
    503: "Service Unavailable",
    504: "Gateway Timeout",
    505: "HTTP Version Not Supported",
}


@dataclass(frozen=True)
class HttpRequest:
    method: str
    path: str  # percent-encoded, without the query
    query: str
    headers: Mapping[str, str]  # names in lower case
    body: bytes
    peer: Any = None  # the client's address, as the socket gives it


class PushedStream(Protocol):
    """A response body whose parts are pushed as they come, rather than pulled by the server
    with ``async for``: ``start(write)`` hands over the function that sends a part (as one
    chunk, at once, on the event loop) and returns what completes when the last part is
    written; ``aclose()`` ends it early (the client hung up). The transport holds parts the
    client has not read yet, so a pushed stream's parts must be bounded in all (a generation's
    tokens are)."""

    def start(self, write: Callable[[bytes], None]) -> Awaitable[None]: ...

    async def aclose(self) -> None: ...


@dataclass
class HttpResponse:
    status: int
    body: Sequence[bytes | memoryview] = ()
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)
    # parts sent as chunks as they come, instead of ``body``; closed when the client hangs up
    stream: AsyncIterator[bytes] | PushedStream | None = None


Handler = Callable[[HttpRequest], Awaitable[HttpResponse]]


def json_response(status: int, value: Any) -> HttpResponse:
    return HttpResponse(status, [json.dumps(value, separators=(",", ":")).encode()])


def error_response(status: int, message: str) -> HttpResponse:
    return json_response(status, {"error": message})


class _Refused(Exception):
    """The request's framing is wrong: answer ``status`` and close the connection."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class HttpLimits:
    max_connections: int = 1024
    timeout_s: float = 30.0
    max_body_bytes: int = 64 * 2**20


class HttpServer:
    def __init__(self, handler: Handler, limits: HttpLimits, name: str = "http") -> None:
        self._handler = handler
        self._limits = limits
        self.name = name
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[Any]] = set()

    @property
    def connections(self) -> int:
        return len(self._connections)

    async def start(self, host: str, port: int, tls: ssl.SSLContext | None = None) -> int:
        """Listen on ``host:port`` (0: any free port); returns the bound port."""
        loop = asyncio.get_running_loop()

        def connection() -> _Connection:
            return _Connection(asyncio.StreamReader(MAX_HEAD_BYTES, loop), self._accept, loop)

        self._server = await loop.create_server(connection, host, port, ssl=tls)
        return int(self._server.sockets[0].getsockname()[1])

    def stop_accepting(self) -> None:
        """Take no new connection; those open go on (``stop`` ends them)."""
        if self._server is not None:
            self._server.close()

    async def stop(self) -> None:
        """End every connection, answered or not, and stop listening."""
        if self._server is None:
            return
        self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        await self._server.wait_closed()
        self._server = None

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if len(self._connections) >= self._limits.max_connections:
            await self._send(
                writer,
                error_response(503, f"{self.name}: too many connections, try again later"),
                close=True,
            )
            await _close(writer)
            return
        self._connections.add(task)
        try:
            while await self._serve_one(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError):
            pass  # the client went away or stalled: nothing more to say to it
        except asyncio.CancelledError:
            pass  # the server is stopping
        finally:
            self._connections.discard(task)
            await _close(writer)

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """One request and its answer; False when the connection is to be closed."""
        timeout = self._limits.timeout_s
        try:
            async with asyncio.timeout(timeout):
                head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            limit = f"more than {MAX_HEAD_BYTES} bytes"
            await self._send(writer, error_response(431, f"request headers take {limit}"), True)
            return False
        except asyncio.IncompleteReadError as error:
            if error.partial.strip():
                await self._send(writer, error_response(400, "the request ended early"), True)
            return False
        except TimeoutError:
            # idle, or headers trickling in: closed without an answer, which a keep-alive
            # client would otherwise take for the answer to its next request
            return False
        try:
            method, target, version, headers = _parse_head(head)
            keep_alive = _keep_alive(version, headers)
            size = self._body_size(headers)
            if headers.get("expect", "").lower() == "100-continue" and size:
                writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            async with asyncio.timeout(timeout):
                body = await reader.readexactly(size) if size else b""
        except _Refused as refused:
            await self._send(writer, error_response(refused.status, str(refused)), close=True)
            return False
        except TimeoutError:
            await self._send(writer, error_response(408, "the request body came too slowly"), True)
            return False
        path, _, query = target.partition("?")
        request = HttpRequest(method, path, query, headers, body, writer.get_extra_info("peername"))
        handling = asyncio.ensure_future(self._handler(request))
        connection = writer.transport.get_protocol()
        assert isinstance(connection, _Connection)
        try:
            await asyncio.sleep(0)  # its first step: one answered without waiting is answered
            if not handling.done():
                first = asyncio.FIRST_COMPLETED
                await asyncio.wait((handling, connection.hung_up), return_when=first)
        except asyncio.CancelledError:  # the server is stopping: so is the request
            handling.cancel()
            raise
        if not handling.done():  # the client is gone: its request is dropped, unrun if queued
            handling.cancel()
            await asyncio.gather(handling, return_exceptions=True)
            return False
        try:
            response = handling.result()
        except Exception as error:  # the handler's own errors are its to answer; this is a bug
            log.exception("%s %s failed", method, path)
            response = error_response(500, f"internal error: {error!r}")
        if response.stream is not None:
            return await self._send_stream(writer, response, connection.hung_up) and keep_alive
        await self._send(writer, response, close=not keep_alive)
        return keep_alive

    def _body_size(self, headers: Mapping[str, str]) -> int:
        if "transfer-encoding" in headers:
            raise _Refused(411, "chunked request bodies are not accepted: send Content-Length")
        text = headers.get("content-length", "0").strip()
        if not text.isdigit() or len(text) > 18:
            raise _Refused(400, f"Content-Length {text[:40]!r} is not a byte count")
        size = int(text)
        if size > self._limits.max_body_bytes:
            raise _Refused(
                413,
                f"the request body is {size} bytes, more than the "
                f"{self._limits.max_body_bytes}-byte limit",
            )
        return size

    async def _send(
        self, writer: asyncio.StreamWriter, response: HttpResponse, close: bool
    ) -> None:
        length = sum(memoryview(part).nbytes for part in response.body)
        lines = [
            f"HTTP/1.1 {response.status} {REASONS.get(response.status, 'Status')}",
            f"Content-Type: {response.content_type}",
            f"Content-Length: {length}",
            *(f"{key}: {value}" for key, value in response.headers.items()),
        ]
        if close:
            lines.append("Connection: close")
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        writer.writelines(response.body)
        async with asyncio.timeout(self._limits.timeout_s):
            await writer.drain()

    async def _send_stream(
        self, writer: asyncio.StreamWriter, response: HttpResponse, hung_up: asyncio.Future[None]
    ) -> bool:
        """The response's stream as chunks; False when the client hung up before its end."""
        stream = response.stream
        assert stream is not None
        lines = [
            f"HTTP/1.1 {response.status} {REASONS.get(response.status, 'Status')}",
            f"Content-Type: {response.content_type}",
            "Transfer-Encoding: chunked",
            "Cache-Control: no-cache",
            *(f"{key}: {value}" for key, value in response.headers.items()),
        ]
        try:
            writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
            if isinstance(stream, AsyncIterator):
                pumping = asyncio.ensure_future(self._pump(writer, stream))
            else:
                pumping = asyncio.ensure_future(self._pushed(writer, stream))
            await asyncio.wait((pumping, hung_up), return_when=asyncio.FIRST_COMPLETED)
            if not pumping.done():  # the client hung up: the stream is cancelled where it waits
                pumping.cancel()
                await asyncio.gather(pumping, return_exceptions=True)
                return False
            pumping.result()
            return True
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _pump(self, writer: asyncio.StreamWriter, stream: AsyncIterator[bytes]) -> None:
        """Each part of the stream as a chunk, then the last chunk. One task for the whole
        stream, raced once against the hang-up, rather than a task and a race per part (a
        generation stream sends a part per token); a part waits for the socket only when
        the transport still holds unsent bytes (the peer reads slower than it is written)."""
        transport = writer.transport
        async for part in stream:
            if part:
                writer.write(_chunk(part))
                if transport.get_write_buffer_size():
                    async with asyncio.timeout(self._limits.timeout_s):
                        await writer.drain()
        await self._last_chunk(writer)

    async def _pushed(self, writer: asyncio.StreamWriter, stream: PushedStream) -> None:
        """A pushed stream's parts as chunks, each written as it is pushed, then the last
        chunk. Parts pushed once the connection is closing are dropped (the hang-up ends the
        stream soon after)."""
        transport = writer.transport

        def write(part: bytes) -> None:
            if part and not transport.is_closing():
                transport.write(_chunk(part))

        await stream.start(write)
        await self._last_chunk(writer)

    async def _last_chunk(self, writer: asyncio.StreamWriter) -> None:
        writer.write(b"0\r\n\r\n")
        async with asyncio.timeout(self._limits.timeout_s):
            await writer.drain()


def _chunk(part: bytes) -> bytes:
    """One part of a streamed response in HTTP/1.1's chunked framing."""
    return b"%x\r\n%s\r\n" % (len(part), part)


class _Connection(asyncio.StreamReaderProtocol):
    """asyncio's stream protocol, telling when the client hangs up: the end of what it sends
    (it shut its side, or closed) or the connection lost. HTTP clients do not half-close while
    they wait for an answer, so either means nobody waits for one any more."""

    def __init__(
        self, reader: asyncio.StreamReader, accept: Any, loop: asyncio.AbstractEventLoop
    ) -> None:
        super().__init__(reader, accept, loop=loop)
        self.hung_up: asyncio.Future[None] = loop.create_future()

    def eof_received(self) -> bool:
        self._hang_up()
        return bool(super().eof_received())

    def connection_lost(self, exc: Exception | None) -> None:
        self._hang_up()
        super().connection_lost(exc)

    def _hang_up(self) -> None:
        if not self.hung_up.done():
            self.hung_up.set_result(None)


def _parse_head(head: bytes) -> tuple[str, str, str, dict[str, str]]:
    try:
        text = head.decode("latin-1")
    except UnicodeDecodeError:  # latin-1 decodes every byte; kept for clarity of intent
        raise _Refused(400, "the request head is not text") from None
    request_line, *header_lines = text[:-4].split("\r\n")
    parts = request_line.split(" ")
    if len(parts) != 3 or not parts[0].isalpha() or not parts[1].startswith("/"):
        raise _Refused(400, f"not an HTTP request line: {request_line[:80]!r}")
    method, target, version = parts
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        raise _Refused(505, f"{version[:20]!r} is not served here: use HTTP/1.1")
    headers: dict[str, str] = {}
    for line in header_lines:
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip():
            raise _Refused(400, f"malformed header line {line[:80]!r}")
        key = name.lower()
        if key == "content-length" and key in headers and headers[key] != value.strip():
            raise _Refused(400, "conflicting Content-Length headers")
        headers[key] = value.strip()
    return method, target, version, headers


def _keep_alive(version: str, headers: Mapping[str, str]) -> bool:
    connection = headers.get("connection", "").lower()
    if version == "HTTP/1.0":
        return connection == "keep-alive"
    return connection != "close"


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    try:
        async with asyncio.timeout(1.0):
            await writer.wait_closed()
    except (ConnectionError, TimeoutError, ssl.SSLError):
        pass
