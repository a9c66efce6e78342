"""The Python half of the native gRPC front end: gRPC C++ (``native/frontend.cc``) owns the
sockets, HTTP/2, health and reflection; each unary call comes here as bytes and is answered by
the same servicer methods the grpcio server runs.

A call arrives on one of gRPC's threads: its request is parsed there, straight from gRPC's
buffer, its metadata copied out, and the call handed to the event loop, where the servicer
method runs (as a task only once it has to wait); its response (or status) goes back through
``cuvil_frontend_finish``, which may be called from any thread. Against grpcio's asyncio server,
which makes every call a task on the loop and runs its own bookkeeping under the GIL, this
leaves less Python per call; the side-by-side figures are in benchmarks/README.md
(sidecar_load.py, its front ends side by side).

A large ModelInfer reaches Python already split (``Method.tensor_field``): the native side
copies its tensors' bytes once, off the GIL, from gRPC's slices into one buffer of their own,
each at a 64-byte boundary, and Python parses only the rest of the message and takes the
buffer over (freed when the last tensor made from it goes). A large request arrives in many
slices; joining them into one string and copying each tensor out of it would copy every byte
twice more.

A method marked ``streaming`` (ModelStreamInfer) is a bidirectional stream on the native side;
each message read from it comes here as a call of its own, answered by ``handler`` like a unary
call, and the answer is written to the stream (an abort status ends the stream). A handler may
answer a message with several answers instead (a generation model's, one per token: Triton's
decoupled mode), as an async generator or as a ``PushedAnswers`` that writes each as it comes
(no task woken per answer): each answer is written to the stream as it comes
(``cuvil_frontend_write``; those of one turn of the event loop are sent together, ``TurnWrites``),
and the message is finished with nothing more once the answers end; they are closed as soon
as a write finds the stream cancelled or failed, which frees what they hold (a generation's
KV slot). Whether a call's client is gone (a unary call cancelled, a stream
cancelled, a hang-up, a deadline past) is asked of the native side through the call's context
(``NativeContext.client_gone``): the data plane drops a request unrun whose client is gone
when its turn comes, so a cancelled stream stops instead of running the messages it had
already handed over.

Every call is finished exactly once: with the method's answer, with its abort status, INTERNAL
for a bug, INVALID_ARGUMENT for bytes that do not parse, or UNAVAILABLE when the server stops
before the method ran to the end.
"""

from __future__ import annotations

import asyncio
import contextvars
import ctypes
import logging
import struct
import threading
import time
import weakref
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol, runtime_checkable

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from cuvil_sidecar import handoff, tracing
from cuvil_sidecar.native import DISPATCH, load
from cuvil_sidecar.tls import TlsFiles
from cuvil_sidecar.wire import SPLIT_FROM

log = logging.getLogger("cuvil_sidecar.native_frontend")

_LENGTH = struct.Struct("=I")
PEER = ":peer"  # the native side appends the peer's address to the metadata under this name


@dataclass(frozen=True)
class Method:
    path: str  # "/package.Service/Method"
    request_type: Any  # the protobuf message class of its request
    handler: Callable[[Any, Any], Awaitable[Any]]  # async (request, context) -> response
    # request bytes -> request (default: FromString); they are lent for the call, so the
    # request must keep nothing of them
    parse: Callable[[memoryview], Any] | None = None
    # the field number of its tensors' bytes (ModelInfer's raw_input_contents: wire.py), cut out
    # of requests of ``split_from`` bytes or more by the native side; such a request is made by
    # ``from_split(rest, tensors)``: the message's other bytes (lent, as for ``parse``) and each
    # cut field's contents, in order, as uint8 arrays it owns
    tensor_field: int = 0
    from_split: Callable[[memoryview, list[np.ndarray]], Any] | None = None
    streaming: bool = False  # a bidirectional stream; ``handler`` answers each message


@dataclass(frozen=True)
class Unparsed:
    """A request whose bytes did not parse, and why."""

    error: Exception


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


