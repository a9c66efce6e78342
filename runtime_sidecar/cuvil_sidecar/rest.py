"""The Open Inference Protocol over REST/JSON (KServe's v2 REST API with Triton's extensions):
routes over the same ``DataPlane`` the gRPC servicer calls, so batching, limits, metrics and
tracing are shared.

    GET  /v2/health/live | /v2/health/ready               {"live": true} / {"ready": true}
    GET  /v2                                              server metadata
    GET  /v2/models/stats                                 every model's statistics
    GET  /v2/models/{m}[/versions/{v}]                    model metadata
    GET  /v2/models/{m}[/versions/{v}]/ready | /config | /stats
    POST /v2/models/{m}[/versions/{v}]/infer              JSON tensors, or binary data
    POST /v2/models/{m}[/versions/{v}]/generate[_stream]  a generation model's tokens
                                                          (generation/rest_generate.py)
    POST /v2/repository/index
    POST /v2/repository/models/{m}/load | /unload         501: not supported here
    GET  /v1/models, POST /v1/completions | /v1/chat/completions
                                                          OpenAI's API over a generation
                                                          model (generation/openai_api.py)

Health and readiness answer with their status and, as KServe's model server does, a JSON body
(``{"live": true}``, ``{"ready": true}``, ``{"name": m, "ready": true}``): Triton's clients read
the status alone, KServe's ``InferenceRESTClient`` reads the body. Every request passes the
configured ``policy.Policies`` first. A ``SidecarError`` is answered ``{"error": message}`` (the
``/v1`` routes: OpenAI's error object) with the status of ``errors.HTTP_STATUS``; a path it does
not serve is a 404, a method it does not take there a 405. An infer request's ``traceparent``
header is continued, as gRPC's metadata is; its ``timeout`` parameter (microseconds,
tritonclient's ``timeout=``) is the client's deadline; its body may come, and its answer go,
compressed (``http_encoding``).
"""

from __future__ import annotations

import logging
import math
import re
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any

from cuvil_sidecar import tracing
from cuvil_sidecar.dataplane import DataPlane
from cuvil_sidecar.errors import (
    InvalidInput,
    RateLimited,
    SidecarError,
    Unauthenticated,
    http_status,
)
from cuvil_sidecar.generation import openai_api, rest_generate
from cuvil_sidecar.http_encoding import decoded_body, encoded_answer
from cuvil_sidecar.http_server import (
    HttpRequest,
    HttpResponse,
    error_response,
    json_response,
)
from cuvil_sidecar.json_body import json_object
from cuvil_sidecar.policy import Call, Policies
from cuvil_sidecar.rest_tensors import encode_infer, header_length, parse_infer

log = logging.getLogger("cuvil_sidecar.rest")

Route = Callable[["RestApi", HttpRequest, str, str], Awaitable[HttpResponse]]
_MODEL = r"/v2/models/(?P<model>[^/]+)(?:/versions/(?P<version>[^/]+))?"


