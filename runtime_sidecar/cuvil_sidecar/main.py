"""``cuvil-sidecar``: read the configuration from the environment and serve until stopped."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from cuvil_sidecar.config import ConfigError, SidecarConfig

# OpenMP threads spin this many rounds for more work before they sleep (a round is a `pause`,
# tens of nanoseconds; libgomp's default, 300000 rounds, is milliseconds). Within a model run the
# next parallel region comes within microseconds, and a thread that slept must be woken for it;
# after the run, a thread spinning on for milliseconds takes a core from the client, gRPC and
# the next decode. So the spin is set between the two: long enough to bridge the gaps between a
# run's parallel regions (a much shorter one lets a model of many short regions, like MiniLM's,
# put its threads to sleep inside a run), short enough that the threads give their cores back
# soon after it (the default costs small batched models throughput). Models of long regions,
# like ResNet-50's, do not notice either way. Figures: benchmarks/README.md (sidecar_ab.py).
OMP_SPIN = "3000"


def set_omp_spin(log: logging.Logger) -> None:
    """GOMP_SPINCOUNT, unless the operator set it, before torch loads libgomp (which reads it
    once): too late where torch is loaded already (``cuvil serve``), which is logged."""
    if "GOMP_SPINCOUNT" in os.environ:
        log.info("OpenMP spin: GOMP_SPINCOUNT=%s, as set", os.environ["GOMP_SPINCOUNT"])
    elif "torch" in sys.modules:
        log.info("OpenMP spin: libgomp's default (torch was loaded first; export GOMP_SPINCOUNT)")
    else:
        os.environ["GOMP_SPINCOUNT"] = OMP_SPIN
        log.info("OpenMP spin: GOMP_SPINCOUNT=%s", OMP_SPIN)


def run(config: SidecarConfig) -> int:
    logging.basicConfig(
        level=os.environ.get("CUVIL_LOG_LEVEL", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    set_omp_spin(logging.getLogger("cuvil_sidecar"))
    from cuvil.runtime.native_build import NativeError
    from cuvil_sidecar.server import serve

    if config.torch_threads:
        import torch

        torch.set_num_threads(config.torch_threads)
    try:
        asyncio.run(serve(config))
    except NativeError as error:  # only with CUVIL_GRPC_FRONTEND=native; auto falls back
        print(f"cuvil-sidecar: CUVIL_GRPC_FRONTEND=native: {error}", file=sys.stderr)
        return 2
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """``--help`` (every setting, from the environment) and ``--version``; nothing else runs."""
    from cuvil.entry_point import build_parser
    from cuvil_sidecar import config

    parser = build_parser(
        "cuvil-sidecar",
        "Serves one Cuvil artifact over the Open Inference Protocol v2 (gRPC and REST),"
        " with Prometheus metrics and health endpoints.",
        config.__doc__,
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    parse_args(sys.argv[1:] if argv is None else argv)
    try:
        config = SidecarConfig.from_env()
    except ConfigError as error:
        print(f"cuvil-sidecar: {error}", file=sys.stderr)
        return 2
    return run(config)


if __name__ == "__main__":
    sys.exit(main())
