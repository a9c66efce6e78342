"""The generation benchmark end to end on the tiny Llama: batch-1 figures for eager and Cuvil,
and the in-process streams timed in interleaved rounds after an untimed run of each peer."""

from __future__ import annotations

from benchmarks.generate import STREAM_PEERS
from tests.benchmarks.scripts import run_report


def test_tiny_batch_one_and_interleaved_stream_rounds() -> None:
    report = run_report(
        "benchmarks.generate",
        *("--models", "tiny_llama", "--peers", "transformers_eager,cuvil", "--runs", "1"),
        *("--new-tokens", "4", "--streams", "4", "--stream-rounds", "2"),
    )
    (entry,) = report["models"].values()
    assert entry["batch_1"]["cuvil"]["same_tokens_as_eager"]
    concurrent = entry["concurrent"]
    assert (concurrent["streams"], concurrent["rounds"]) == (4, 2)
    for name in STREAM_PEERS:
        peer = concurrent[name]
        assert len(peer["rounds_seconds"]) == 2 and min(peer["rounds_seconds"]) > 0, peer
        assert min(peer["rounds_seconds"]) <= peer["seconds"] <= max(peer["rounds_seconds"])
        assert peer["tokens_per_s"] > 0 and peer["ratio_vs_transformers"] > 0
    assert concurrent["transformers_static_batches"]["ratio_vs_transformers"] == 1.0
