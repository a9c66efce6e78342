"""The gRPC server the sidecar answers on, behind one small interface: gRPC C++ through
``native_frontend`` (the default where it builds) or grpcio's asyncio server.

Both serve the same ``InferenceServicer``, gRPC health (Check and Watch) and reflection on one
port; ``CUVIL_GRPC_FRONTEND`` picks: ``auto`` (native, else grpcio with a warning saying why),
``native`` (refuse to start without it) or ``grpcio``.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cuvil.runtime.native_build import NativeError
from cuvil_sidecar import tracing
from cuvil_sidecar._generated import grpc_service_pb2 as pb
from cuvil_sidecar.config import SidecarConfig
from cuvil_sidecar.servicer import SERVICE_NAME, InferenceServicer

log = logging.getLogger("cuvil_sidecar.frontend")


class Frontend(Protocol):
    name: str

    async def start(self, address: str) -> int:
        """Listen on ``host:port``; returns the bound port."""

    async def set_serving(self, service: str, serving: bool) -> None:
        """gRPC health of ``service`` ("" is the whole server)."""

    async def stop(self, grace_s: float) -> None:
        """Take no new calls; in-flight calls get ``grace_s`` to finish."""


class GrpcioFrontend:
    name = "grpcio"

    def __init__(self, servicer: InferenceServicer, config: SidecarConfig, provider: Any) -> None:
        self._tls = config.tls
        self._health = health.aio.HealthServicer()
        self._server = grpc.aio.server(
            interceptors=tracing.server_interceptors(provider),
            options=[
                ("grpc.max_receive_message_length", config.max_message_bytes),
                ("grpc.max_send_message_length", config.max_message_bytes),
            ],
        )
        self._server.add_generic_rpc_handlers((_inference_service(servicer),))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self._server
        )

    async def start(self, address: str) -> int:
        if self._tls is None:
            port = self._server.add_insecure_port(address)
        else:
            port = self._server.add_secure_port(address, self._tls.grpc_credentials())
        await self._server.start()
        return port

    async def set_serving(self, service: str, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse
        await self._health.set(service, status.SERVING if serving else status.NOT_SERVING)

    async def stop(self, grace_s: float) -> None:
        await self._server.stop(grace_s)


def _inference_service(servicer: InferenceServicer) -> grpc.GenericRpcHandler:
    """The inference service for grpcio. Its answers are serialized by their own
    ``SerializeToString``: a large ModelInfer answer is a ``wire.EncodedInferResponse``."""
    service = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    handlers = {}
    for method in service.methods:
        kind = (
            grpc.stream_stream_rpc_method_handler
            if method.client_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        handlers[method.name] = kind(
            getattr(servicer, method.name),
            request_deserializer=getattr(pb, method.input_type.name).FromString,
            response_serializer=_serialized,
        )
    return grpc.method_handlers_generic_handler(service.full_name, handlers)


def _serialized(response: Any) -> bytes:
    return bytes(response.SerializeToString())


def open_frontend(servicer: InferenceServicer, config: SidecarConfig, provider: Any) -> Frontend:
    if config.grpc_frontend != "grpcio":
        try:
            return _native(servicer, config)
        except NativeError as error:
            if config.grpc_frontend == "native":
                raise
            log.warning(
                "the native gRPC front end is not available (%s): serving with grpcio", error
            )
    return GrpcioFrontend(servicer, config, provider)


def _native(servicer: InferenceServicer, config: SidecarConfig) -> Frontend:
    from cuvil_sidecar.native_frontend import Method, NativeFrontend
    from cuvil_sidecar.wire import RAW_INPUT_CONTENTS, infer_request_from_split, split_infer_request

    service = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    infer = pb.ModelInferRequest
    split = functools.partial(split_infer_request, request_type=infer, owned_tensors=True)
    methods = [
        Method(
            f"/{service.full_name}/{method.name}",
            getattr(pb, method.input_type.name),
            getattr(servicer, method.name),
        )
        for method in service.methods
        if method.name not in ("ModelInfer", "ModelStreamInfer")
    ]
    methods.append(
        Method(
            f"/{service.full_name}/ModelStreamInfer",
            infer,
            functools.partial(servicer.stream_message, pushed=True),
            split,
            streaming=True,
        )
    )
    methods.append(
        Method(
            f"/{service.full_name}/ModelInfer",
            infer,
            servicer.ModelInfer,
            split,
            RAW_INPUT_CONTENTS,
            functools.partial(infer_request_from_split, request_type=infer),
        )
    )
    return NativeFrontend(
        methods,
        (pb.DESCRIPTOR, health_pb2.DESCRIPTOR),
        config.max_message_bytes,
        tls=config.tls,
    )