@runtime_checkable
class PushedAnswers(Protocol):
    """A stream message's answers written by their producer as they come, rather than pulled
    with ``async for``: ``start(write)`` hands over the function that writes one (serialized;
    False once the stream takes no more) and returns what completes after the last;
    ``aclose()`` ends it early."""

    def start(self, write: Callable[[bytes], bool]) -> Awaitable[None]: ...

    async def aclose(self) -> None: ...


class TurnWrites:
    """The stream answers written during one turn of the event loop, sent at its end: a
    stream's answers of one turn (a decode step's tokens for the requests it carries) start its
    writing once from the loop's thread, and the rest follow from gRPC's threads as each write
    completes. Started one by one from the loop, each answer cost it about 0.1 ms of gRPC's
    work."""

    def __init__(self) -> None:
        self._calls: list[NativeCall] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = 0

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop, self._thread = loop, threading.get_ident()

    def add(self, call: NativeCall) -> bool:
        """Send ``call``'s answers at the end of this turn; False off the loop's thread (the
        caller sends them at once)."""
        if self._loop is None or threading.get_ident() != self._thread:
            return False
        if not self._calls:
            self._loop.call_soon(self._send)
        self._calls.append(call)
        return True

    def _send(self) -> None:
        calls, self._calls = self._calls, []
        for call in calls:
            call.send()


class NativeCall:
    """A call handed over by the native side, until it is finished: finished exactly once, and
    asked whether its client is gone (``client_gone``) only while not finished, since the native
    side frees the call when it is; the two are serialized, as they may run on any thread. A
    stream's message may first write answers (``write``), sent at the end of the loop's turn
    (``TurnWrites``), and before the message is finished in any case."""

    __slots__ = ("_answers", "_call", "_finished", "_gone", "_library", "_lock", "_turn")

    def __init__(self, library: ctypes.CDLL, call: int, turn: TurnWrites | None = None) -> None:
        self._library = library
        self._call = call
        self._lock = threading.Lock()
        self._finished = False
        self._answers: list[bytes] = []  # written, not yet handed to the native side
        self._gone = False  # a write found the stream failed or cancelled
        self._turn = turn

    def client_gone(self) -> bool:
        """Whether the client cancelled the call (or the stream it is a message of), hung up,
        or let its deadline pass; True once the call is finished."""
        with self._lock:
            return (
                self._finished
                or self._gone
                or bool(self._library.cuvil_frontend_cancelled(self._call))
            )

    def write(self, answer: bytes) -> bool:
        """One answer to a stream's message, more to follow, sent with the turn's others;
        False when nothing more can be written (its stream failed or was cancelled, as the
        answers sent before found, or the call is finished)."""
        with self._lock:
            if self._finished or self._gone:
                return False
            self._answers.append(answer)
            first = len(self._answers) == 1
        if first and (self._turn is None or not self._turn.add(self)):
            self.send()
        return True

    def send(self) -> None:
        """Hands the written answers to the native side: all but the last wait for it."""
        with self._lock:
            if not self._finished:
                self._send_answers()

    def _send_answers(self) -> None:
        answers, self._answers = self._answers, []
        for index, answer in enumerate(answers):
            more = index < len(answers) - 1
            if not self._library.cuvil_frontend_write(self._call, answer, len(answer), more):
                self._gone = True
                return

    def finish(self, code: grpc.StatusCode, details: str, response: bytes | None) -> None:
        """Ends the call, its written answers sent first: with ``response`` (None: a stream's
        message that wrote its answers), or with the status ``code`` and ``details``."""
        with self._lock:
            if self._finished:
                return
            if code == grpc.StatusCode.OK and self._answers:
                self._send_answers()
            self._finished = True
            self._library.cuvil_frontend_finish(
                self._call,
                code.value[0],
                details.encode(errors="replace"),
                response,
                0 if response is None else len(response),
            )


