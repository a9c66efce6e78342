"""Pull throughput of a ~100 MB artifact from a local registry, and time-to-loaded on a cache hit.

Starts Debian's docker-registry on loopback (the test fixture), compiles an MLP whose weights
make ~100 MB, pushes it, then measures (median of --repeat runs):
- cold pull into an empty node cache (``cuvil.artifact.api.resolve``: HEAD, manifest, blobs
  streamed and hashed, atomic install), beside oras-py's own ``pull()`` of the same manifest;
- a cache hit by tag (one HEAD + stat check) and by digest (no network), each with
  ``cuvil.runtime.model.load`` (which re-verifies every file) to the first inference.

    .venv/bin/python benchmarks/oci_pull.py [--megabytes 100] [--repeat 3]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import cuvil  # noqa: E402
from cuvil.artifact import push_artifact  # noqa: E402
from cuvil.artifact.api import resolve  # noqa: E402
from cuvil.artifact.registry_config import RegistryConfig  # noqa: E402
from cuvil.runtime.model import CompiledModel, load  # noqa: E402
from tests.fixtures.registry import RunningRegistry  # noqa: E402


def big_mlp(megabytes: int) -> CompiledModel:
    width = 2048
    layers = max(1, round(megabytes * 2**20 / (width * width * 4)))
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*blocks).eval()
    batch = cuvil.Dim("batch", min=1, max=8)
    return cuvil.jit(model, (torch.randn(2, width),), dynamic_shapes={"input": {0: batch}})


def timed(action: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    result = action()
    return time.perf_counter() - started, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(2)
    config = RegistryConfig(docker_config=None)
    with tempfile.TemporaryDirectory(prefix="cuvil-bench-") as folder:
        work = Path(folder)
        registry = RunningRegistry(work / "registry")
        registry.start()
        try:
            compile_s, compiled = timed(lambda: big_mlp(args.megabytes))
            ref = f"{registry.host}/bench/mlp:v1"
            push_s, pushed = timed(
                lambda: push_artifact(compiled.contents, ref, registry_config=config)
            )
            size = sum(p.stat().st_size for p in resolve(ref, cache_dir=work / "c0").path.iterdir())
            cold, oras_cold = [], []
            for run in range(args.repeat):
                seconds, found = timed(
                    partial(resolve, ref, cache_dir=work / f"cold{run}", registry_config=config)
                )
                assert found.downloaded
                cold.append(seconds)
                oras_cold.append(timed(partial(oras_pull, registry.host, work / f"o{run}"))[0])
            x = torch.randn(1, 2048)
            hit_tag, hit_digest = [], []
            for _ in range(args.repeat):
                hit_tag.append(
                    timed(lambda: load(resolve(ref, cache_dir=work / "cold0").path)(x))[0]
                )
                hit_digest.append(
                    timed(lambda: load(resolve(pushed.ref, cache_dir=work / "cold0").path)(x))[0]
                )
            resolve_only = timed(lambda: resolve(pushed.ref, cache_dir=work / "cold0"))[0]
        finally:
            registry.stop()
    megabytes = size / 2**20
    print(
        json.dumps(
            {
                "artifact_mb": round(megabytes, 1),
                "compile_s": round(compile_s, 2),
                "push_s": round(push_s, 2),
                "cold_pull_s": round(statistics.median(cold), 3),
                "cold_pull_mb_per_s": round(megabytes / statistics.median(cold), 1),
                "oras_py_pull_s": round(statistics.median(oras_cold), 3),
                "oras_py_pull_mb_per_s": round(megabytes / statistics.median(oras_cold), 1),
                "cache_hit_by_tag_to_first_output_s": round(statistics.median(hit_tag), 3),
                "cache_hit_by_digest_to_first_output_s": round(statistics.median(hit_digest), 3),
                "cache_hit_resolve_only_by_digest_s": round(resolve_only, 4),
                "repeat": args.repeat,
            },
            indent=2,
        )
    )


def oras_pull(host: str, outdir: Path) -> None:
    """oras-py's own pull of the same manifest, for comparison (no verification, no cache)."""
    import oras.provider

    oras.provider.Registry(hostname=host, insecure=True).pull(
        target=f"{host}/bench/mlp:v1", outdir=str(outdir)
    )


if __name__ == "__main__":
    main()
