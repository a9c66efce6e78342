"""``cuvil-sidecar``: read the configuration from the environment and serve until stopped."""

from __future__ import annotations

import asyncio
import logging
import os
import sys

from cuvil_sidecar.config import ConfigError, SidecarConfig


def run(config: SidecarConfig) -> int:
    logging.basicConfig(
        level=os.environ.get("CUVIL_LOG_LEVEL", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from cuvil.runtime.native import NativeError
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


def main(argv: list[str] | None = None) -> int:
    try:
        config = SidecarConfig.from_env()
    except ConfigError as error:
        print(f"cuvil-sidecar: {error}", file=sys.stderr)
        return 2
    return run(config)


if __name__ == "__main__":
    sys.exit(main())
