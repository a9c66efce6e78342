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


def test_bf16_peers_give_the_bf16_rows_their_like_for_like_ratios() -> None:
    """``--bf16-peers``: transformers on a bf16 copy of the model, at batch 1 and in the static
    batch, and Cuvil's bf16 rows measured against both it and fp32 eager."""
    report = run_report(
        "benchmarks.generate",
        *("--models", "tiny_llama", "--peers", "transformers_eager,cuvil_bf16", "--runs", "1"),
        *("--new-tokens", "4", "--streams", "2", "--stream-rounds", "1", "--bf16-peers"),
    )
    (entry,) = report["models"].values()
    batch_1 = entry["batch_1"]
    assert list(batch_1) == ["transformers_eager", "cuvil_bf16", "transformers_eager_bf16"]
    assert batch_1["transformers_eager_bf16"]["decode_tokens_per_s"] > 0
    for key in ("decode_speedup_vs_eager", "decode_speedup_vs_eager_bf16"):
        assert batch_1["cuvil_bf16"][key] > 0
    assert "decode_speedup_vs_eager_bf16" not in batch_1["transformers_eager"]
    concurrent = entry["concurrent"]
    assert concurrent["transformers_static_batches_bf16"]["ratio_vs_transformers_bf16"] == 1.0
    assert concurrent["cuvil_bf16_in_process"]["ratio_vs_transformers_bf16"] > 0
    assert "ratio_vs_transformers_bf16" not in concurrent["cuvil_in_process"]