class RestApi:
    def __init__(self, dataplane: DataPlane, policies: Policies | None = None) -> None:
        self.dataplane = dataplane
        self.policies = policies or Policies()

    async def __call__(self, request: HttpRequest) -> HttpResponse:
        for pattern, methods in ROUTES:
            match = pattern.fullmatch(request.path)
            if match is None:
                continue
            route = methods.get(request.method)
            if route is None:
                allowed = ", ".join(sorted(methods))
                response = error_response(405, f"{request.path} takes {allowed}")
                response.headers["Allow"] = allowed
                return response
            model = urllib.parse.unquote(match.groupdict().get("model") or "")
            version = urllib.parse.unquote(match.groupdict().get("version") or "")
            try:
                if self.policies.active:
                    peer = request.peer[0] if isinstance(request.peer, tuple) else ""
                    call = Call("http", route.__name__, request.headers, str(peer))
                    self.policies.check(call)
                return await route(self, request, model, version)
            except SidecarError as error:
                response = error_response(http_status(error), str(error))
                if isinstance(error, Unauthenticated):
                    response.headers["WWW-Authenticate"] = 'Bearer realm="cuvil"'
                if isinstance(error, RateLimited):
                    response.headers["Retry-After"] = str(max(1, math.ceil(error.retry_after_s)))
                return response
        return error_response(404, f"no route {request.method} {request.path}; see /v2")

    async def live(self, request: HttpRequest, model: str, version: str) -> HttpResponse:
        live = self.dataplane.live()
        return json_response(200 if live else 503, {"live": live})

    async def ready(self, request: HttpRequest, model: str, version: str) -> HttpResponse:
        ready, reason = self.dataplane.manager.readiness()
        return json_response(200, {"ready": True}) if ready else error_response(503, reason)

    async def server_metadata(self, request: HttpRequest, model: str, version: str) -> HttpResponse:
        metadata = self.dataplane.server_metadata()
        return json_response(
            200,
            {
                "name": metadata.name,
                "version": metadata.version,
                "extensions": list(metadata.extensions),
            },
        )

    async def model_metadata(self, request: HttpRequest, model: str, version: str) -> HttpResponse:
        metadata = self.dataplane.model_metadata(model, version)
        return json_response(
            200,
            {
                "name": metadata.name,
                "versions": list(metadata.versions),
                "platform": metadata.platform,
                "inputs": [_tensor(t) for t in metadata.inputs],
                "outputs": [_tensor(t) for t in metadata.outputs],
            },
        )

    async def model_ready(self, request: HttpRequest, model: str, version: str) -> HttpResponse:
        if self.dataplane.model_ready(model, version):
            return json_response(200, {"name": model, "ready": True})
        return error_response(503, f"model {model!r} is not ready")

    async def model_config(self, request: HttpRequest, model: str, version: str) -> HttpResponse:
        return json_response(200, self.dataplane.model_config(model, version).to_json())

    async def statistics(self, request: HttpRequest, model: str, version: str) -> HttpResponse:
        stats = self.dataplane.model_statistics(model, version)
        return json_response(200, {"model_stats": [s.to_json() for s in stats]})

    async def index(self, request: HttpRequest, model: str, version: str) -> HttpResponse:
        ready_only = False
        if request.body.strip():
            ready_only = json_object(request.body).get("ready") is True
        entries = self.dataplane.repository_index(ready_only)
        return json_response(200, [entry.to_json() for entry in entries])

    async def load(self, request: HttpRequest, model: str, version: str) -> HttpResponse:
        self.dataplane.load_model(model)
        return HttpResponse(200)

    async def unload(self, request: HttpRequest, model: str, version: str) -> HttpResponse:
        self.dataplane.unload_model(model)
        return HttpResponse(200)

    async def infer(self, request: HttpRequest, model: str, version: str) -> HttpResponse:
        started = time.time_ns()
        with tracing.http_span("POST /v2/models/{model}/infer", request.headers):
            try:
                body = decoded_body(
                    request.body, request.headers, self.dataplane.config.max_message_bytes
                )
                neutral, binary, all_binary = parse_infer(
                    body, header_length(request.headers), model, version
                )
            except SidecarError:
                self.dataplane.count_failure(model, started)
                raise
            response = await self.dataplane.infer(neutral, _deadline_ns(neutral.parameters))
            plain, json_length = encode_infer(response, binary, all_binary)
        parts, encoding = encoded_answer(plain, request.headers)
        headers = {"Content-Encoding": encoding} if encoding else {}
        if json_length is None:
            return HttpResponse(200, parts, headers=headers)
        headers["Inference-Header-Content-Length"] = str(json_length)
        return HttpResponse(200, parts, "application/octet-stream", headers)

    async def generate(self, request: HttpRequest, model: str, version: str) -> HttpResponse:
        with tracing.http_span("POST /v2/models/{model}/generate", request.headers):
            response: HttpResponse = await rest_generate.generate(
                self.dataplane, request, model, version
            )
            return response

    async def generate_stream(self, request: HttpRequest, model: str, version: str) -> HttpResponse:
        with tracing.http_span("POST /v2/models/{model}/generate_stream", request.headers):
            return await rest_generate.generate_stream(self.dataplane, request, model, version)

    async def openai_models(self, request: HttpRequest, model: str, version: str) -> HttpResponse:
        return openai_api.models(self.dataplane)

    async def completions(self, request: HttpRequest, model: str, version: str) -> HttpResponse:
        with tracing.http_span("POST /v1/completions", request.headers):
            return await openai_api.completions(self.dataplane, request)

    async def chat_completions(
        self, request: HttpRequest, model: str, version: str
    ) -> HttpResponse:
        with tracing.http_span("POST /v1/chat/completions", request.headers):
            return await openai_api.chat_completions(self.dataplane, request)


def _deadline_ns(parameters: Any) -> int | None:
    timeout = parameters.get("timeout")
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout <= 0:
        raise InvalidInput("the `timeout` parameter must be a positive number of microseconds")
    return time.time_ns() + timeout * 1000


def _tensor(tensor: Any) -> dict[str, Any]:
    return {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape)}


_TABLE: tuple[tuple[str, dict[str, Route]], ...] = (
    ("/v2/health/live", {"GET": RestApi.live}),
    ("/v2/health/ready", {"GET": RestApi.ready}),
    ("/v2/?", {"GET": RestApi.server_metadata}),
    ("/v2/models/stats", {"GET": RestApi.statistics}),
    ("/v2/repository/index", {"POST": RestApi.index}),
    ("/v2/repository/models/(?P<model>[^/]+)/load", {"POST": RestApi.load}),
    ("/v2/repository/models/(?P<model>[^/]+)/unload", {"POST": RestApi.unload}),
    (_MODEL, {"GET": RestApi.model_metadata}),
    (_MODEL + "/ready", {"GET": RestApi.model_ready}),
    (_MODEL + "/config", {"GET": RestApi.model_config}),
    (_MODEL + "/stats", {"GET": RestApi.statistics}),
    (_MODEL + "/infer", {"POST": RestApi.infer}),
    (_MODEL + "/generate", {"POST": RestApi.generate}),
    (_MODEL + "/generate_stream", {"POST": RestApi.generate_stream}),
    ("/v1/models", {"GET": RestApi.openai_models}),
    ("/v1/completions", {"POST": RestApi.completions}),
    ("/v1/chat/completions", {"POST": RestApi.chat_completions}),
)
ROUTES = [(re.compile(path), methods) for path, methods in _TABLE]
