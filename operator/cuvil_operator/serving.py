"""Where a compilation is served: ``status.serving``, the pods per pinned reference.

The operator indexes pods labelled ``cuvil.dev/model`` (the label the injection webhook's
``objectSelector`` matches) by (namespace, compilation), each with the reference its sidecar was
pinned to (``cuvil.dev/injected``, written by the webhook) and whether it is Ready; a timer per
compilation folds that into counts per reference. Pure functions here; kopf's index and timer
are registered in ``main.py`` when the webhook is served.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from cuvil_operator.injection import INJECTED_ANNOTATION, MODEL_ANNOTATION


def index_pod(meta: Mapping[str, Any], status: Mapping[str, Any]) -> dict[Any, Any] | None:
    """``{(namespace, compilation): {"ref": ..., "ready": bool}}`` for a pod with a sidecar
    the webhook pinned; None for any other pod (left out of the index)."""
    labels, annotations = meta.get("labels") or {}, meta.get("annotations") or {}
    model, ref = labels.get(MODEL_ANNOTATION), annotations.get(INJECTED_ANNOTATION)
    if not model or not ref or meta.get("deletionTimestamp"):
        return None
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )
    return {(meta.get("namespace"), model): {"ref": ref, "ready": ready}}


def build_serving(pods: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``[{"ref", "pods", "ready"}]`` per pinned reference, most pods first."""
    counts: dict[str, dict[str, Any]] = {}
    for pod in pods:
        entry = counts.setdefault(str(pod["ref"]), {"ref": str(pod["ref"]), "pods": 0, "ready": 0})
        entry["pods"] += 1
        entry["ready"] += 1 if pod.get("ready") else 0
    return sorted(counts.values(), key=lambda e: (-e["pods"], e["ref"]))


def serving_patch(
    status: Mapping[str, Any], pods: Iterable[Mapping[str, Any]]
) -> dict[str, Any] | None:
    """The status patch when the counts changed (None: nothing to write)."""
    serving = build_serving(pods)
    if serving == (status.get("serving") or []):
        return None
    return {"serving": serving or None}
