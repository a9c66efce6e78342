"""Picking a decode step's tokens: what the sidecar's scheduler and ``generate`` spend per step
beside the model, for 16 rows, greedy, penalized and sampled. Prints one JSON document.

    .venv/bin/python -m benchmarks.token_picks --threads 1

``cuvil.generation.sampling.next_tokens`` on random logits [16, vocab] for the tiny Llama's
vocabulary (2048) and a 32000-token one, each row a sequence holding ``--held`` tokens (a
prompt, of which the last 40 generated: what the penalties count), the same parameters on
every row: greedy; greedy with transformers' repetition penalty; greedy with that and OpenAI's
frequency and presence penalties; sampled at temperature 1 with no cut (OpenAI's default), with
top-k 50 (transformers' and the generate extension's default), and with top-k 20 and top-p 0.9.
Median microseconds of ``--runs`` calls after three, per 16-row step, beside a decode step of
the tiny model for scale (benchmarks README: ~1 ms at one thread on a 2-core EPYC).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch

from benchmarks.decode_attention import median_ms
from benchmarks.host import cpu_name, emit
from cuvil.generation.penalties import PenaltyState
from cuvil.generation.sampling import SamplingParams, next_tokens

ROWS = 16
CASES: dict[str, dict[str, Any]] = {
    "greedy": {},
    "repetition_penalty": {"repetition_penalty": 1.1},
    "all_penalties": {"repetition_penalty": 1.1, "frequency_penalty": 0.3, "presence_penalty": 0.2},
    "sampled": {"do_sample": True, "top_k": 0},
    "sampled_top_k": {"do_sample": True, "top_k": 50},
    "sampled_top_k_top_p": {"do_sample": True, "top_k": 20, "top_p": 0.9},
}  # fmt: skip


def step_us(vocab: int, options: dict[str, Any], held: int, runs: int) -> float:
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(ROWS, vocab, generator=generator)
    tokens = torch.randint(0, vocab, (held,), generator=generator).tolist()
    params = [SamplingParams(seed=row, **options) for row in range(ROWS)]
    states = []
    for _ in range(ROWS):
        state = PenaltyState(vocab, tokens[:-40])
        for token in tokens[-40:]:
            state.add(token)
        states.append(state)
    generators = [p.generator() for p in params]

    def call() -> None:
        next_tokens(logits, params, generators, states.__getitem__)

    return round(median_ms(call, runs) * 1e3, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--held", type=int, default=500)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    report = {
        "cpu": f"{cpu_name()} x{os.cpu_count()}",
        "threads": args.threads,
        "rows": ROWS,
        "held_tokens": args.held,
        "step_us": {
            str(vocab): {
                name: step_us(vocab, options, args.held, args.runs)
                for name, options in CASES.items()
            }
            for vocab in (2048, 32000)
        },
    }
    emit(report, args.out)


if __name__ == "__main__":
    main()
