"""The gRPC servicer: protobuf in, ``DataPlane`` call, protobuf out, nothing else.

Every RPC goes through ``_rpc``: a ``SidecarError`` becomes the status code from
``errors.STATUS_CODES`` with its message; any other exception is logged with its traceback and
answered INTERNAL, so no request can take the server down. Before the method runs, the
configured ``policy.Policies`` see the call (its metadata and peer) and may refuse it.
ModelStreamInfer's messages are answered by ``stream_message``, which never aborts: errors go
into the stream, one per request. A generation model's requests are answered with one
response per token instead (``generation/grpc_generate.py``, Triton's decoupled mode):
``stream_message`` hands the native front end's stream a ``PushedAnswers``, which writes each
token's answer as the engine's tokens are delivered to the event loop, and grpcio's an async
generator of them.
A client's gRPC deadline goes with its request to the data plane, which drops the request unrun
once the deadline has passed, and so does, on the native front end, the call's ``client_gone``
(grpcio cancels the call's task instead, which drops the request as well).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from cuvil_sidecar._generated import grpc_service_pb2 as pb
from cuvil_sidecar._generated import grpc_service_pb2_grpc as pb_grpc
from cuvil_sidecar.dataplane import DataPlane
from cuvil_sidecar.errors import PermissionDenied, SidecarError, grpc_status
from cuvil_sidecar.generation import grpc_generate
from cuvil_sidecar.messages import InferRequest
from cuvil_sidecar.peer_credentials import grpc_peer_uid
from cuvil_sidecar.policy import Call, Policies, grpc_peer_host, is_local_peer
from cuvil_sidecar.repository import index_pb, statistics_pb
from cuvil_sidecar.streaming import serve_stream
from cuvil_sidecar.wire import EncodedStreamResponse, stream_error, stream_failure

log = logging.getLogger("cuvil_sidecar.servicer")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name

Handler = TypeVar("Handler", bound=Callable[..., Awaitable[Any]])


def _rpc(method: Handler) -> Handler:
    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            if self.policies.active:
                self.policies.check(_call_of(context, method.__name__))
            return await method(self, request, context)
        except SidecarError as error:
            await context.abort(grpc_status(error), str(error))
        except Exception as error:
            log.exception("%s failed", method.__name__)
            await context.abort(
                grpc.StatusCode.INTERNAL, f"internal error in {method.__name__}: {error!r}"
            )

    return wrapper  # type: ignore[return-value]


def deadline_ns(context: Any) -> int | None:
    """The client's deadline (epoch ns), from the call's remaining time; None without one."""
    remaining = context.time_remaining()
    return None if remaining is None else time.time_ns() + int(remaining * 1e9)


def _call_of(context: Any, method: str) -> Call:
    """What the policies see of a gRPC call."""
    headers = {
        key.lower(): value
        for key, value in context.invocation_metadata() or ()
        if isinstance(value, str)
    }
    return Call("grpc", method, headers, grpc_peer_host(context.peer()))


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, dataplane: DataPlane, policies: Policies | None = None) -> None:
        self.dataplane = dataplane
        self.policies = policies or Policies()

    @_rpc
    async def ServerLive(self, request: Any, context: Any) -> Any:
        return pb.ServerLiveResponse(live=self.dataplane.live())

    @_rpc
    async def ServerReady(self, request: Any, context: Any) -> Any:
        return pb.ServerReadyResponse(ready=self.dataplane.ready())

    @_rpc
    async def ModelReady(self, request: Any, context: Any) -> Any:
        ready = self.dataplane.model_ready(request.name, request.version)
        return pb.ModelReadyResponse(ready=ready)

    @_rpc
    async def ServerMetadata(self, request: Any, context: Any) -> Any:
        return self.dataplane.server_metadata().to_pb()

    @_rpc
    async def ModelMetadata(self, request: Any, context: Any) -> Any:
        return self.dataplane.model_metadata(request.name, request.version).to_pb()

    @_rpc
    async def ModelConfig(self, request: Any, context: Any) -> Any:
        return self.dataplane.model_config(request.name, request.version).to_pb()

    @_rpc
    async def ModelStatistics(self, request: Any, context: Any) -> Any:
        return statistics_pb(self.dataplane.model_statistics(request.name, request.version))

    @_rpc
    async def RepositoryIndex(self, request: Any, context: Any) -> Any:
        return index_pb(self.dataplane.repository_index(request.ready))

    @_rpc
    async def RepositoryModelLoad(self, request: Any, context: Any) -> Any:
        self.dataplane.load_model(request.model_name)

    @_rpc
    async def RepositoryModelUnload(self, request: Any, context: Any) -> Any:
        self.dataplane.unload_model(request.model_name)

    @_rpc
    async def ModelInfer(self, request: Any, context: Any) -> Any:
        started = time.time_ns()
        try:
            neutral = InferRequest.from_pb(request)
        except SidecarError:
            self.dataplane.count_failure(request.model_name, started)
            raise
        gone = getattr(context, "client_gone", None)  # the native front end's; grpcio cancels
        return (await self.dataplane.infer(neutral, deadline_ns(context), gone)).to_pb()

    async def ModelStreamInfer(self, requests: AsyncIterator[Any], context: Any) -> Any:
        """grpcio's stream: each request answered as its answers come."""
        async for answer in serve_stream(requests, lambda r: self._stream_answers(r, context)):
            yield answer

    async def _stream_answers(self, request: Any, context: Any) -> AsyncIterator[Any]:
        answer = await self.stream_message(request, context)
        if not isinstance(answer, AsyncGenerator):  # one answer (grpcio never asks for pushed)
            yield answer
            return
        async for token in answer:
            yield token

    async def _generation_answers(self, request: Any, context: Any) -> AsyncGenerator[Any, None]:
        refused = self._refusal(request, context)
        if refused is not None:
            yield refused
            return
        gone = getattr(context, "client_gone", None)  # the native front end's; grpcio cancels
        try:
            async for answer in grpc_generate.stream_answers(self.dataplane, request, gone):
                yield answer
        except Exception as failure:  # a bug: answered in the stream, which goes on
            log.exception("ModelStreamInfer failed")
            yield stream_failure(request, failure)

    def _pushed_generation(
        self, request: Any, context: Any
    ) -> grpc_generate.PushedAnswers | EncodedStreamResponse:
        """A generation's answers pushed to the stream as its tokens come (``PushedAnswers``),
        or the one answer refusing it."""
        refused = self._refusal(request, context)
        if refused is not None:
            return refused
        try:
            answers = grpc_generate.open_answers(self.dataplane, request, context.client_gone)
        except Exception as failure:  # a bug: answered in the stream, which goes on
            log.exception("ModelStreamInfer failed")
            return stream_failure(request, failure)
        if isinstance(answers, grpc_generate.TokenAnswers):
            return grpc_generate.PushedAnswers(answers)
        return answers

    def _refusal(self, request: Any, context: Any) -> EncodedStreamResponse | None:
        """The policies' refusal of a generation request, as its answer; None: allowed."""
        if self.policies.active:
            try:
                self.policies.check(_call_of(context, "ModelStreamInfer"))
            except SidecarError as refused:
                return stream_error(request, str(refused))
        return None

    async def stream_message(
        self, request: Any, context: Any, *, pushed: bool = False
    ) -> EncodedStreamResponse | AsyncGenerator[Any, None] | grpc_generate.PushedAnswers:
        """One message of ModelStreamInfer: its response, or its error in the stream; for a
        generation model, its answers (one per token): with ``pushed`` (the native front end,
        whose context writes them) a ``PushedAnswers``, else an async generator."""
        if self.dataplane.is_generation(request.model_name):
            if pushed:
                return self._pushed_generation(request, context)
            return self._generation_answers(request, context)
        try:
            return EncodedStreamResponse("", await self.ModelInfer(request, _InStream(context)))
        except _StreamAbort as abort:
            return stream_error(request, abort.details)
        except Exception as failure:  # answered in the stream all the same
            log.exception("ModelStreamInfer failed")
            return stream_failure(request, failure)

    @_rpc
    async def SystemSharedMemoryRegister(self, request: Any, context: Any) -> Any:
        peer = grpc_peer_host(context.peer())
        if not is_local_peer(peer):
            raise PermissionDenied(
                "shared memory is registered only for clients on this host; "
                f"{peer or 'this client'} is not a loopback or Unix-socket peer"
            )
        self.dataplane.register_shared_memory(
            request.name,
            request.key,
            request.offset,
            request.byte_size,
            grpc_peer_uid(context.peer()),
        )
        return pb.SystemSharedMemoryRegisterResponse()

    @_rpc
    async def SystemSharedMemoryUnregister(self, request: Any, context: Any) -> Any:
        self.dataplane.unregister_shared_memory(request.name)
        return pb.SystemSharedMemoryUnregisterResponse()

    @_rpc
    async def SystemSharedMemoryStatus(self, request: Any, context: Any) -> Any:
        status = pb.SystemSharedMemoryStatusResponse.RegionStatus
        return pb.SystemSharedMemoryStatusResponse(
            regions={
                region.name: status(
                    name=region.name,
                    key=region.key,
                    offset=region.offset,
                    byte_size=region.byte_size,
                )
                for region in self.dataplane.shared_memory_status(request.name)
            }
        )


class _StreamAbort(Exception):
    def __init__(self, details: str) -> None:
        super().__init__(details)
        self.details = details


class _InStream:
    """A stream's context for one of its messages: an abort becomes that message's error, and
    the stream goes on."""

    def __init__(self, context: Any) -> None:
        self._context = context
        self.client_gone = getattr(context, "client_gone", None)

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise _StreamAbort(details)

    def time_remaining(self) -> float | None:
        remaining: float | None = self._context.time_remaining()
        return remaining

    def invocation_metadata(self) -> Any:
        return self._context.invocation_metadata()

    def peer(self) -> str:
        return str(self._context.peer())
