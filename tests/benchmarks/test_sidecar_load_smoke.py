"""The sidecar load benchmark end to end on the MLP: sidecar subprocesses, tritonclient load at
two concurrencies with batching off and on, over gRPC and REST, the synchronous and
shared-memory clients (whose outputs must equal the raw ones) on both gRPC front ends beside
in-process runs and the echo servers' floors (answering at once, and after running the model),
KServe's model server as the peer loaded alike (gRPC and REST, the ratios beside each of the
sidecar's runs), and the JSON it prints."""

from __future__ import annotations

from pathlib import Path

from tests.benchmarks.scripts import run_report


def test_mlp_load_report(tmp_path: Path) -> None:
    report = run_report(
        "sidecar_load.py",
        *("--models", "mlp", "--concurrency", "1,2", "--duration", "0.5"),
        *("--artifacts", str(tmp_path)),
    )
    mlp = report["models"]["mlp"]
    for mode in ("batching_off", "batching_on", "batching_off_http", "batching_on_http"):
        rows = mlp[mode]
        assert [row["concurrency"] for row in rows] == [1, 2]
        for row in rows:
            assert row["requests"] > 0 and row["qps"] > 0
            assert 0 < row["p50_ms"] <= row["p95_ms"] <= row["p99_ms"]
    assert mlp["frontend"] == "native"
    assert set(mlp["sync_client"]) == {"native", "grpcio"}
    beside, floor = mlp["sync_client_in_process_p50_ms"], mlp["transport_floor_p50_ms"]
    assert beside > 0 and floor > 0
    model_floor = mlp["model_floor_p50_ms"]
    assert model_floor > 0
    for sync in mlp["sync_client"].values():
        assert sync["p50_ms"] > 0 and sync["shared_memory_p50_ms"] > 0
        assert sync["rpc_floor_p50_ms"] > 0
        assert sync["overhead_ms"] == round(sync["p50_ms"] - beside, 3)
        assert sync["beyond_transport_floor_ms"] == round(sync["p50_ms"] - floor - beside, 3)
        assert sync["beyond_model_floor_ms"] == round(sync["p50_ms"] - model_floor, 3)
    assert mlp["server_c1"]["request_mean_ms"] >= mlp["server_c1"]["compute_mean_ms"] > 0
    assert mlp["overhead_ms"] == round(
        mlp["batching_off"][0]["p50_ms"] - mlp["in_process_p50_ms"], 3
    )
    peer = mlp["kserve_peer"]
    for protocol in ("grpc", "http"):
        assert [row["concurrency"] for row in peer[protocol]] == [1, 2]
        assert all(row["requests"] > 0 and row["qps"] > 0 for row in peer[protocol])
    versus = peer["sidecar_vs_peer"]
    assert set(versus) == {"batching_off", "batching_on", "batching_off_http", "batching_on_http"}
    for mode, rows in versus.items():
        theirs = peer["http" if mode.endswith("_http") else "grpc"]
        for ratio, ours, peer_row in zip(rows, mlp[mode], theirs, strict=True):
            assert ratio["concurrency"] == ours["concurrency"] == peer_row["concurrency"]
            assert ratio["qps_ratio"] == round(ours["qps"] / peer_row["qps"], 2)
            assert ratio["p50_ratio"] == round(peer_row["p50_ms"] / ours["p50_ms"], 2)
            assert ratio["p99_ratio"] == round(peer_row["p99_ms"] / ours["p99_ms"], 2)
