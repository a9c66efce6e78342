"""Where a compilation is served: ``status.serving``, and running sidecars moved to what is
promoted.

The operator indexes pods labelled ``cuvil.dev/model`` (the label the injection webhook's
``objectSelector`` matches) by (namespace, compilation), each with the reference its sidecar is
pinned to (``cuvil.dev/injected``, written by the webhook) and whether it is Ready. A timer per
compilation (``reconcile_serving``) re-pins every pod whose reference is not the promoted one by
rewriting that annotation: the sidecar reads it through a downward API file
(``CUVIL_MODEL_FILE``) and hot-reloads, keeping the old model if the new one fails its checks.
It then folds the pods into counts per reference. Only ``status.promoted`` moves pods, so a
generation that failed or awaits a measurement moves none. kopf's index and timer are
registered in ``main.py`` when the webhook is served.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from cuvil_operator.injection import INJECTED_ANNOTATION, MODEL_ANNOTATION

TARGET_ANNOTATION = "cuvil.dev/target"
MovePod = Callable[[str, str, str], None]  # (namespace, pod name, reference to serve)
Notify = Callable[[str, str, str], None]


def index_pod(meta: Mapping[str, Any], status: Mapping[str, Any]) -> dict[Any, Any] | None:
    """``{(namespace, compilation): {"name", "ref", "target", "ready"}}`` for a pod with a
    sidecar the webhook pinned; None for any other pod (left out of the index)."""
    labels, annotations = meta.get("labels") or {}, meta.get("annotations") or {}
    model, ref = labels.get(MODEL_ANNOTATION), annotations.get(INJECTED_ANNOTATION)
    if not model or not ref or meta.get("deletionTimestamp"):
        return None
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )
    pod = {"name": meta.get("name"), "ref": ref, "target": annotations.get(TARGET_ANNOTATION)}
    return {(meta.get("namespace"), model): {**pod, "ready": ready}}


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


def pods_to_move(
    promoted: Mapping[str, Any] | None, pods: Iterable[Mapping[str, Any]]
) -> list[tuple[str, str]]:
    """(pod name, reference) for each pod pinned to something other than what is promoted for
    it: the target's own manifest for a pod naming a target, else the index."""
    if not promoted:
        return []
    targets = promoted.get("targets") or {}
    moves = []
    for pod in pods:
        wanted = targets.get(pod["target"]) if pod.get("target") else promoted.get("ref")
        if wanted and wanted != pod["ref"]:
            moves.append((str(pod["name"]), str(wanted)))
    return sorted(moves)


def reconcile_serving(
    meta: Mapping[str, Any],
    status: Mapping[str, Any],
    pods: list[Mapping[str, Any]],
    move_pod: MovePod,
    notify: Notify,
) -> dict[str, Any] | None:
    """Timer: move the pods to the promoted reference, then count them (None: no change)."""
    promoted = status.get("promoted")
    moves = pods_to_move(promoted, pods)
    for name, ref in moves:
        move_pod(str(meta.get("namespace")), name, ref)
    if moves and promoted:
        generation = promoted.get("generation")
        names = ", ".join(name for name, _ in moves)
        notify(
            "Normal", "RolledOut", f"{len(moves)} pods moved to generation {generation}: {names}"
        )
        moved = dict(moves)
        pods = [{**p, "ref": moved.get(str(p["name"]), p["ref"])} for p in pods]
    return serving_patch(status, pods)
