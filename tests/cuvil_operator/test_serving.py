"""status.serving: pods with an injected sidecar, counted per pinned reference."""

from __future__ import annotations

import json
from typing import Any

import pytest
from cuvil_operator.serving import (
    build_serving,
    index_pod,
    pods_to_move,
    reconcile_serving,
    serving_patch,
)

REF_A = "registry.example.com/m@sha256:" + "a" * 64
REF_B = "registry.example.com/m@sha256:" + "b" * 64
READY = {"conditions": [{"type": "Ready", "status": "True"}]}


def _meta(ref: str | None = REF_A, **extra: object) -> dict[str, object]:
    annotations = {"cuvil.dev/injected": ref} if ref else {}
    return {"namespace": "team", "name": "app-1", "labels": {"cuvil.dev/model": "minilm"},
            "annotations": annotations, **extra}  # fmt: skip


def test_only_pods_the_webhook_pinned_are_indexed() -> None:
    pod = {"name": "app-1", "ref": REF_A, "target": None}
    assert index_pod(_meta(), READY) == {("team", "minilm"): {**pod, "ready": True}}
    assert index_pod(_meta(), {}) == {("team", "minilm"): {**pod, "ready": False}}
    assert index_pod(_meta(ref=None), READY) is None
    assert index_pod(_meta(deletionTimestamp="2026-12-02T01:00:00Z"), READY) is None


def test_counts_per_reference_and_writes_only_on_change() -> None:
    pods = [{"ref": REF_A, "ready": True}, {"ref": REF_B, "ready": False},
            {"ref": REF_B, "ready": True}]  # fmt: skip
    serving = build_serving(pods)
    assert serving == [{"ref": REF_B, "pods": 2, "ready": 1}, {"ref": REF_A, "pods": 1, "ready": 1}]
    assert serving_patch({"serving": serving}, pods) is None
    assert serving_patch({"serving": serving}, []) == {"serving": None}
    assert serving_patch({}, []) is None


PROMOTED = {"generation": 2, "ref": REF_B, "targets": {"cpu-x86_64": REF_B + "-cpu"}}


def test_pods_pinned_to_anything_but_the_promoted_reference_are_moved() -> None:
    pods = [
        {"name": "on-index", "ref": REF_A, "target": None, "ready": True},
        {"name": "on-target", "ref": REF_A + "-cpu", "target": "cpu-x86_64", "ready": True},
        {"name": "current", "ref": REF_B, "target": None, "ready": True},
    ]
    moved: list[tuple[str, str, str]] = []
    events: list[str] = []
    patch = reconcile_serving(
        {"namespace": "team", "name": "minilm"},
        {"promoted": PROMOTED},
        pods,
        lambda namespace, name, ref: moved.append((namespace, name, ref)),
        lambda type_, reason, message: events.append(f"{reason}: {message}"),
    )
    assert moved == [("team", "on-index", REF_B), ("team", "on-target", REF_B + "-cpu")]
    assert events == ["RolledOut: 2 pods moved to generation 2: on-index, on-target"]
    assert patch == {"serving": [{"ref": REF_B, "pods": 2, "ready": 2},
                                 {"ref": REF_B + "-cpu", "pods": 1, "ready": 1}]}  # fmt: skip


def test_nothing_moves_without_a_promotion() -> None:
    pods = [{"name": "p", "ref": REF_A, "target": None, "ready": False}]
    assert pods_to_move(None, pods) == []
    assert pods_to_move({"generation": 1, "ref": REF_A}, pods) == []


REF_C = "registry.example.com/m@sha256:" + "c" * 64  # the candidate's index
GPU_C = "registry.example.com/m@sha256:" + "d" * 64  # its cuda-sm_90 manifest
CANDIDATE = {"generation": 3, "ref": REF_C, "digest": "sha256:" + "c" * 64,
             "targets": {"cuda-sm_90": GPU_C},
             "awaiting": {"cuda-sm_90": {"maxLatencyP99Ms": 5.0}}}  # fmt: skip


def _canary(ref: str, measurement: dict[str, object] | None = None) -> dict[str, object]:
    pod: dict[str, object] = {"name": "canary", "ref": ref, "target": "cuda-sm_90",
                              "track": "candidate", "ready": True}  # fmt: skip
    if measurement is not None:
        pod["measurement"] = json.dumps(measurement)
    return pod


