"""``cuvil-worker [--queues Q,…]``: a Celery worker for compile tasks.

One compile per worker process by default (a compile uses every core it is given); scale by
running more workers. Settings come from the environment (``cuvil_worker.config``).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from cuvil.entry_point import build_parser
    from cuvil_worker import config

    parser = build_parser(
        "cuvil-worker", "A Celery worker for Cuvil compile tasks.", config.__doc__
    )
    parser.add_argument(
        "--queues",
        "-Q",
        default=os.environ.get("CUVIL_QUEUES", "cuvil.cpu"),
        help="comma-separated queues to consume (default: cuvil.cpu; $CUVIL_QUEUES)",
    )
    parser.add_argument("--concurrency", "-c", type=int, default=1, help="processes (default 1)")
    parser.add_argument("--loglevel", "-l", default=os.environ.get("CUVIL_LOG_LEVEL", "INFO"))
    parser.add_argument("--hostname", "-n", default=None, help="worker name (default: unique)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from cuvil_worker.app import app

    hostname = args.hostname or f"cuvil-{os.getpid()}@{socket.gethostname()}"
    app.worker_main(
        [
            "worker",
            f"--queues={args.queues}",
            f"--concurrency={args.concurrency}",
            f"--loglevel={args.loglevel}",
            f"--hostname={hostname}",
            "--pool=prefork",
            "--without-gossip",
            "--without-mingle",
        ]
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
