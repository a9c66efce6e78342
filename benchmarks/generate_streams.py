"""Concurrent generation streams: aggregate tokens/s of 16 streams through the sidecar's
continuous batching against the same requests through transformers' ``generate`` in static
batches. Prints one JSON document.

    .venv/bin/python -m benchmarks.generate_streams --model tiny --streams 16

The model is a Llama from a config with random weights (``--model tiny``: hidden 256, 2
layers, the catalog's tiny Llama; ``llama100m``: hidden 768, 12 layers, ~100M parameters),
saved as a transformers checkpoint in a temporary folder and served by a sidecar subprocess
(``CUVIL_MODEL`` = that folder: ``EagerDecoderEngine``, one slot per stream), or with
``--engine compiled`` compiled by ``cuvil.jit(..., task="text-generation")`` into an artifact
folder with one slot per stream, which the sidecar serves through its compiled prefill/decode
(``--precision bf16``: bf16 GEMM weights and KV cache; greedy tokens may then leave the
fp32 static batch's after some steps, so ``matching_streams`` counts fewer;
``--static-precision bf16`` runs the static batches' model in bf16 too, the like-for-like
comparison on a CPU with bf16 instructions; ``--precision int8``: int8 linear weights, one
scale per output row, bf16 otherwise; ``--static-precision int8``: transformers' bf16 model with
its linears' weights rounded to the same int8 values, so that ``matching_streams`` compares
like with like — its speed is bf16's).
Every request is greedy with ``ignore_eos`` (so each generates exactly its ``max_tokens``),
prompts of ``--prompt-min``..``--prompt-max`` tokens (after ``--shared-prefix`` tokens every
prompt starts with, as a system prompt: the sidecar's prefix reuse, ``--prefix-reuse``, then
writes them once) and ``--tokens-min``..``--tokens-max`` new tokens, spread evenly.
``sidecar``: all streams sent at once over REST ``generate_stream`` (server-sent events) and
read by one thread of this process (``sse_streams.py``: a selector over the sockets;
``client_cpu_s`` is what it spent; ``--stream-interval N``: the sidecar's
``CUVIL_STREAM_INTERVAL``, each stream's events written N tokens at a time, so the client's
inter-token gaps are then mostly zero with a gap every N tokens);
``tokens_per_s`` = tokens received / seconds from the first request to the last token;
``time_to_first_token_ms`` and ``inter_token_ms`` percentiles are measured by the client.
``transformers_static``: the same requests in static batches of ``--static-batch`` (left
padded, in arrival order), each batch generating its longest request's token count with no
stop token (as ``ignore_eos``: an eos token is picked like any other, not suppressed);
``tokens_per_s`` counts only the tokens requests asked for, over the total time.
Each side runs the whole set of requests once untimed, then ``--rounds`` times, the two sides
alternating round by round (the sidecar stays up, idle, while transformers runs); each side's
figures are its round of median tokens/s (``rounds_tokens_per_s``: every round's), and
``sidecar_over_static`` the ratio of the two medians.
``--sample``: every request sampled (temperature 1, top-k 50, its own seed) on both sides,
so ``matching_streams`` is null (the two sides draw differently) and the sidecar's stability
across rounds is what checks it.
``matching_streams``: requests whose sidecar tokens equal the static batch's;
``sidecar_outputs_stable``: every sidecar round gave every stream the same tokens.
The client shares the machine's cores with the sidecar; ``load_average`` is the host's before
and after. ``sidecar_engine_threads``: the compiled engine's intra-op threads, as the sidecar
chose them at load (``--threads`` or one fewer, leaving a core to its frontend), and why.
Both sides run with the sidecar's OpenMP spin (``GOMP_SPINCOUNT``, 3000 unless set): with
libgomp's default a busy 2-core host slows transformers' batched steps several fold.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("GOMP_SPINCOUNT", "3000")  # before torch loads libgomp: as the sidecar

import torch

from benchmarks import grpc_streams, sse_streams
from benchmarks.host import cpu_name, emit

REPO = Path(__file__).resolve().parents[1]
SAMPLED_TOP_K = 50  # --sample: transformers' default, and the generate extension's
MODELS: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                 num_attention_heads=8, num_key_value_heads=2, vocab_size=2048),
    "llama100m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                      num_attention_heads=12, num_key_value_heads=4, vocab_size=32000),
}  # fmt: skip


# the static batches' model dtype; int8: bf16 with every linear's weight rounded as Cuvil's
# int8 precision rounds it (the same values, computed by transformers in bf16)
STATIC_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.bfloat16}


def static_model(path: Path, precision: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from cuvil.passes.precision import with_int8_linears

    model = AutoModelForCausalLM.from_pretrained(
        path, local_files_only=True, dtype=STATIC_DTYPES[precision]
    ).eval()
    return with_int8_linears(model) if precision == "int8" else model


def checkpoint(name: str, folder: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**MODELS[name], max_position_embeddings=1024)
    LlamaForCausalLM(config).eval().save_pretrained(folder / name)
    return folder / name


def compiled_artifact(checkpoint: Path, args: argparse.Namespace) -> Path:
    """The checkpoint compiled for generation: one slot per stream, room for the longest."""
    from transformers import AutoModelForCausalLM

    import cuvil

    model = AutoModelForCausalLM.from_pretrained(checkpoint, local_files_only=True).eval()
    example = {"input_ids": torch.randint(3, 100, (1, 8))}
    compiled = cuvil.jit(
        model, example, task="text-generation", max_batch=args.streams,
        max_seq=args.shared_prefix + args.prompt_max + args.tokens_max, name=args.model,
        precision=args.precision,
    )  # fmt: skip
    return compiled.save(checkpoint.parent / "artifact" / args.model, directory=True)


def requests_for(args: argparse.Namespace, vocab: int) -> list[dict[str, Any]]:
    generator = torch.Generator().manual_seed(1)
    shared = torch.randint(3, vocab, (args.shared_prefix,), generator=generator).tolist()
    requests = []
    for i in range(args.streams):
        fraction = i / max(1, args.streams - 1)
        length = round(args.prompt_min + fraction * (args.prompt_max - args.prompt_min))
        tokens = round(args.tokens_max - fraction * (args.tokens_max - args.tokens_min))
        prompt = shared + torch.randint(3, vocab, (length,), generator=generator).tolist()
        parameters: dict[str, Any] = {"max_tokens": tokens, "ignore_eos": True}
        if args.sample:  # each request its own seed: a round repeats the one before
            parameters |= {"temperature": 1.0, "top_k": SAMPLED_TOP_K, "seed": i}
        requests.append({"input_ids": prompt, "parameters": parameters})
    return requests


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_sidecar(model: Path, args: argparse.Namespace, log: Path) -> tuple[Any, dict[str, int]]:
    """The sidecar serving ``model``, ready; and its ports (``http``, ``grpc``)."""
    port, grpc_port = free_port(), free_port()
    env = {key: value for key, value in os.environ.items() if not key.startswith("CUVIL_")}
    env |= {
        "CUVIL_MODEL": str(model),
        "CUVIL_GRPC_HOST": "127.0.0.1",
        "CUVIL_GRPC_PORT": str(grpc_port),
        "CUVIL_GRPC_FRONTEND": args.grpc_frontend,
        "CUVIL_METRICS_PORT": "0",
        "CUVIL_HTTP_PORT": str(port),
        "CUVIL_GENERATION_SLOTS": str(args.streams),
        "CUVIL_PREFIX_REUSE": args.prefix_reuse,
        "CUVIL_STREAM_INTERVAL": str(args.stream_interval),
        "CUVIL_TORCH_THREADS": str(args.threads),
        "OMP_NUM_THREADS": str(args.threads),
        "PYTHONPATH": os.pathsep.join([str(REPO / "runtime_sidecar"), str(REPO)]),
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "cuvil_sidecar.main"],
        env=env,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the sidecar exited:\n{log.read_text()[-3000:]}")
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            connection.request("GET", "/v2/health/ready")
            if connection.getresponse().status == 200:
                return process, {"http": port, "grpc": grpc_port}
        except OSError:
            pass
        time.sleep(0.2)
    process.kill()
    raise RuntimeError("the sidecar was not ready within 300 s")


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = torch.tensor(sorted(values), dtype=torch.float64)
    if not len(ordered):
        return {}
    return {f"p{q}": round(float(torch.quantile(ordered, q / 100)) * 1e3, 3) for q in (50, 90, 99)}


def through_sidecar(
    ports: dict[str, int], protocol: str, model: str, requests: list[dict[str, Any]]
) -> dict[str, Any]:
    """The requests sent at once over ``protocol``: REST server-sent events (a connection per
    request) or gRPC ``ModelStreamInfer`` (one stream carrying every request)."""

    def read(batch: list[dict[str, Any]]) -> list[tuple[list[int], list[float]]]:
        if protocol == "grpc":
            return grpc_streams.read_streams(f"127.0.0.1:{ports['grpc']}", model, batch)
        return sse_streams.read_streams(ports["http"], f"/v2/models/{model}/generate_stream", batch)

    cpu_before = time.process_time()
    started = time.perf_counter()
    results = read(requests)
    client_cpu = time.process_time() - cpu_before
    seconds = max(times[-1] for _, times in results) - started
    first = [times[0] - started for _, times in results]
    gaps = [b - a for _, times in results for a, b in itertools.pairwise(times)]
    total = sum(len(tokens) for tokens, _ in results)
    return {
        "protocol": protocol,
        "tokens": total,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(total / seconds, 1),
        "time_to_first_token_ms": percentiles(first),
        "inter_token_ms": percentiles(gaps),
        "client_cpu_s": round(client_cpu, 3),
        "outputs": [tokens for tokens, _ in results],
    }


def static_batches(
    model: Any, requests: list[dict[str, Any]], batch: int, sample: bool = False
) -> dict[str, Any]:
    outputs: list[list[int]] = []
    wanted = sum(r["parameters"]["max_tokens"] for r in requests)
    started = time.perf_counter()
    for at in range(0, len(requests), batch):
        group = requests[at : at + batch]
        longest = max(len(r["input_ids"]) for r in group)
        ids = torch.zeros(len(group), longest, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, request in enumerate(group):  # left padding
            prompt = torch.tensor(request["input_ids"])
            ids[row, longest - len(prompt) :] = prompt
            mask[row, longest - len(prompt) :] = 1
        new = max(r["parameters"]["max_tokens"] for r in group)
        with torch.inference_mode():
            generated = model.generate(
                ids, attention_mask=mask, max_new_tokens=new, do_sample=sample,
                temperature=1.0, top_k=SAMPLED_TOP_K, eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
        for row, request in enumerate(group):
            outputs.append(generated[row, longest:][: request["parameters"]["max_tokens"]].tolist())
    seconds = time.perf_counter() - started
    return {
        "batch": batch,
        "tokens": wanted,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(wanted / seconds, 1),
        "outputs": outputs,
    }


def interleaved(
    rounds: int, sidecar: Callable[[], dict[str, Any]], static: Callable[[], dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Each side's rounds: one untimed round each first (the sidecar's first full burst and
    transformers' first ``generate`` pay one-time costs), then ``rounds`` each, alternating
    which side goes first, so that the host's drift hits both alike."""
    sidecar(), static()
    sidecar_rounds, static_rounds = [], []
    for index in range(rounds):
        if index % 2 == 0:
            sidecar_rounds.append(sidecar())
            static_rounds.append(static())
        else:
            static_rounds.append(static())
            sidecar_rounds.append(sidecar())
    return sidecar_rounds, static_rounds


