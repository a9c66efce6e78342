"""Decoder generation on CPU: transformers' ``generate`` against Cuvil's compiled prefill/decode.

    .venv/bin/python benchmarks/generate.py --threads 2 --runs 3 > benchmarks/results/….json

Models: the tiny Llama of ``cuvil.models`` and a ~100M-parameter Llama-shaped model from a
config (random weights). Peers at batch 1, one function each (``PEERS``), each generating
``--new-tokens`` greedy tokens from a ``--prompt``-token prompt, timed per token through
transformers' streamer protocol (``put`` per step), the peers interleaved run by run:

- ``transformers_eager``: ``model.generate`` with its own dynamic KV cache;
- ``transformers_compiled``: ``model.generate`` with a static cache and ``torch.compile`` of the
  forward, where it compiles (its error is recorded where it does not);
- ``cuvil``: ``cuvil.jit(model, …, task="text-generation").generate``;
- ``cuvil_bf16``: the same compiled with ``precision="bf16"`` (bf16 GEMM weights, fp32 KV
  cache); its greedy tokens may leave eager's after some steps (bf16 rounding flips a close
  argmax), so ``same_tokens_as_eager`` is expected false for it;
- ``transformers_eager_bf16`` (with ``--bf16-peers``): ``model.generate`` on a bf16 copy of the
  model, the like-for-like peer of ``cuvil_bf16`` on a CPU with bf16 instructions (elsewhere
  ATen emulates bf16 and it is slow); ``cuvil_bf16`` gets its ratios to it too;
- ``cuvil_int8`` (with ``--peers …,cuvil_int8``): compiled with ``precision="int8"`` (int8
  linear weights with row scales, bf16 otherwise), with its ratios to the bf16 peer as well.

Per peer: time to first token (prefill), inter-token p50/p99 (decode steps), decode tokens/s
(1 / mean inter-token time), end-to-end tokens/s; ratios against transformers eager.

``--streams N`` adds aggregate tokens/s for N concurrent streams of different prompt lengths
(``STREAM_PEERS``): transformers in static batches (left-padded, all streams in one batch) and
Cuvil's in-process ``generate`` on the same batch, fp32 and bf16 (with ``--bf16-peers`` also
transformers' static batch in bf16): each run once untimed, then
``--stream-rounds`` runs each, interleaved, the median shown (``rounds_seconds``: every run). The
same streams through the
sidecar's continuous batching, over HTTP, are ``benchmarks/generate_streams.py`` (``--engine
compiled`` for this compiled model).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # no compile workers left behind
os.environ.setdefault("GOMP_SPINCOUNT", "3000")  # before torch loads libgomp: as the sidecar

import torch

from cuvil.runtime.generation import GenerationModel

MAX_SEQ = 512
WARMUP_RUNS = 3


@dataclass
class TokenClock:
    """transformers' streamer protocol: the time of each ``put`` after the prompt's."""

    start: float = field(default_factory=time.perf_counter)
    times: list[float] = field(default_factory=list)
    prompt_seen: bool = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


@dataclass
class Case:
    name: str
    model: Any  # a transformers causal LM
    prompt: torch.Tensor  # [1, prompt]
    new_tokens: int
    parameters: int


def tiny_llama() -> torch.nn.Module:
    from cuvil.models.catalog import tiny_llama as spec

    return spec().model


def llama_100m() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        vocab_size=32000,
        max_position_embeddings=MAX_SEQ,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).eval()


MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    "tiny_llama": tiny_llama,
    "llama_100m": llama_100m,
}


def _greedy_options(case: Case) -> dict[str, Any]:
    return {"max_new_tokens": case.new_tokens, "do_sample": False}


def _compiled(case: Case, precision: str = "fp32") -> GenerationModel:
    import cuvil

    compiled = cuvil.jit(
        case.model,
        {"input_ids": case.prompt},
        task="text-generation",
        max_batch=16,
        max_seq=MAX_SEQ,
        precision=precision,
    )
    assert isinstance(compiled, GenerationModel)
    return compiled


def _quiet_generation_config(model: Any) -> None:
    """No end token (every peer generates exactly ``new_tokens``), pad 0, and transformers'
    own KV cache on (the tiny Llama's config turns it off for its forward benchmark)."""
    model.config.use_cache = True
    model.generation_config.use_cache = True
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0


# ---------------------------------------------------------------- batch-1 peers


def transformers_eager(case: Case) -> Callable[[TokenClock], torch.Tensor]:
    model = case.model

    def run(clock: TokenClock) -> torch.Tensor:
        with torch.inference_mode():
            return model.generate(case.prompt, streamer=clock, **_greedy_options(case))

    return run


def transformers_compiled(case: Case) -> Callable[[TokenClock], torch.Tensor]:
    """Static cache and ``torch.compile`` of the forward (transformers' recipe)."""
    import copy

    model = copy.deepcopy(case.model)
    _quiet_generation_config(model)
    model.generation_config.cache_implementation = "static"
    model.forward = torch.compile(model.forward, dynamic=False)

    def run(clock: TokenClock) -> torch.Tensor:
        with torch.inference_mode():
            return model.generate(case.prompt, streamer=clock, **_greedy_options(case))

    return run


def transformers_eager_bf16(case: Case) -> Callable[[TokenClock], torch.Tensor]:
    """``generate`` on a bf16 copy of the model."""
    return transformers_eager(_bf16_case(case))


def _bf16_case(case: Case) -> Case:
    import copy

    return replace(case, model=copy.deepcopy(case.model).to(torch.bfloat16))


def cuvil_generate(case: Case, precision: str = "fp32") -> Callable[[TokenClock], torch.Tensor]:
    compiled = _compiled(case, precision)

    def run(clock: TokenClock) -> torch.Tensor:
        options = {**_greedy_options(case), "eos_token_id": None, "pad_token_id": 0}
        return compiled.generate(case.prompt, streamer=clock, **options)

    return run


PEERS: dict[str, Callable[[Case], Callable[[TokenClock], torch.Tensor]]] = {
    "transformers_eager": transformers_eager,
    "transformers_compiled": transformers_compiled,
    "cuvil": cuvil_generate,
    "cuvil_bf16": partial(cuvil_generate, precision="bf16"),
    "cuvil_int8": partial(cuvil_generate, precision="int8"),
    "transformers_eager_bf16": transformers_eager_bf16,
}
DEFAULT_PEERS = ("transformers_eager", "transformers_compiled", "cuvil", "cuvil_bf16")


def timings(clock: TokenClock) -> dict[str, float]:
    gaps = [b - a for a, b in zip(clock.times, clock.times[1:], strict=False)]
    total = clock.times[-1] - clock.start
    return {
        "ttft_ms": (clock.times[0] - clock.start) * 1e3,
        "inter_token_p50_ms": statistics.median(gaps) * 1e3,
        "inter_token_p99_ms": _percentile(gaps, 0.99) * 1e3,
        "decode_tokens_per_s": len(gaps) / sum(gaps),
        "end_to_end_tokens_per_s": len(clock.times) / total,
    }


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def batch_one(case: Case, runs: int, peers: list[str]) -> dict[str, Any]:
    prepared: dict[str, Callable[[TokenClock], torch.Tensor]] = {}
    results: dict[str, Any] = {}
    outputs: dict[str, torch.Tensor] = {}
    for name in peers:
        started = time.perf_counter()
        try:
            prepared[name] = PEERS[name](case)
            for _ in range(WARMUP_RUNS):  # compiles lazily; settles per-shape kernel choices
                outputs[name] = prepared[name](TokenClock())
        except Exception as error:  # a peer that cannot run is recorded, not fatal
            results[name] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
            prepared.pop(name, None)
            continue
        results[name] = {"setup_seconds": round(time.perf_counter() - started, 2), "runs": []}
        print(f"{case.name}: {name} ready", file=sys.stderr)
    for _ in range(runs):
        for name, run in prepared.items():  # interleaved: drift hits every peer alike
            clock = TokenClock()
            run(clock)
            results[name]["runs"].append(timings(clock))
    for name in prepared:
        entry = results[name]
        for key in entry["runs"][0]:
            entry[key] = round(statistics.median(r[key] for r in entry["runs"]), 3)
        del entry["runs"]
        reference = outputs.get("transformers_eager")
        entry["same_tokens_as_eager"] = reference is not None and torch.equal(
            outputs[name], reference
        )
    _speedups(results, prepared, "transformers_eager", "eager")
    bf16_peers = [name for name in prepared if "bf16" in name or "int8" in name]
    _speedups(results, bf16_peers, "transformers_eager_bf16", "eager_bf16")
    return results


def _speedups(results: dict[str, Any], names: Any, base: str, label: str) -> None:
    """Decode tokens/s and time to first token of ``names`` against the peer ``base``."""
    reference = results.get(base, {})
    if "decode_tokens_per_s" not in reference:
        return
    for name in names:
        if name != base:
            entry = results[name]
            entry[f"decode_speedup_vs_{label}"] = round(
                entry["decode_tokens_per_s"] / reference["decode_tokens_per_s"], 2
            )
            entry[f"ttft_speedup_vs_{label}"] = round(reference["ttft_ms"] / entry["ttft_ms"], 2)


# ---------------------------------------------------------------- concurrent streams


def _stream_prompts(case: Case, streams: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    lengths = [8 + (17 * index) % 48 for index in range(streams)]
    return [torch.randint(3, 1000, (length,), generator=generator) for length in lengths]


def _left_padded(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = prompt
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def transformers_static_batches(case: Case, prompts: list[torch.Tensor]) -> Callable[[], None]:
    """All streams in one left-padded batch through ``model.generate``."""
    ids, mask = _left_padded(prompts)

    def run() -> None:
        with torch.inference_mode():
            case.model.generate(ids, attention_mask=mask, **_greedy_options(case))

    return run


def cuvil_in_process(
    case: Case, prompts: list[torch.Tensor], precision: str = "fp32"
) -> Callable[[], None]:
    """Cuvil's ``generate`` on the same left-padded batch (groups of its slots)."""
    compiled = _compiled(case, precision)
    ids, mask = _left_padded(prompts)
    options = {**_greedy_options(case), "eos_token_id": None, "pad_token_id": 0}

    def run() -> None:
        compiled.generate(ids, attention_mask=mask, **options)

    return run


StreamPeer = Callable[[Case, list[torch.Tensor]], Callable[[], None]]
STREAM_PEERS: dict[str, StreamPeer] = {
    "transformers_static_batches": transformers_static_batches,
    "cuvil_in_process": cuvil_in_process,
    "cuvil_bf16_in_process": partial(cuvil_in_process, precision="bf16"),
}
BF16_STREAM_PEERS: dict[str, StreamPeer] = {
    "transformers_static_batches_bf16": lambda case, prompts: transformers_static_batches(
        _bf16_case(case), prompts
    ),
}


def concurrent_streams(
    case: Case, streams: int, rounds: int, peers: dict[str, StreamPeer] = STREAM_PEERS
) -> dict[str, Any]:
    """Each peer prepared and run once untimed on the whole batch (first calls at its size pay
    one-time costs), then ``rounds`` runs each, round by round, the peer that goes first
    rotating; each peer's median run."""
    prompts = _stream_prompts(case, streams)
    runs: dict[str, Callable[[], None]] = {}
    results: dict[str, Any] = {}
    for name, peer in peers.items():
        try:
            runs[name] = peer(case, prompts)
            runs[name]()
        except Exception as error:
            results[name] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
            runs.pop(name, None)
    taken: dict[str, list[float]] = {name: [] for name in runs}
    order = list(runs)
    for index in range(rounds):
        shift = index % max(1, len(order))
        for name in order[shift:] + order[:shift]:
            started = time.perf_counter()
            runs[name]()
            taken[name].append(time.perf_counter() - started)
    tokens = len(prompts) * case.new_tokens
    for name, times in taken.items():
        median = statistics.median(times)
        results[name] = {
            "seconds": round(median, 3),
            "tokens_per_s": round(tokens / median, 1),
            "rounds_seconds": [round(t, 3) for t in times],
        }
    base = results.get("transformers_static_batches", {}).get("tokens_per_s")
    base_bf16 = results.get("transformers_static_batches_bf16", {}).get("tokens_per_s")
    for name, result in results.items():
        if base and "tokens_per_s" in result:
            result["ratio_vs_transformers"] = round(result["tokens_per_s"] / base, 2)
        if base_bf16 and "tokens_per_s" in result and "bf16" in name:
            result["ratio_vs_transformers_bf16"] = round(result["tokens_per_s"] / base_bf16, 2)
    ordered = {name: results[name] for name in peers if name in results}
    return {"streams": streams, "new_tokens": case.new_tokens, "rounds": rounds, **ordered}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--peers", default=",".join(DEFAULT_PEERS))
    parser.add_argument(
        "--bf16-peers", action="store_true",
        help="add transformers in bf16: transformers_eager_bf16 and its static batches",
    )  # fmt: skip
    parser.add_argument("--streams", type=int, default=0, help="concurrent streams (0: off)")
    parser.add_argument(
        "--stream-rounds", type=int, default=3, help="timed runs per peer of the streams"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    document: dict[str, Any] = {
        "benchmark": "generate",
        "command": " ".join(sys.argv),
        "threads": args.threads,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "gomp_spincount": os.environ.get("GOMP_SPINCOUNT"),
        "load_average": os.getloadavg(),
        "torch": torch.__version__,
        "prompt_tokens": args.prompt,
        "new_tokens": args.new_tokens,
        "models": {},
    }
    for name in args.models.split(","):
        model = MODELS[name]()
        _quiet_generation_config(model)
        generator = torch.Generator().manual_seed(0)
        prompt = torch.randint(3, 1000, (1, args.prompt), generator=generator)
        parameters = sum(p.numel() for p in model.parameters())
        case = Case(name, model, prompt, args.new_tokens, parameters)
        entry: dict[str, Any] = {"parameters": parameters}
        peers = args.peers.split(",") + (["transformers_eager_bf16"] * args.bf16_peers)
        entry["batch_1"] = batch_one(case, args.runs, list(dict.fromkeys(peers)))
        if args.streams:
            stream_peers = STREAM_PEERS | (BF16_STREAM_PEERS if args.bf16_peers else {})
            entry["concurrent"] = concurrent_streams(
                case, args.streams, args.stream_rounds, stream_peers
            )
        document["models"][name] = entry
    document["load_average_after"] = os.getloadavg()
    print(json.dumps(document, indent=2))


if __name__ == "__main__":
    main()