def _reconcile(status: dict[str, object], pods: list[dict[str, object]]) -> Any:
    moved: list[tuple[str, str]] = []
    events: list[str] = []
    patch = reconcile_serving(
        {"namespace": "team", "name": "minilm"}, status, pods,
        lambda namespace, name, ref: moved.append((name, ref)),
        lambda type_, reason, message: events.append(f"{reason}: {message}"),
        "2026-12-02T05:00:00Z",
    )  # fmt: skip
    return patch, moved, events


def test_a_canary_and_its_measurement_are_indexed() -> None:
    meta = _meta(annotations={"cuvil.dev/injected": REF_A, "cuvil.dev/track": "candidate",
                              "cuvil.dev/measurement": '{"digest": "sha256:1"}'})  # fmt: skip
    (entry,) = (index_pod(meta, READY) or {}).values()
    assert entry["track"] == "candidate" and entry["measurement"] == '{"digest": "sha256:1"}'


def test_a_canary_follows_the_candidate_and_the_others_stay_on_the_promoted() -> None:
    promoted = {"generation": 2, "ref": REF_B, "targets": {"cuda-sm_90": REF_B}}
    pods = [_canary(REF_B), {"name": "app", "ref": REF_B, "target": None, "ready": True}]
    assert pods_to_move(promoted, pods, CANDIDATE) == [("canary", GPU_C)]
    assert pods_to_move(promoted, [_canary(GPU_C)], None) == [("canary", REF_B)]  # none left


def test_a_canarys_measurement_promotes_the_candidate_and_every_pod_moves_to_it() -> None:
    promoted = {"generation": 2, "ref": REF_B, "targets": {"cuda-sm_90": REF_B}}
    measured = {"digest": GPU_C.rpartition("@")[2], "latencyP99Ms": 3.2, "node": "gpu-a"}
    app = {"name": "app", "ref": REF_B, "target": "cuda-sm_90", "ready": True}
    patch, moved, events = _reconcile({"promoted": promoted, "candidate": CANDIDATE},
                                      [_canary(GPU_C, measured), app])  # fmt: skip
    assert patch["promoted"]["generation"] == 3 and patch["candidate"] is None
    assert patch["promoted"]["targets"] == {"cuda-sm_90": GPU_C}
    (condition,) = [c for c in patch["conditions"] if c["type"] == "Promoted"]
    assert condition["reason"] == "MeasuredOnNode" and "on node gpu-a" in condition["message"]
    assert moved == [("app", GPU_C)]  # the canary is on it already
    assert [e.split(":")[0] for e in events] == ["Promoted", "RolledOut"]
    assert patch["serving"] == [{"ref": GPU_C, "pods": 2, "ready": 2}]


def test_a_missed_gate_rejects_the_candidate_and_the_canary_goes_back() -> None:
    promoted = {"generation": 2, "ref": REF_B, "targets": {"cuda-sm_90": REF_B}}
    slow = {"digest": GPU_C.rpartition("@")[2], "latencyP99Ms": 9.5, "node": "gpu-a"}
    patch, moved, events = _reconcile({"promoted": promoted, "candidate": CANDIDATE},
                                      [_canary(GPU_C, slow)])  # fmt: skip
    assert patch["candidate"] is None and "promoted" not in patch
    (condition,) = [c for c in patch["conditions"] if c["type"] == "Promoted"]
    assert condition["reason"] == "MeasurementFailed"
    assert "maxLatencyP99Ms measured 9.5, required <= 5" in condition["message"]
    assert moved == [("canary", REF_B)]
    assert events[0].startswith("MeasurementFailed")


@pytest.mark.parametrize(
    "measurement",
    [
        {"digest": "sha256:" + "e" * 64, "latencyP99Ms": 1.0},  # another artifact
        {"digest": GPU_C.rpartition("@")[2]},  # nothing the gate reads
        {"digest": GPU_C.rpartition("@")[2], "latencyP99Ms": "fast"},
    ],
)
def test_a_measurement_that_does_not_fit_the_candidate_is_left_alone(
    measurement: dict[str, object],
) -> None:
    patch, moved, events = _reconcile({"candidate": CANDIDATE}, [_canary(GPU_C, measurement)])
    assert patch == {"serving": [{"ref": GPU_C, "pods": 1, "ready": 1}]}
    assert moved == [] and events == []