def median_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The round of median tokens/s (the lower of the two middle ones), with every round's
    tokens/s beside it."""
    ordered = sorted(rounds, key=lambda r: r["tokens_per_s"])
    return ordered[(len(ordered) - 1) // 2] | {
        "rounds_tokens_per_s": [r["tokens_per_s"] for r in rounds]
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--prompt-min", type=int, default=16)
    parser.add_argument("--prompt-max", type=int, default=128)
    parser.add_argument("--tokens-min", type=int, default=32)
    parser.add_argument("--tokens-max", type=int, default=64)
    parser.add_argument("--static-batch", type=int, default=16)
    parser.add_argument(
        "--shared-prefix", type=int, default=0,
        help="tokens every prompt starts with (a system prompt) before its own",
    )  # fmt: skip
    parser.add_argument(
        "--prefix-reuse", choices=("on", "off"), default="on",
        help="the sidecar's CUVIL_PREFIX_REUSE",
    )  # fmt: skip
    parser.add_argument(
        "--stream-interval", type=int, default=1,
        help="the sidecar's CUVIL_STREAM_INTERVAL: tokens per write of a REST stream",
    )  # fmt: skip
    parser.add_argument(
        "--sample", action="store_true",
        help="sampled requests (temperature 1, top-k 50, seeded) rather than greedy",
    )  # fmt: skip
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--protocol", choices=("rest", "grpc"), default="rest",
        help="rest: generate_stream, server-sent events; grpc: ModelStreamInfer",
    )  # fmt: skip
    parser.add_argument(
        "--grpc-frontend", choices=("auto", "native", "grpcio"), default="auto",
        help="the sidecar's CUVIL_GRPC_FRONTEND (auto: native where it builds)",
    )  # fmt: skip
    parser.add_argument("--engine", choices=("eager", "compiled"), default="eager")
    parser.add_argument(
        "--precision", choices=("fp32", "bf16", "int8"), default="fp32",
        help="the compiled engine's",
    )  # fmt: skip
    parser.add_argument(
        "--static-precision", choices=("fp32", "bf16", "int8"), default="fp32",
        help="the dtype of transformers' model in the static batches",
    )  # fmt: skip
    parser.add_argument(
        "--rounds", type=int, default=3,
        help="timed rounds per side, interleaved, after one untimed round each",
    )  # fmt: skip
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="cuvil-generate-") as folder:
        path = checkpoint(args.model, Path(folder))
        requests = requests_for(args, int(MODELS[args.model]["vocab_size"]))
        served = path if args.engine == "eager" else compiled_artifact(path, args)
        peer = static_model(path, args.static_precision)
        process, ports = start_sidecar(served, args, Path(folder) / "log")
        try:
            sidecar_rounds, static_rounds = interleaved(
                args.rounds,
                lambda: through_sidecar(ports, args.protocol, path.name, requests),
                lambda: static_batches(peer, requests, args.static_batch, args.sample),
            )
        finally:
            process.terminate()
            process.wait(30)
        engine_threads = _engine_threads(Path(folder) / "log")
    sidecar, static = median_round(sidecar_rounds), median_round(static_rounds)
    stable = all(r["outputs"] == sidecar_rounds[0]["outputs"] for r in sidecar_rounds)
    pairs = zip(sidecar.pop("outputs"), static.pop("outputs"), strict=True)
    matching = None if args.sample else sum(a == b for a, b in pairs)  # draws differ by design
    result = {
        "model": args.model,
        "streams": args.streams,
        "shared_prefix": args.shared_prefix,
        "prefix_reuse": args.prefix_reuse,
        "stream_interval": args.stream_interval,
        "sampling": f"temperature 1, top-k {SAMPLED_TOP_K}, seeded" if args.sample else "greedy",
        "threads": args.threads,
        "engine": "EagerDecoderEngine" if args.engine == "eager" else "compiled (cuvil.jit)",
        "precision": "fp32" if args.engine == "eager" else args.precision,
        "gomp_spincount": os.environ["GOMP_SPINCOUNT"],
        "cpu": f"{cpu_name()} x{os.cpu_count()}",
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "sidecar_engine_threads": engine_threads,
        "sidecar": sidecar,
        "transformers_static": static | {"precision": args.static_precision},
        "sidecar_over_static": round(sidecar["tokens_per_s"] / static["tokens_per_s"], 3),
        "matching_streams": matching,
        "sidecar_outputs_stable": stable,
    }
    emit(result, args.out)


def _engine_threads(log: Path) -> str:
    """The sidecar's log line on its engine's thread count (compiled engines choose one at
    load, runtime_sidecar/cuvil_sidecar/generation/engine_threads.py); "" for the eager one."""
    marker = " runs its engine at "
    for line in log.read_text(errors="replace").splitlines():
        if marker in line:
            return line.split(marker, 1)[1]
    return ""


if __name__ == "__main__":
    main()
