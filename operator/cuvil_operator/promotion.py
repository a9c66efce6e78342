"""Which generation's artifact is served: ``status.promoted``, moved only by gates that passed.

A generation that succeeded has met every gate the compiling machine could check. Speed gates
on a target the machine could not time (a CUDA plan compiled and verified on a CPU worker: its
report's gate says ``deferred``) are not met yet: that generation becomes ``status.candidate``
and the one promoted before stays served, with the ``Promoted`` condition saying which gate
waits for a measurement. A generation that failed leaves the promoted one as it was, and the
condition says so. The sidecar injection webhook (``injection.served_ref``) and ``kubectl get
mc`` read ``status.promoted``.

A candidate is promoted by measurements taken where it runs: the ``cuvil.dev/measurement``
annotation on the compilation, one target at a time, as JSON
``{"generation": 2, "target": "cuda-sm_90", "speedup": 1.9, "latencyP99Ms": 3.1, "node": "gpu-a"}``
(``reconcile_measurement``). When every target's deferred gates are measured and met, the
candidate is promoted; a measurement that misses a gate rejects it, and the promoted generation
stays served. Anyone allowed to patch the compilation can post one (a benchmark Job on a node of
the target's kind). A canary's sidecar measures latency at warm-up and writes it on its own pod;
``serving`` takes it from there into ``reconcile_measurement``, as if it had been posted here.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from cuvil_operator.conditions import FALSE, TRUE, set_conditions
from cuvil_operator.status import FAILED, SUCCEEDED

PROMOTED = "Promoted"
MEASUREMENT_ANNOTATION = "cuvil.dev/measurement"
# deferred gate -> (the measurement's key, how the measured value must compare)
MEASURED_GATES = {"minSpeedup": ("speedup", ">="), "maxLatencyP99Ms": ("latencyP99Ms", "<=")}
Notify = Callable[[str, str, str], None]


def deferred_gates(report: Mapping[str, Any]) -> list[str]:
    """``target: gate (why)`` for every gate a target's report left to be checked elsewhere."""
    waiting = []
    for target, target_report in sorted((report.get("targets") or {}).items()):
        for gate, checked in sorted((target_report.get("gates") or {}).items()):
            if isinstance(checked, Mapping) and checked.get("deferred"):
                waiting.append(f"{target}: {gate} ({checked['deferred']})")
    return waiting


