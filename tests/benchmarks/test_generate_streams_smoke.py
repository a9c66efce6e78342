"""The concurrent-streams benchmark end to end on the tiny Llama: compiled for generation, served
by a sidecar subprocess, four streams sharing their first 12 tokens (written once: the
sidecar's prefix reuse) read by the one-thread SSE client, the same requests through
transformers' static batch, two rounds a side, one JSON document."""

from __future__ import annotations

from tests.benchmarks.scripts import run_report


def test_four_compiled_streams_match_the_static_batch() -> None:
    report = run_report(
        "benchmarks.generate_streams",
        *("--model", "tiny", "--engine", "compiled", "--streams", "4", "--static-batch", "2"),
        *("--prompt-min", "4", "--prompt-max", "20", "--tokens-min", "3", "--tokens-max", "9"),
        *("--threads", "1", "--shared-prefix", "12", "--rounds", "2"),
    )
    sidecar, static = report["sidecar"], report["transformers_static"]
    assert sidecar["tokens"] == static["tokens"] == 9 + 7 + 5 + 3  # tokens-max down to -min
    assert report["matching_streams"] == 4  # greedy: every stream's tokens as transformers'
    assert report["sidecar_outputs_stable"]  # and the same in every round
    assert len(sidecar["rounds_tokens_per_s"]) == len(static["rounds_tokens_per_s"]) == 2
    assert sidecar["tokens_per_s"] in sidecar["rounds_tokens_per_s"]
    assert sidecar["tokens_per_s"] > 0 and static["tokens_per_s"] > 0
    # events read in one receive share its time: gaps may be 0, not all of them
    assert sidecar["inter_token_ms"]["p99"] > 0 and sidecar["client_cpu_s"] >= 0
    assert report["sidecar_engine_threads"].startswith("1 thread")
    assert (report["shared_prefix"], report["prefix_reuse"]) == (12, "on")
    assert static["precision"] == "fp32"


def test_sampled_streams_repeat_round_to_round() -> None:
    """``--sample``: seeded draws on both sides; the sidecar's streams the same every round,
    nothing compared with transformers' (its draws are its own); the static batches' model in
    bf16 (``--static-precision``)."""
    report = run_report(
        "benchmarks.generate_streams",
        *("--model", "tiny", "--engine", "compiled", "--streams", "2", "--static-batch", "2"),
        *("--prompt-min", "4", "--prompt-max", "8", "--tokens-min", "3", "--tokens-max", "6"),
        *("--threads", "1", "--rounds", "2", "--sample", "--static-precision", "bf16"),
    )
    assert report["sampling"] == "temperature 1, top-k 50, seeded"
    assert report["matching_streams"] is None and report["sidecar_outputs_stable"]
    assert report["sidecar"]["tokens"] == report["transformers_static"]["tokens"] == 6 + 3
    assert report["transformers_static"]["precision"] == "bf16"
