"""The sidecar of an earlier commit against the working tree's, side by side: both serve the
same artifact at once, and the client alternates between them, so a slow phase of a shared host
hits both alike. Prints one JSON document.

    .venv/bin/python benchmarks/sidecar_ab.py --base 76b3ee5 --models mlp,minilm,resnet50

On this 2-core host, runs minutes apart differ by more than most changes do (ResNet-50 at
concurrency 1: 46 to 63 ms within an hour), so a change to the serving path is only measured
this way. ``c1``: p50 through tritonclient's synchronous client, unbatched, in alternating
blocks; ``c16``: QPS and p95 through the aio client at concurrency 16, batching on, in
alternating windows. Both sidecars run without a tactics cache (each times its own kernels, as
a fresh node does) on the native gRPC front end; with ``--shared-tactics`` both run the kernels
kept in the tactics cache beside the artifacts (``sidecar_load.py``'s), so that a change outside
the kernels' choice is not hidden by two loads choosing differently (a few % of a run here).
``--base`` is checked out with ``git worktree`` into a temporary folder, removed afterwards.
``--env`` / ``--base-env KEY=VALUE`` set a variable for one side only, so one commit can be
run against itself with a setting changed (``--base HEAD --env GOMP_SPINCOUNT=300000``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import sidecar_load as load_test
from cuvil_cli.pairs import key_values

REPO = Path(__file__).resolve().parents[1]
BLOCKS = {"mlp": (40, 50), "minilm": (20, 8), "resnet50": (12, 4)}  # blocks, calls per block


@contextlib.contextmanager
def checkout(revision: str) -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="cuvil-ab-") as scratch:
        tree = Path(scratch) / "tree"
        git = ["git", "-C", str(REPO)]
        add = [*git, "worktree", "add", "--detach", str(tree), revision]
        subprocess.run(add, check=True, stdout=sys.stderr)  # stdout is the report's
        try:
            yield tree
        finally:
            remove = [*git, "worktree", "remove", "--force", str(tree)]
            subprocess.run(remove, check=False, stdout=sys.stderr)


def start(
    tree: Path, artifact: Path, name: str, batch: int, log: Path, settings: dict[str, str]
) -> tuple[Any, str]:
    """A sidecar from ``tree`` serving ``artifact``; ``settings`` (the tactics cache, and the
    side's own variables) go on top of the defaults."""
    port = load_test.free_port()
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("CUVIL_", "OTEL_"))}
    environ |= {
        "CUVIL_MODEL": str(artifact),
        "CUVIL_GRPC_HOST": "127.0.0.1",
        "CUVIL_GRPC_PORT": str(port),
        "CUVIL_METRICS_PORT": "0",
        "CUVIL_HTTP_PORT": "0",
        "CUVIL_MAX_BATCH_SIZE": str(batch),
        "CUVIL_MAX_QUEUE_DELAY_US": "2000",
        "CUVIL_WARMUP_SHAPES": load_test.WARMUP_SHAPES.get(name, ""),
        "CUVIL_GRPC_FRONTEND": "native",
        "PYTHONPATH": os.pathsep.join([str(tree / "runtime_sidecar"), str(tree)]),
    }
    environ |= settings
    process = subprocess.Popen(
        [sys.executable, "-m", "cuvil_sidecar.main"],
        env=environ,
        cwd=tree,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    return process, f"127.0.0.1:{port}"


def wait_ready(urls: dict[str, str], processes: dict[str, Any], logs: dict[str, Path]) -> None:
    import tritonclient.grpc as syncclient

    for side, url in urls.items():
        client = syncclient.InferenceServerClient(url)
        deadline = time.monotonic() + 300
        while not _ready(client):
            if processes[side].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{side} sidecar not ready: {logs[side].read_text()[-2000:]}")
            time.sleep(0.2)
        client.close()


def _ready(client: Any) -> bool:
    with contextlib.suppress(Exception):
        return bool(client.is_server_ready())
    return False


def alternate_c1(urls: dict[str, str], name: str, blocks: int, calls: int) -> dict[str, float]:
    import tritonclient.grpc as syncclient

    clients = {side: syncclient.InferenceServerClient(url) for side, url in urls.items()}
    items = load_test.infer_inputs(syncclient.InferInput, load_test.example(name))
    for client in clients.values():
        for _ in range(5):
            client.infer(name, items)
    times: dict[str, list[float]] = {side: [] for side in clients}
    for block in range(blocks):
        order = list(clients) if block % 2 == 0 else list(reversed(clients))
        for side in order:
            for _ in range(calls):
                started = time.perf_counter()
                clients[side].infer(name, items)
                times[side].append((time.perf_counter() - started) * 1e3)
    for client in clients.values():
        client.close()
    return {side: round(statistics.median(values), 3) for side, values in times.items()}


def alternate_c16(urls: dict[str, str], name: str, rounds: int, window_s: float) -> dict:
    runs: dict[str, list[dict[str, float]]] = {side: [] for side in urls}
    for turn in range(rounds):
        order = list(urls) if turn % 2 == 0 else list(reversed(urls))
        for side in order:
            result = load_test.load(urls[side], name, load_test.example(name), 16, window_s)
            runs[side].append(asyncio.run(result))
    return {
        side: {
            "qps": round(statistics.median(run["qps"] for run in values), 1),
            "p95_ms": round(statistics.median(run["p95_ms"] for run in values), 2),
        }
        for side, values in runs.items()
    }


def compare(trees: dict[str, Path], name: str, args: argparse.Namespace) -> dict[str, object]:
    artifact = load_test.compiled_artifact(name, args.artifacts)
    tactics = str(load_test.tactics_folder(artifact)) if args.shared_tactics else "off"
    settings = {
        "base": {"CUVIL_TACTICS_CACHE": tactics, **args.base_env},
        "working_tree": {"CUVIL_TACTICS_CACHE": tactics, **args.env},
    }
    result: dict[str, object] = {}
    for mode, batch in (("c1", 1), ("c16", 8)):
        processes, urls, logs = {}, {}, {}
        try:
            for side, tree in trees.items():
                logs[side] = args.artifacts / f"ab-{name}-{mode}-{side}.log"
                processes[side], urls[side] = start(
                    tree, artifact, name, batch, logs[side], settings[side]
                )
                if args.shared_tactics:  # the first to load keeps its choices for the other
                    wait_ready({side: urls[side]}, processes, logs)
            wait_ready(urls, processes, logs)
            if mode == "c1":
                blocks, calls = BLOCKS.get(name, (20, 8))
                result[mode] = alternate_c1(urls, name, max(2, blocks // args.scale), calls)
            else:
                result[mode] = alternate_c16(urls, name, args.rounds, args.window)
        finally:
            for process in processes.values():
                process.send_signal(signal.SIGTERM)
                process.wait(30)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the earlier commit (any git revision)")
    parser.add_argument("--models", default="mlp,minilm,resnet50")
    parser.add_argument("--rounds", type=int, default=4, help="c16 windows per side")
    parser.add_argument("--window", type=float, default=2.0, help="seconds per c16 window")
    parser.add_argument("--scale", type=int, default=1, help="divide the c1 blocks by this")
    parser.add_argument(
        "--artifacts", type=Path, default=Path(tempfile.gettempdir()) / "cuvil-bench-artifacts"
    )
    parser.add_argument(
        "--shared-tactics", action="store_true", help="both sidecars run the same kernel choices"
    )
    for flag, side in (("--env", "the working tree's"), ("--base-env", "the base's")):
        parser.add_argument(
            flag, action="append", default=[], metavar="KEY=VALUE", help=f"{side} sidecar only"
        )
    args = parser.parse_args()
    try:
        args.env = key_values(args.env, "--env")
        args.base_env = key_values(args.base_env, "--base-env")
    except ValueError as error:
        parser.error(str(error))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args.artifacts.mkdir(parents=True, exist_ok=True)
    report: dict[str, object] = {
        "base": args.base,
        "shared_tactics": args.shared_tactics,
        "env": args.env,
        "base_env": args.base_env,
        "load_average": os.getloadavg(),
    }
    with checkout(args.base) as base:
        trees = {"base": base, "working_tree": REPO}
        for name in args.models.split(","):
            report[name] = compare(trees, name, args)
            print(json.dumps({name: report[name]}), file=sys.stderr, flush=True)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
