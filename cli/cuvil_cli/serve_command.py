"""``cuvil serve PATH_OR_REF``: run the inference sidecar on one artifact in the foreground.

Flags override the sidecar's environment variables (``CUVIL_*``, see
``cuvil_sidecar.config``); everything else, tracing included (``OTEL_*``), comes from the
environment exactly as for ``cuvil-sidecar``. Unlike the sidecar in its pod, ``cuvil serve``
binds 127.0.0.1 unless ``--host`` (or ``CUVIL_GRPC_HOST``) says otherwise: a model served from a
workstation is not offered to the whole network by accident.
"""

from __future__ import annotations

import argparse
import os

FLAGS = (
    ("--name", "CUVIL_MODEL_NAME", "model name clients use (default: the artifact's)"),
    ("--host", "CUVIL_GRPC_HOST", "address to bind (default 127.0.0.1)"),
    ("--port", "CUVIL_GRPC_PORT", "gRPC port (default 8001)"),
    ("--http-port", "CUVIL_HTTP_PORT", "REST port (default 8000; 0: off)"),
    ("--metrics-port", "CUVIL_METRICS_PORT", "Prometheus/health HTTP port (default 8002; 0: off)"),
    ("--max-batch-size", "CUVIL_MAX_BATCH_SIZE", "rows per joined batch (default 8; 1: off)"),
    ("--max-queue-delay-us", "CUVIL_MAX_QUEUE_DELAY_US", "batching wait (default 500)"),
    ("--cache-dir", "CUVIL_CACHE_DIR", "node cache for pulled artifacts"),
    ("--poll-interval", "CUVIL_POLL_INTERVAL_S", "seconds between digest polls (default 0: off)"),
)


LOCAL_HOST = "127.0.0.1"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve", help="serve an artifact over the Open Inference Protocol v2 (gRPC and REST)"
    )
    parser.add_argument("model", help="artifact path, OCI layout (oci:PATH[:tag]) or registry ref")
    for flag, variable, text in FLAGS:
        parser.add_argument(flag, dest=variable, metavar="VALUE", help=f"{text} [{variable}]")
    parser.set_defaults(handler=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    from cuvil_sidecar.config import SidecarConfig
    from cuvil_sidecar.main import run

    environ = {"CUVIL_GRPC_HOST": LOCAL_HOST} | dict(os.environ) | {"CUVIL_MODEL": args.model}
    environ |= {
        variable: str(getattr(args, variable))
        for _, variable, _ in FLAGS
        if getattr(args, variable) is not None
    }
    return run(SidecarConfig.from_env(environ))