class NativeContext:
    """The part of ``grpc.aio.ServicerContext`` the servicer uses, and ``client_gone``: whether
    the call's client is gone, which the data plane asks before the request runs."""

    def __init__(
        self, deadline_ns: int = 0, metadata: bytes = b"", call: NativeCall | None = None
    ) -> None:
        self._deadline_ns = deadline_ns
        self._metadata = metadata
        self.client_gone = call.client_gone if call is not None else None
        self.write = call.write if call is not None else None

    def invocation_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        return tuple(pair for pair in parse_metadata(self._metadata) if pair[0] != PEER)

    def peer(self) -> str:
        """As grpc names it: ``ipv4:127.0.0.1:5000``, ``ipv6:[::1]:5000``, ``unix:PATH``."""
        for key, value in parse_metadata(self._metadata):
            if key == PEER:
                return value if isinstance(value, str) else value.decode("latin-1")
        return ""

    async def abort(self, code: grpc.StatusCode, details: str = "") -> NoReturn:
        raise Aborted(code, details)

    def time_remaining(self) -> float | None:
        """Seconds until the client's deadline (negative once passed), None without one."""
        if not self._deadline_ns:
            return None
        return (self._deadline_ns - time.time_ns()) / 1e9


def parse_metadata(blob: bytes) -> tuple[tuple[str, str | bytes], ...]:
    """The native side's metadata encoding (each key and value as a uint32 length and its
    bytes) -> grpc's (key, value) pairs; values of ``-bin`` keys stay bytes."""
    fields = []
    at = 0
    while at < len(blob):
        (size,) = _LENGTH.unpack_from(blob, at)
        fields.append(blob[at + _LENGTH.size : at + _LENGTH.size + size])
        at += _LENGTH.size + size
    pairs = []
    for key, value in zip(fields[::2], fields[1::2], strict=True):
        name = key.decode("latin-1")
        pairs.append((name, value if name.endswith("-bin") else value.decode("latin-1")))
    return tuple(pairs)


