"""Where a compilation is served: ``status.serving``, and running sidecars moved to what is
promoted.

The operator indexes pods labelled ``cuvil.dev/model`` (the label the injection webhook's
``objectSelector`` matches) by (namespace, compilation), each with the reference its sidecar is
pinned to (``cuvil.dev/injected``, written by the webhook) and whether it is Ready. A timer per
compilation (``reconcile_serving``) re-pins every pod whose reference is not the promoted one by
rewriting that annotation: the sidecar reads it through a downward API file
(``CUVIL_MODEL_FILE``) and hot-reloads, keeping the old model if the new one fails its checks.
It then folds the pods into counts per reference. Only ``status.promoted`` moves pods, so a
generation that failed or awaits a measurement moves none, with one exception: a canary pod
(annotated ``cuvil.dev/track: candidate``) follows ``status.candidate`` while there is one, so
that a generation whose speed gates were deferred runs somewhere before it is promoted.

That is where it is measured: a sidecar that loads an artifact with deferred gates measures it
at warm-up and writes ``cuvil.dev/measurement`` on its own pod (``cuvil_sidecar.measurement``).
The timer takes a pod's measurement whose digest is one of the candidate's artifacts, and whose
values cover every gate that target awaits, as if it had been posted on the compilation
(``promotion.reconcile_measurement``); others are left alone (a benchmark Job posts the speedup
a ``minSpeedup`` gate needs). kopf's index and timer are registered in ``main.py`` when the
webhook is served.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from cuvil_operator.injection import (
    CANDIDATE,
    INJECTED_ANNOTATION,
    MODEL_ANNOTATION,
    TRACK_ANNOTATION,
)
from cuvil_operator.promotion import MEASURED_GATES, MEASUREMENT_ANNOTATION, reconcile_measurement

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
    if annotations.get(TRACK_ANNOTATION):
        pod["track"] = annotations[TRACK_ANNOTATION]
    if annotations.get(MEASUREMENT_ANNOTATION):
        pod["measurement"] = annotations[MEASUREMENT_ANNOTATION]
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
    promoted: Mapping[str, Any] | None,
    pods: Iterable[Mapping[str, Any]],
    candidate: Mapping[str, Any] | None = None,
) -> list[tuple[str, str]]:
    """(pod name, reference) for each pod pinned to something other than what it should serve:
    the candidate for a canary pod while there is one, else what is promoted; the target's own
    manifest for a pod naming a target, else the index."""
    moves = []
    for pod in pods:
        served = candidate if candidate and pod.get("track") == CANDIDATE else promoted
        if not served:
            continue
        targets = served.get("targets") or {}
        wanted = targets.get(pod["target"]) if pod.get("target") else served.get("ref")
        if wanted and wanted != pod["ref"]:
            moves.append((str(pod["name"]), str(wanted)))
    return sorted(moves)


def _digest(ref: str) -> str:
    return ref.rpartition("@")[2]


def pod_measurement(
    candidate: Mapping[str, Any] | None, pods: Iterable[Mapping[str, Any]]
) -> str | None:
    """The first pod measurement of one of the candidate's artifacts that covers every gate
    its target awaits and is not recorded yet, as the compilation's annotation would hold it
    (the generation and target filled in from the candidate); None: nothing to take."""
    if not candidate:
        return None
    by_digest = {_digest(str(ref)): t for t, ref in (candidate.get("targets") or {}).items()}
    awaiting, measured = candidate.get("awaiting") or {}, candidate.get("measured") or {}
    for pod in sorted(pods, key=lambda p: str(p.get("name"))):
        try:
            measurement = json.loads(str(pod.get("measurement") or "null"))
        except json.JSONDecodeError:
            continue
        if not isinstance(measurement, dict):
            continue
        target = by_digest.get(str(measurement.get("digest")))
        if target is None or target not in awaiting or target in measured:
            continue
        needed = [MEASURED_GATES.get(gate, (gate, ""))[0] for gate in awaiting[target]]
        if all(isinstance(measurement.get(key), int | float) for key in needed):
            measurement |= {"generation": candidate.get("generation"), "target": target}
            measurement.setdefault("node", pod.get("name"))
            return json.dumps(measurement, sort_keys=True)
    return None


def reconcile_serving(
    meta: Mapping[str, Any],
    status: Mapping[str, Any],
    pods: list[Mapping[str, Any]],
    move_pod: MovePod,
    notify: Notify,
    now: str = "",
) -> dict[str, Any] | None:
    """Timer: take a canary's measurement of the candidate, move the pods to what they should
    serve, then count them (None: no change)."""
    patch: dict[str, Any] = {}
    text = pod_measurement(status.get("candidate"), pods)
    if text is not None:
        patch = reconcile_measurement(status, text, notify, now) or {}
        status = {**status, **patch}
    promoted, candidate = status.get("promoted") or {}, status.get("candidate") or {}
    moves = pods_to_move(promoted, pods, candidate)
    for name, ref in moves:
        move_pod(str(meta.get("namespace")), name, ref)
    canaries = {str(p["name"]) for p in pods if candidate and p.get("track") == CANDIDATE}
    for served, which, names in (
        (promoted, "generation", [n for n, _ in moves if n not in canaries]),
        (candidate, "candidate generation", [n for n, _ in moves if n in canaries]),
    ):
        if names:
            message = f"{len(names)} pods moved to {which} {served.get('generation')}"
            notify("Normal", "RolledOut", f"{message}: {', '.join(names)}")
    if moves:
        moved = dict(moves)
        pods = [{**p, "ref": moved.get(str(p["name"]), p["ref"])} for p in pods]
    counts = serving_patch(status, pods)
    return {**patch, **(counts or {})} or None