def awaiting_gates(report: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """``{target: {gate: limit}}`` of the gates left to be measured where the model runs."""
    awaiting: dict[str, dict[str, float]] = {}
    for target, target_report in (report.get("targets") or {}).items():
        for gate, checked in (target_report.get("gates") or {}).items():
            if isinstance(checked, Mapping) and checked.get("deferred"):
                awaiting.setdefault(target, {})[gate] = float(checked["limit"])
    return awaiting


def build_served(patch: Mapping[str, Any], generation: int, now: str) -> dict[str, Any]:
    """What a succeeded generation serves: its index and each target's own manifest."""
    index = patch.get("index") or {}
    artifacts = patch.get("artifacts") or []
    only = artifacts[0] if len(artifacts) == 1 else {}
    return {
        "generation": generation,
        "ref": index.get("ref") or only.get("ref"),
        "digest": patch.get("digest"),
        "targets": {a["target"]: a["ref"] for a in artifacts if "target" in a and "ref" in a},
        "since": now,
    }


def _serving(promoted: Mapping[str, Any] | None) -> str:
    if not promoted:
        return "nothing is served yet"
    return f"generation {promoted.get('generation')} ({promoted.get('digest')}) stays served"


def with_promotion(
    status: Mapping[str, Any], patch: dict[str, Any], generation: int, now: str
) -> dict[str, Any]:
    """``patch`` (a progress status patch) with ``promoted``/``candidate`` and the Promoted
    condition, once the generation is Succeeded or Failed; other phases pass unchanged."""
    phase = patch.get("phase")
    if phase not in (SUCCEEDED, FAILED):
        return patch
    previous = status.get("promoted") or None
    if phase == FAILED:
        why = f" ({patch['message']})" if patch.get("message") else ""
        message = f"generation {generation} failed{why}; {_serving(previous)}"
        update = (FALSE, "GenerationFailed", message)
        patch["candidate"] = None
    else:
        served = build_served(patch, generation, now)
        waiting = deferred_gates(patch.get("report") or {})
        if waiting:
            patch["candidate"] = {**served, "awaiting": awaiting_gates(patch.get("report") or {})}
            message = f"generation {generation} awaits a measurement: {'; '.join(waiting)}; "
            update = (FALSE, "AwaitingMeasurement", message + _serving(previous))
        else:
            patch["promoted"], patch["candidate"] = served, None
            update = (TRUE, "GatesPassed", f"generation {generation} ({served['digest']}) served")
    conditions = patch.get("conditions") or status.get("conditions") or []
    patch["conditions"] = set_conditions(conditions, {PROMOTED: update}, generation, now)
    return patch


class MeasurementError(ValueError):
    """The annotation is not a measurement of the candidate (the message says why)."""


def read_measurement(text: str, candidate: Mapping[str, Any]) -> dict[str, Any]:
    """The annotation's JSON, checked against the candidate it must measure."""
    try:
        measurement = json.loads(text)
    except json.JSONDecodeError as e:
        raise MeasurementError(f"{MEASUREMENT_ANNOTATION} is not JSON: {e}") from None
    if not isinstance(measurement, dict):
        raise MeasurementError(f"{MEASUREMENT_ANNOTATION} must be a JSON object")
    if measurement.get("generation") != candidate.get("generation"):
        raise MeasurementError(
            f"{MEASUREMENT_ANNOTATION} measures generation {measurement.get('generation')},"
            f" the candidate is generation {candidate.get('generation')}"
        )
    target = measurement.get("target")
    awaiting = candidate.get("awaiting") or {}
    if target not in awaiting:
        raise MeasurementError(
            f"{MEASUREMENT_ANNOTATION}: target {target!r} awaits no measurement"
            f" (awaiting: {', '.join(sorted(awaiting)) or 'none'})"
        )
    for gate in awaiting[target]:
        key = MEASURED_GATES[gate][0] if gate in MEASURED_GATES else gate
        value = measurement.get(key)
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise MeasurementError(f"{MEASUREMENT_ANNOTATION}: {target} needs a number {key}")
    return measurement


def _missed(limits: Mapping[str, float], measurement: Mapping[str, Any]) -> list[str]:
    missed = []
    for gate, limit in sorted(limits.items()):
        key, relation = MEASURED_GATES.get(gate, (gate, ">="))
        value = float(measurement[key])
        if not (value >= limit if relation == ">=" else value <= limit):
            missed.append(f"{gate} measured {value:.6g}, required {relation} {limit:.6g}")
    return missed


def reconcile_measurement(
    status: Mapping[str, Any], text: str, notify: Notify, now: str
) -> dict[str, Any] | None:
    """A measurement was posted: record it on the candidate; promote the candidate once every
    awaited target is measured and met, reject it when one misses a gate. A measurement that
    does not fit the candidate changes nothing and is a Warning Event saying why."""
    candidate = status.get("candidate")
    if not candidate:
        notify("Warning", "MeasurementIgnored", "no candidate awaits a measurement")
        return None
    try:
        measurement = read_measurement(text, candidate)
    except MeasurementError as e:
        notify("Warning", "MeasurementIgnored", str(e))
        return None
    generation, target = int(candidate["generation"]), str(measurement["target"])
    where = f" on node {measurement['node']}" if measurement.get("node") else ""
    missed = _missed(candidate["awaiting"][target], measurement)
    previous = status.get("promoted") or None
    if missed:
        message = f"generation {generation} {target}{where}: {'; '.join(missed)}; "
        update = (FALSE, "MeasurementFailed", message + _serving(previous))
        patch: dict[str, Any] = {"candidate": None}
        notify("Warning", "MeasurementFailed", update[2])
    else:
        measured = {**(candidate.get("measured") or {}), target: measurement}
        left = sorted(set(candidate["awaiting"]) - set(measured))
        if left:
            message = (
                f"generation {generation} {target} measured{where}; awaiting {', '.join(left)}"
            )
            patch = {"candidate": {**candidate, "measured": measured}}
            update = (FALSE, "AwaitingMeasurement", message + "; " + _serving(previous))
        else:
            served = {k: v for k, v in candidate.items() if k not in ("awaiting", "measured")}
            patch = {"promoted": {**served, "since": now}, "candidate": None}
            message = f"generation {generation} ({served.get('digest')}) served: measured{where}"
            update = (TRUE, "MeasuredOnNode", message)
            notify("Normal", "Promoted", message)
    conditions = status.get("conditions") or []
    patch["conditions"] = set_conditions(conditions, {PROMOTED: update}, generation, now)
    return patch
