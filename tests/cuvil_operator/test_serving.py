"""status.serving: pods with an injected sidecar, counted per pinned reference."""

from __future__ import annotations

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
