"""``cuvil run PATH``: run an artifact on its golden, random or given inputs; print outputs and
latency."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from cuvil.api import load
from cuvil.dtypes import torch_dtype
from cuvil.runtime.model import CompiledModel
from cuvil.shape_expr import compile_expr
from cuvil.verify import compare_outputs
from cuvil_cli.trust_commands import add_trust_arguments, trust_from


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("run", help="run an artifact and time it")
    parser.add_argument("path", help="artifact file or directory, oci:DIR[:tag], or registry ref")
    parser.add_argument(
        "--input",
        action="append",
        default=[],
        metavar="NAME=FILE.npy",
        help="an input from a .npy file (repeatable)",
    )
    parser.add_argument(
        "--dim",
        action="append",
        default=[],
        metavar="SYMBOL=N",
        help="size of a dynamic dim for random inputs, e.g. batch=4",
    )
    parser.add_argument("--random", action="store_true", help="random inputs, not the golden ones")
    parser.add_argument("--runs", type=int, default=20, help="timed runs (default 20)")
    add_trust_arguments(parser)
    parser.set_defaults(handler=run_run)


def random_inputs(model: CompiledModel, dims: dict[str, int]) -> dict[str, torch.Tensor]:
    """Inputs that fit the signature; symbols default to their lower bound (at least 1)."""
    values = {s.name: dims.get(s.name, max(s.min, 1)) for s in model.signature.symbols}
    generator = torch.Generator().manual_seed(0)
    inputs = {}
    for spec in model.signature.inputs:
        shape = [int(compile_expr(dim)(values)) for dim in spec.shape]
        dtype = torch_dtype(spec.dtype)
        golden = model.contents.golden.get(f"input.{spec.name}")
        if dtype.is_floating_point:
            inputs[spec.name] = torch.randn(shape, generator=generator).to(dtype)
        else:
            high = int(golden.max()) + 1 if golden is not None and golden.numel() else 2
            low = int(golden.min()) if golden is not None and golden.numel() else 0
            inputs[spec.name] = torch.randint(
                low, max(high, low + 1), shape, generator=generator
            ).to(dtype)
    return inputs


def run_run(args: argparse.Namespace) -> int:
    model = load(args.path, trust=trust_from(args))
    dims = dict(_pair(item, int) for item in args.dim)
    given = {name: torch.from_numpy(np.load(Path(file))) for name, file in map(_split, args.input)}
    golden_inputs = {
        k.removeprefix("input."): v
        for k, v in model.contents.golden.items()
        if k.startswith("input.")
    }
    use_golden = not args.random and not dims and not given and golden_inputs
    inputs = golden_inputs if use_golden else random_inputs(model, dims) | given
    outputs = model.run(inputs)
    source = "golden" if use_golden else "random/given"
    print(
        f"{model.name}: {source} inputs "
        + ", ".join(f"{k}{list(v.shape)}" for k, v in inputs.items())
    )
    for name, tensor in outputs.items():
        flat = tensor.detach().float().flatten()
        print(
            f"  {name}: {tensor.dtype} {list(tensor.shape)} mean={flat.mean():.6g} "
            f"first={flat[:4].tolist()}"
        )
    if use_golden:
        expected = {
            k.removeprefix("output."): v
            for k, v in model.contents.golden.items()
            if k.startswith("output.")
        }
        for error in compare_outputs(outputs, expected):
            print(
                f"  vs eager {error.name}: max abs {error.max_abs_error:.3g}, "
                f"{error.relative_to_scale:.3g} of scale, cosine {error.cosine:.6f}"
            )
    latencies = []
    for _ in range(max(args.runs, 1)):
        start = time.perf_counter()
        model.run(inputs)
        latencies.append((time.perf_counter() - start) * 1000)
    latencies.sort()
    p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]
    print(
        f"latency over {len(latencies)} runs: p50 {statistics.median(latencies):.3f} ms, "
        f"p99 {p99:.3f} ms, threads {torch.get_num_threads()}"
    )
    return 0


def _split(item: str) -> tuple[str, str]:
    name, sep, value = item.partition("=")
    if not sep:
        raise ValueError(f"expected NAME=VALUE, got {item!r}")
    return name, value


def _pair(item: str, convert: type) -> tuple[str, int]:
    name, value = _split(item)
    return name, convert(value)
