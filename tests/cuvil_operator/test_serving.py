"""status.serving: pods with an injected sidecar, counted per pinned reference."""

from __future__ import annotations

from cuvil_operator.serving import build_serving, index_pod, serving_patch

REF_A = "registry.example.com/m@sha256:" + "a" * 64
REF_B = "registry.example.com/m@sha256:" + "b" * 64
READY = {"conditions": [{"type": "Ready", "status": "True"}]}


def _meta(ref: str | None = REF_A, **extra: object) -> dict[str, object]:
    annotations = {"cuvil.dev/injected": ref} if ref else {}
    return {"namespace": "team", "labels": {"cuvil.dev/model": "minilm"},
            "annotations": annotations, **extra}  # fmt: skip


def test_only_pods_the_webhook_pinned_are_indexed() -> None:
    assert index_pod(_meta(), READY) == {("team", "minilm"): {"ref": REF_A, "ready": True}}
    assert index_pod(_meta(), {}) == {("team", "minilm"): {"ref": REF_A, "ready": False}}
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
