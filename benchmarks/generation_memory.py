"""Resident memory of a compiled generation model: after load, after the sidecar's warm-up
(every decode row count and prefill bucket prepared, kernel choices made) and after decode
steps, with the packed weight copies shared between the prefill and decode graphs' kernels
(``cuvil/backends/cpu/weight_copies.py``) and with each kernel packing its own
(``CUVIL_SHARE_PACKED=off``). Prints one JSON document.

    .venv/bin/python -m benchmarks.generation_memory --model llama100m

The model is ``generate_streams.py``'s Llama from a config (random weights), compiled by
``cuvil.jit(..., task="text-generation")`` with ``--slots`` slots. Each setting runs in a
process of its own (``--stage`` is that process's entry) so one's memory cannot carry into the
other's; resident sizes are ``VmRSS`` from /proc/self/status, in MiB, and ``weights_mib`` is the
artifact's weights as loaded. ``logits_max_abs_diff``: between the two settings' decode steps,
which the setting should not change beyond what a different kernel choice (each process times
its own) can.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.generate_streams import checkpoint, compiled_artifact
from benchmarks.host import cpu_name, emit

REPO = Path(__file__).resolve().parents[1]
SETTINGS = {"shared": "on", "per_kernel": "off"}


def resident_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    raise RuntimeError("no VmRSS in /proc/self/status")


def stage(artifact: Path, threads: int, steps: int, logits_out: Path) -> dict[str, Any]:
    """In this process: load, warm up, decode; the resident size after each."""
    from cuvil.runtime.generation import GenerationModel
    from cuvil.runtime.model import load

    torch.set_num_threads(threads)
    sizes = {"start": resident_mib()}
    model = load(artifact)
    if not isinstance(model, GenerationModel):
        raise TypeError(f"{artifact} is not a generation artifact")
    sizes["loaded"] = resident_mib()
    model.warm_up(128)
    sizes["warmed_up"] = resident_mib()
    rows = model.max_batch
    slots = list(range(rows))
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 100, (rows,), generator=generator)
    outputs = []
    with torch.inference_mode():
        for step in range(steps):
            logits = model.decode(slots, tokens, torch.full((rows,), step))
            outputs.append(logits)
            tokens = logits.argmax(-1)
    sizes["decoded"] = resident_mib()
    torch.save(torch.stack(outputs), logits_out)
    weights = sum(t.numel() * t.element_size() for t in model.contents.weights.values())
    return {"resident_mib": sizes, "weights_mib": round(weights / 2**20, 1)}


def run_setting(artifact: Path, setting: str, args: argparse.Namespace, logits: Path) -> Any:
    env = {**os.environ, "CUVIL_SHARE_PACKED": SETTINGS[setting]}
    command = [
        sys.executable, "-m", "benchmarks.generation_memory", "--stage", str(artifact),
        "--threads", str(args.threads), "--steps", str(args.steps), "--logits", str(logits),
    ]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        raise RuntimeError(f"the {setting} run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("tiny", "llama100m"), default="tiny")
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--stage", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--logits", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.stage is not None:
        print(json.dumps(stage(args.stage, args.threads, args.steps, args.logits)))
        return
    compile_args = argparse.Namespace(
        model=args.model, streams=args.slots, shared_prefix=0, prompt_max=128, tokens_max=64,
        precision="fp32",
    )  # fmt: skip
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="cuvil-generation-memory-") as folder:
        artifact = compiled_artifact(checkpoint(args.model, Path(folder)), compile_args)
        runs = {
            setting: run_setting(artifact, setting, args, Path(folder) / f"{setting}.pt")
            for setting in SETTINGS
        }
        logits = [torch.load(Path(folder) / f"{setting}.pt") for setting in SETTINGS]
    shared, own = (runs[s]["resident_mib"] for s in SETTINGS)
    result = {
        "model": args.model,
        "slots": args.slots,
        "threads": args.threads,
        "cpu": f"{cpu_name()} x{os.cpu_count()}",
        "weights_mib": runs["shared"]["weights_mib"],
        "runs": runs,
        "warm_up_growth_mib": {
            s: round(runs[s]["resident_mib"]["warmed_up"] - runs[s]["resident_mib"]["loaded"], 1)
            for s in SETTINGS
        },
        "shared_over_per_kernel": round(shared["decoded"] / own["decoded"], 3),
        "logits_max_abs_diff": float((logits[0] - logits[1]).abs().max()),
    }
    emit(result, args.out)


if __name__ == "__main__":
    main()
