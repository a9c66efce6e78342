"""The gRPC servicer: protobuf in, ``DataPlane`` call, protobuf out, nothing else.

Every RPC goes through ``_rpc``: a ``SidecarError`` becomes the status code from
``errors.STATUS_CODES`` with its message; any other exception is logged with its traceback and
answered INTERNAL, so no request can take the server down.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from cuvil_sidecar._generated import grpc_service_pb2 as pb
from cuvil_sidecar._generated import grpc_service_pb2_grpc as pb_grpc
from cuvil_sidecar.dataplane import DataPlane
from cuvil_sidecar.errors import SidecarError, grpc_status
from cuvil_sidecar.messages import InferRequest

log = logging.getLogger("cuvil_sidecar.servicer")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name

Handler = TypeVar("Handler", bound=Callable[..., Awaitable[Any]])


def _rpc(method: Handler) -> Handler:
    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await method(self, request, context)
        except SidecarError as error:
            await context.abort(grpc_status(error), str(error))
        except Exception as error:
            log.exception("%s failed", method.__name__)
            await context.abort(
                grpc.StatusCode.INTERNAL, f"internal error in {method.__name__}: {error!r}"
            )

    return wrapper  # type: ignore[return-value]


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, dataplane: DataPlane) -> None:
        self.dataplane = dataplane

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
    async def ModelInfer(self, request: Any, context: Any) -> Any:
        try:
            neutral = InferRequest.from_pb(request)
        except SidecarError:
            self.dataplane.count_failure(request.model_name)
            raise
        return (await self.dataplane.infer(neutral)).to_pb()

    @_rpc
    async def SystemSharedMemoryRegister(self, request: Any, context: Any) -> Any:
        self.dataplane.register_shared_memory(
            request.name, request.key, request.offset, request.byte_size
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
