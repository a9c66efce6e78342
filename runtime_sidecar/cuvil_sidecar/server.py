"""The composition root: builds every part from one SidecarConfig and runs until SIGTERM/SIGINT.

Order matters for readiness: the gRPC port and the metrics port open first (live, not ready),
then the model loads in the background; health turns SERVING and ServerReady true only once the
model passed warm-up and the golden check. SIGHUP asks for a reload; SIGTERM drains: readiness
goes false, the gRPC and REST servers take no new calls or connections, in-flight calls and
generation streams get ``CUVIL_EXIT_TIMEOUT_S`` (streams still running then end with a shutdown
error in the stream rather than a cut connection), then the model is retired and the process
exits.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Any

from cuvil_sidecar import tracing
from cuvil_sidecar.config import SidecarConfig
from cuvil_sidecar.dataplane import DataPlane
from cuvil_sidecar.frontend import open_frontend
from cuvil_sidecar.http_server import HttpLimits, HttpServer
from cuvil_sidecar.manager import ModelManager
from cuvil_sidecar.metrics import Metrics, metrics_handler
from cuvil_sidecar.policy import policies_from_config
from cuvil_sidecar.rest import RestApi
from cuvil_sidecar.servicer import SERVICE_NAME, InferenceServicer
from cuvil_sidecar.source import ModelSource

log = logging.getLogger("cuvil_sidecar")

STREAM_NOTICE_S = 1.0  # a stream still running is ended this long before the grace ends


async def serve(config: SidecarConfig) -> None:
    provider = tracing.configure()
    metrics = Metrics()

    async def on_ready(ready: bool) -> None:
        for service in ("", SERVICE_NAME):
            await server.set_serving(service, ready)

    source = ModelSource(config.model, config.cache_dir, config.model_file)
    manager = ModelManager(config, source, metrics, on_ready)
    dataplane = DataPlane(manager, metrics, config)
    policies = policies_from_config(config)
    server = open_frontend(InferenceServicer(dataplane, policies), config, provider)
    port = await server.start(f"{config.host}:{config.grpc_port}")
    await on_ready(False)
    limits = HttpLimits(
        config.http_max_connections, config.http_timeout_s, config.max_message_bytes
    )
    tls = config.tls.server_context() if config.tls is not None else None
    http_servers = {
        "metrics": (
            HttpServer(metrics_handler(metrics, manager.readiness), limits, "metrics"),
            config.metrics_port,
            None,
        ),
        "REST": (HttpServer(RestApi(dataplane, policies), limits, "REST"), config.http_port, tls),
    }
    listening = []
    for name, (http, http_port, context) in http_servers.items():
        bound = await http.start(config.host, http_port, context) if http_port else 0
        listening.append(f"{name} {config.host}:{bound}" if bound else f"{name} off")
    log.info(
        "cuvil-sidecar listening: gRPC %s:%d (%s), %s; %s; %s; loading %s",
        config.host,
        port,
        server.name,
        ", ".join(listening),
        "TLS on gRPC and REST" if config.tls else "no TLS",
        "bearer tokens required" if policies.authenticates else "no authentication",
        config.model,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[Any]] = set()

    def spawn(coroutine: Any) -> None:
        task = loop.create_task(coroutine)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.add_signal_handler(signal.SIGHUP, lambda: spawn(manager.reload_on_signal()))
    spawn(manager.start(max_delay_s=config.start_retry_max_s))
    if config.poll_interval_s > 0:
        spawn(manager.poll(config.poll_interval_s))
    await stop.wait()
    grace_s = config.exit_timeout_s
    log.info("stopping: draining in-flight calls (up to %.0f s)", grace_s)
    await on_ready(False)
    for task in list(tasks):
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    http_servers["REST"][0].stop_accepting()
    # every call, stream or not, gets the grace; a generation stream still running before its
    # end is told the sidecar stops (an error event or answer) while gRPC still carries it
    grpc_stopped = asyncio.ensure_future(server.stop(grace_s))
    await manager.close(grace_s=max(0.0, grace_s - min(STREAM_NOTICE_S, grace_s / 2)))
    await grpc_stopped
    dataplane.close()
    for http, _, _ in http_servers.values():
        await http.stop()
    if provider is not None:
        provider.shutdown()
