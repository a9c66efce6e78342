"""Which generation's artifact is served: ``status.promoted``, moved only by gates that passed.

A generation that succeeded has met every gate the compiling machine could check. Speed gates
on a target the machine could not time (a CUDA plan compiled and verified on a CPU worker: its
report's gate says ``deferred``) are not met yet: that generation becomes ``status.candidate``
and the one promoted before stays served, with the ``Promoted`` condition saying which gate
waits for a measurement. A generation that failed leaves the promoted one as it was, and the
condition says so. The sidecar injection webhook (``injection.served_ref``) and ``kubectl get
mc`` read ``status.promoted``.

A candidate is promoted by a measurement taken where it runs (the sidecar's warm-up against
the golden reference, reported back to the operator); that report is not built yet, so a
candidate waits until a later generation is promoted or its gates change.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cuvil_operator.conditions import FALSE, TRUE, set_conditions
from cuvil_operator.status import FAILED, SUCCEEDED

PROMOTED = "Promoted"


def deferred_gates(report: Mapping[str, Any]) -> list[str]:
    """``target: gate (why)`` for every gate a target's report left to be checked elsewhere."""
    waiting = []
    for target, target_report in sorted((report.get("targets") or {}).items()):
        for gate, checked in sorted((target_report.get("gates") or {}).items()):
            if isinstance(checked, Mapping) and checked.get("deferred"):
                waiting.append(f"{target}: {gate} ({checked['deferred']})")
    return waiting


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
        message = f"generation {generation} failed; {_serving(previous)}"
        update = (FALSE, "GenerationFailed", message)
        patch["candidate"] = None
    else:
        served = build_served(patch, generation, now)
        waiting = deferred_gates(patch.get("report") or {})
        if waiting:
            patch["candidate"] = served
            message = f"generation {generation} awaits a measurement: {'; '.join(waiting)}; "
            update = (FALSE, "AwaitingMeasurement", message + _serving(previous))
        else:
            patch["promoted"], patch["candidate"] = served, None
            update = (TRUE, "GatesPassed", f"generation {generation} ({served['digest']}) served")
    conditions = patch.get("conditions") or status.get("conditions") or []
    patch["conditions"] = set_conditions(conditions, {PROMOTED: update}, generation, now)
    return patch
