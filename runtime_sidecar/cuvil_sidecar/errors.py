"""Domain errors of the sidecar and the tables that map them to gRPC status codes and HTTP
statuses.

The data plane raises these; the servicer turns them into a status with ``grpc_status``, the
REST front end into an HTTP status with ``http_status``.
Anything else escaping a handler is a bug: it is logged and answered INTERNAL, never a crash.
"""

from __future__ import annotations

import grpc


class SidecarError(Exception):
    """Base of the errors a client can cause or observe; the message goes to the client."""


class InvalidInput(SidecarError):
    """The request does not fit the model: names, datatypes, shapes, byte counts, dim ranges."""


class UnsupportedEncoding(InvalidInput):
    """A REST body in a content encoding the sidecar does not inflate."""


class ModelNotFound(SidecarError):
    """No model (or no model version) by that name is served here."""


class ModelNotReady(SidecarError):
    """The model is still loading or warming up, or failed to load (the message says why)."""


class RequestTooLarge(SidecarError):
    """A tensor declares more elements than the sidecar accepts in one request."""


class ShuttingDown(SidecarError):
    """The sidecar is stopping and takes no new requests."""


class AlreadyExists(SidecarError):
    """A shared memory region of that name is registered already."""


class RegionNotFound(SidecarError):
    """No shared memory region of that name is registered."""


class TooManyRegions(SidecarError):
    """The sidecar holds as many shared memory regions as it takes."""


class NotSupported(SidecarError):
    """A protocol extension this sidecar does not offer, or was configured without."""


class Unauthenticated(SidecarError):
    """The call carries no valid credentials (a bearer token, with authentication on)."""


class PermissionDenied(SidecarError):
    """The caller may not do this (shared memory from a client that is not on this host)."""


class RateLimited(SidecarError):
    """The client sent more calls than ``CUVIL_RATE_LIMIT`` allows; ``retry_after_s`` says
    when the next would pass."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QueueFull(SidecarError):
    """The model holds as many requests as ``CUVIL_MAX_QUEUE_SIZE`` allows."""


class QueueTimeout(SidecarError):
    """The request waited longer than ``CUVIL_QUEUE_TIMEOUT_US`` before it could run."""


class GenerationQueueFull(SidecarError):
    """A generation request found every KV cache slot taken and the waiting queue full
    (``CUVIL_GENERATION_MAX_WAITING``); it may succeed later."""


class KvBudgetExceeded(SidecarError):
    """A generation request needs more KV cache positions than the whole budget holds
    (``CUVIL_KV_CACHE_BYTES``): it can never run on this sidecar."""


class CallCancelled(SidecarError):
    """The call was cancelled (its client hung up) before its request ran; it never runs."""


class DeadlinePassed(SidecarError):
    """The client's deadline passed before the request ran; it was dropped unrun."""


STATUS_CODES: dict[type[SidecarError], grpc.StatusCode] = {
    InvalidInput: grpc.StatusCode.INVALID_ARGUMENT,
    RequestTooLarge: grpc.StatusCode.INVALID_ARGUMENT,
    ModelNotFound: grpc.StatusCode.NOT_FOUND,
    ModelNotReady: grpc.StatusCode.UNAVAILABLE,
    ShuttingDown: grpc.StatusCode.UNAVAILABLE,
    AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    RegionNotFound: grpc.StatusCode.NOT_FOUND,
    TooManyRegions: grpc.StatusCode.RESOURCE_EXHAUSTED,
    NotSupported: grpc.StatusCode.UNIMPLEMENTED,
    QueueFull: grpc.StatusCode.UNAVAILABLE,
    QueueTimeout: grpc.StatusCode.UNAVAILABLE,
    DeadlinePassed: grpc.StatusCode.DEADLINE_EXCEEDED,
    CallCancelled: grpc.StatusCode.CANCELLED,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    RateLimited: grpc.StatusCode.RESOURCE_EXHAUSTED,
    GenerationQueueFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    KvBudgetExceeded: grpc.StatusCode.RESOURCE_EXHAUSTED,
}

HTTP_STATUS: dict[type[SidecarError], int] = {
    InvalidInput: 400,
    UnsupportedEncoding: 415,
    RequestTooLarge: 413,
    ModelNotFound: 404,
    ModelNotReady: 503,
    ShuttingDown: 503,
    AlreadyExists: 409,
    RegionNotFound: 404,
    TooManyRegions: 429,
    NotSupported: 501,
    QueueFull: 503,
    QueueTimeout: 503,
    DeadlinePassed: 504,
    CallCancelled: 499,  # the client is gone; nginx's "client closed request"
    Unauthenticated: 401,
    PermissionDenied: 403,
    RateLimited: 429,
    GenerationQueueFull: 429,
    KvBudgetExceeded: 413,  # retrying cannot help: the request is larger than the budget
}


def grpc_status(error: SidecarError) -> grpc.StatusCode:
    for kind in type(error).__mro__:
        if kind in STATUS_CODES:
            return STATUS_CODES[kind]
    return grpc.StatusCode.INTERNAL


def http_status(error: SidecarError) -> int:
    for kind in type(error).__mro__:
        if kind in HTTP_STATUS:
            return HTTP_STATUS[kind]
    return 500