class NativeFrontend:
    """One gRPC C++ server serving ``methods``; ``descriptors`` are the protobuf files
    reflection describes."""

    name = "native"

    def __init__(
        self,
        methods: Sequence[Method],
        descriptors: Sequence[Any],
        max_message_bytes: int,
        split_from: int = SPLIT_FROM,
        tls: TlsFiles | None = None,
    ) -> None:
        self._library = load()
        self._tls = tls.native_arguments() if tls is not None else (b"", b"", b"", 0)
        self._methods = tuple(methods)
        self._max_message_bytes = max_message_bytes
        self._split_from = split_from
        for descriptor in descriptors:
            self._library.cuvil_frontend_add_descriptor(
                descriptor.name.encode(), descriptor.serialized_pb, len(descriptor.serialized_pb)
            )
        self._dispatch = DISPATCH(self._on_call)  # kept: gRPC calls it until the server stops
        self._handle: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._parked: set[asyncio.Future[Any]] = set()  # what not-yet-task calls wait for
        self._alive = 0  # calls begun and not yet finished, wherever they run
        self._alive_lock = threading.Lock()
        self._loop_thread = 0
        self._turn = TurnWrites()  # stream answers of one turn of the loop, sent together

    async def start(self, address: str) -> int:
        """Listen; returns the bound port. Call from the event loop that serves the calls."""
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._turn.bind(self._loop)
        names = b"".join(method.path.encode() + b"\0" for method in self._methods)
        fields = (ctypes.c_int * len(self._methods))(*(m.tensor_field for m in self._methods))
        streaming = (ctypes.c_int * len(self._methods))(*(m.streaming for m in self._methods))
        error = ctypes.create_string_buffer(512)
        handle = self._library.cuvil_frontend_start(
            address.encode(),
            names,
            len(names),
            fields,
            streaming,
            self._split_from,
            self._max_message_bytes,
            *self._tls,
            self._dispatch,
            error,
            512,
        )
        if not handle:
            raise OSError(error.value.decode(errors="replace") or f"cannot serve on {address}")
        self._handle = handle
        return int(self._library.cuvil_frontend_port(handle))

    async def set_serving(self, service: str, serving: bool) -> None:
        if self._handle is not None:
            self._library.cuvil_frontend_set_serving(self._handle, service.encode(), serving)

    async def stop(self, grace_s: float) -> None:
        """Take no new calls; give those in flight ``grace_s``, then answer the rest
        UNAVAILABLE and free the server."""
        handle, self._handle = self._handle, None
        if handle is None:
            return
        loop = asyncio.get_running_loop()
        stopped = loop.run_in_executor(
            None, self._library.cuvil_frontend_stop, handle, int(grace_s * 1000)
        )
        deadline = loop.time() + grace_s
        while (self._tasks or self._parked) and loop.time() < deadline:
            await asyncio.wait(self._tasks | self._parked, timeout=deadline - loop.time())
        for waiting in [*self._parked, *self._tasks]:
            waiting.cancel()  # a parked call becomes a task that answers UNAVAILABLE
        await stopped  # gRPC has no call left to hand over
        while self._tasks or self._parked:
            await asyncio.gather(*self._tasks, asyncio.sleep(0), return_exceptions=True)
        while self._alive:  # calls on a worker finish once their run ends
            for waiting in [*self._parked, *self._tasks]:
                waiting.cancel()
            await asyncio.sleep(0.005)
        self._library.cuvil_frontend_free(handle)  # only once every call is finished

    # --- on gRPC's threads ---------------------------------------------------------------------

    def _on_call(
        self,
        call: int,
        index: int,
        data: int,
        size: int,
        metadata: int,
        metadata_size: int,
        tensors: int | None,
        entries: Any,
        count: int,
        deadline_ns: int,
    ) -> None:
        try:
            owned = self._take_tensors(tensors, entries, count) if count >= 0 else None
            request = self._parse(self._methods[index], data, size, owned)
            blob = ctypes.string_at(metadata, metadata_size) if metadata_size else b""
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._begin, call, index, request, blob, deadline_ns)
        except BaseException:  # the loop is closed: the server is going away
            self._finish(call, grpc.StatusCode.UNAVAILABLE, "the server is stopping", b"")

    def _take_tensors(self, address: int | None, entries: Any, count: int) -> list[np.ndarray]:
        """A split request's tensors' bytes: views into the buffer the native side handed over,
        which is freed once the last of them is gone."""
        if count == 0 or address is None:
            return []
        pairs = [(entries[2 * i], entries[2 * i + 1]) for i in range(count)]
        end = max(offset + size for offset, size in pairs)
        buffer = (ctypes.c_char * end).from_address(address)
        freeing = weakref.finalize(buffer, self._library.cuvil_frontend_release, address)
        freeing.atexit = False  # at exit a view may still be read; the process frees it all
        whole = np.frombuffer(buffer, dtype=np.uint8)  # keeps the buffer alive
        return [whole[offset : offset + size] for offset, size in pairs]

    @staticmethod
    def _parse(method: Method, data: int, size: int, tensors: list[np.ndarray] | None) -> Any:
        """The request, read from gRPC's buffer while it is lent (until dispatch returns)."""
        lent = memoryview((ctypes.c_char * size).from_address(data)).cast("B")
        try:
            if tensors is not None and method.from_split is not None:
                return method.from_split(lent, tensors)
            if method.parse is not None:
                return method.parse(lent)
            return method.request_type.FromString(bytes(lent))
        except Exception as error:
            return Unparsed(error)

    # --- on the event loop ---------------------------------------------------------------------

    def _begin(
        self, call: int, index: int, request: Any, metadata: bytes, deadline_ns: int
    ) -> None:
        """Runs the call at once, up to its first wait. A call answered without waiting (health,
        metadata, a small model's inline run) needs no task, which saves a turn of the loop (a
        task object and a pass through the loop's scheduler); one that waits becomes a task when
        what it waits for is done, as Python 3.12's eager tasks do. A model run handed to a worker
        thread (``handoff``) goes on from that thread, to the end of the call."""
        coroutine = self._serve(call, self._methods[index], request, metadata, deadline_ns)
        with self._alive_lock:
            self._alive += 1
        handoff.drive(coroutine, contextvars.copy_context(), self._on_wait)

    def _on_wait(
        self, coroutine: Coroutine[Any, Any, None], context: contextvars.Context, waited: Any
    ) -> None:
        """A call waits for ``waited``: parked on the loop, from whichever thread drove it."""
        if threading.get_ident() == self._loop_thread:
            self._park(coroutine, context, waited)
        else:  # resumed on a worker, and now waiting for the loop after all
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._park, coroutine, context, waited)

    def _park(
        self, coroutine: Coroutine[Any, Any, None], context: contextvars.Context, waited: Any
    ) -> None:
        loop = asyncio.get_running_loop()

        def adopt(_: object = None) -> None:
            self._parked.discard(waited)
            task = loop.create_task(coroutine, context=context)  # resumes it where it waits
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        if not asyncio.isfuture(waited):  # a bare yield (asyncio.sleep(0)): resume next turn
            loop.call_soon(adopt, context=context)
            return
        waited._asyncio_future_blocking = False  # as a task's step does with what it awaits
        self._parked.add(waited)
        waited.add_done_callback(adopt, context=context)

    async def _serve(
        self, call: int, method: Method, request: Any, metadata: bytes, deadline_ns: int
    ) -> None:
        """The whole call, on the loop or (after a handoff) on a worker thread."""
        code, details = grpc.StatusCode.UNAVAILABLE, "the server is stopping"
        response: bytes | None = b""
        handle = NativeCall(self._library, call, self._turn)
        try:
            with tracing.server_span(method.path, lambda: parse_metadata(metadata)) as span:
                code, details, response = await self._answer(
                    method, request, NativeContext(deadline_ns, metadata, handle)
                )
                tracing.set_rpc_status(span, code.value[0], details)
        finally:
            handle.finish(code, details, response)
            with self._alive_lock:
                self._alive -= 1

    async def _answer(
        self, method: Method, request: Any, context: NativeContext
    ) -> tuple[grpc.StatusCode, str, bytes | None]:
        if isinstance(request, Unparsed):
            if isinstance(request.error, DecodeError):
                name = method.request_type.DESCRIPTOR.name
                return grpc.StatusCode.INVALID_ARGUMENT, f"the request is not a valid {name}", b""
            log.error("%s: parsing failed", method.path, exc_info=request.error)
            return grpc.StatusCode.INTERNAL, f"internal error in {method.path}: parsing failed", b""
        try:
            response = await method.handler(request, context)
            if isinstance(response, AsyncGenerator):
                await _write_answers(response, context)
                return grpc.StatusCode.OK, "", None
            if isinstance(response, PushedAnswers):
                await _write_pushed(response, context)
                return grpc.StatusCode.OK, "", None
        except Aborted as aborted:
            return aborted.code, aborted.details, b""
        except Exception as error:
            log.exception("%s failed", method.path)
            return grpc.StatusCode.INTERNAL, f"internal error in {method.path}: {error!r}", b""
        return grpc.StatusCode.OK, "", response.SerializeToString()

    def _finish(self, call: int, code: grpc.StatusCode, details: str, response: bytes) -> None:
        self._library.cuvil_frontend_finish(
            call, code.value[0], details.encode(errors="replace"), response, len(response)
        )


async def _write_answers(answers: AsyncGenerator[Any, None], context: NativeContext) -> None:
    """A stream's message answered by ``answers``, each written as it comes; closed (its
    ``finally`` run) once a write finds the stream gone, or if the call is cancelled."""
    assert context.write is not None
    try:
        async for answer in answers:
            if not context.write(answer.SerializeToString()):
                return
    finally:
        await answers.aclose()


async def _write_pushed(answers: PushedAnswers, context: NativeContext) -> None:
    """A stream's message answered by what ``answers`` writes as it comes; closed once it has
    written its last, or a write found the stream gone, or if the call is cancelled."""
    assert context.write is not None
    try:
        await answers.start(context.write)
    finally:
        await answers.aclose()
