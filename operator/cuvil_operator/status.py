"""Pure builders of ModelCompilation status patches: what the handlers write, given what they saw.

Inputs are plain dicts (the object's status, ``Progress.to_json()`` from the worker contract), so
every transition is unit-tested without a cluster or a broker.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from cuvil_operator.conditions import FALSE, TRUE, UNKNOWN, set_conditions

PENDING, COMPILING, VALIDATING, PUSHING = "Pending", "Compiling", "Validating", "Pushing"
SUCCEEDED, FAILED = "Succeeded", "Failed"
TERMINAL_PHASES = (SUCCEEDED, FAILED)

ConditionUpdates = dict[str, tuple[str, str, str]]
# The condition a failure lands on when the worker does not say: the phase it hit.
CONDITION_OF_PHASE = {PENDING: "Compiling", COMPILING: "Compiling", VALIDATING: "Validated"}
COMPILED = (FALSE, "Compiled", "compiled for every target")
VALIDATED = (TRUE, "Validated", "outputs match eager within tolerance")


def is_terminal(status: Mapping[str, Any]) -> bool:
    return status.get("phase") in TERMINAL_PHASES


def is_following(status: Mapping[str, Any]) -> bool:
    """A task is submitted and not finished: the progress timer has work to do."""
    return bool(status.get("taskId")) and not is_terminal(status)


def _phase_conditions(phase: str, failed_in: str, message: str) -> ConditionUpdates:
    """Condition updates for entering ``phase`` (``failed_in``: the phase a failure hit)."""
    if phase == PENDING:
        return {
            "Compiling": (FALSE, "Queued", "waiting for a compile worker"),
            "Validated": (UNKNOWN, "Queued", ""),
            "Pushed": (UNKNOWN, "Queued", ""),
            "Ready": (FALSE, "Pending", "queued"),
        }
    if phase == COMPILING:
        return {
            "Compiling": (TRUE, "Compiling", message),
            "Ready": (FALSE, "Compiling", message),
        }
    if phase == VALIDATING:
        return {
            "Compiling": COMPILED,
            "Validated": (UNKNOWN, "Validating", message),
            "Ready": (FALSE, "Validating", message),
        }
    if phase == PUSHING:
        return {
            "Compiling": COMPILED,
            "Validated": VALIDATED,
            "Pushed": (UNKNOWN, "Pushing", message),
            "Ready": (FALSE, "Pushing", message),
        }
    if phase == SUCCEEDED:
        return {
            "Compiling": COMPILED,
            "Validated": VALIDATED,
            "Pushed": (TRUE, "Pushed", message),
            "Ready": (TRUE, "Succeeded", message),
        }
    return _failed_conditions(failed_in, "Failed", message)


def _failed_conditions(condition: str, reason: str, message: str) -> ConditionUpdates:
    """The failed stage's condition False with the reason; the stages before it as passed."""
    failed: ConditionUpdates = {"Ready": (FALSE, reason, message)}
    if condition in CONDITION_OF_PHASE:  # a phase name (fallback) rather than a condition
        condition = CONDITION_OF_PHASE[condition]
    if condition == "Compiling":
        failed["Compiling"] = (FALSE, reason, message)
    elif condition == "Validated":
        failed |= {"Compiling": COMPILED, "Validated": (FALSE, reason, message)}
    else:
        failed |= {
            "Compiling": COMPILED,
            "Validated": VALIDATED,
            "Pushed": (FALSE, reason, message),
        }
    return failed


def build_submitted_status(
    status: Mapping[str, Any], generation: int, task_id: str, now: str, trace_id: str | None = None
) -> dict[str, Any]:
    """The status right after a generation's compile was queued."""
    updates: ConditionUpdates = {"Accepted": (TRUE, "Submitted", f"task {task_id} queued")}
    updates.update(_phase_conditions(PENDING, PENDING, ""))
    return {
        "phase": PENDING,
        "observedGeneration": generation,
        "taskId": task_id,
        "attempt": None,
        "queuedAt": now,
        "faultSince": None,
        "stalled": None,
        "traceId": trace_id,
        "conditions": set_conditions(status.get("conditions") or [], updates, generation, now),
        "stages": None,
        "artifacts": None,
        "index": None,
        "digest": None,
        "report": None,
        "message": f"queued as {task_id}",
    }


def build_invalid_status(
    status: Mapping[str, Any],
    generation: int,
    problems: Sequence[Any],
    now: str,
    reason: str = "InvalidSpec",
) -> dict[str, Any]:
    """A spec the schema let through but the operator refuses (``reason``: InvalidSpec, or
    what the push policy refuses): nothing is submitted."""
    message = "; ".join(str(problem) for problem in problems)
    updates: ConditionUpdates = {
        "Accepted": (FALSE, reason, message),
        "Ready": (FALSE, reason, message),
    }
    return {
        "phase": FAILED,
        "observedGeneration": generation,
        "taskId": None,
        "traceId": None,
        "conditions": set_conditions(status.get("conditions") or [], updates, generation, now),
        "stages": None,
        "artifacts": None,
        "index": None,
        "digest": None,
        "report": None,
        "message": message,
    }


def _stage_message(phase: str, targets: Mapping[str, Any]) -> str:
    parts = []
    for target, progress in sorted(targets.items()):
        stage = progress.get("stage") or progress.get("state", "").lower()
        parts.append(f"{target}: {stage}")
    return f"{phase.lower()} ({', '.join(parts)})" if parts else phase.lower()


def _find_number(report: Mapping[str, Any], key: str) -> float | None:
    """``key`` at the top of a per-target report or one level down (e.g. latency_ms.speedup)."""
    value = report.get(key)
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    for nested in report.values():
        if isinstance(nested, Mapping):
            inner = nested.get(key)
            if isinstance(inner, int | float) and not isinstance(inner, bool):
                return float(inner)
    return None


# summary key -> (key in a worker's per-target report, how targets combine: the worst wins)
REPORT_SUMMARY = {
    "speedup": ("speedup", min),
    "latencyMs": ("compiled_p50_ms", max),
    "eagerLatencyMs": ("eager_p50_ms", max),
    "maxAbsError": ("max_abs_error", max),
    "peakMemoryBytes": ("peak_bytes", max),
}


def camel(key: str) -> str:
    """``max_abs_error`` -> ``maxAbsError`` (Kubernetes API fields are camelCase)."""
    head, *rest = key.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def _camel_keys(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {camel(str(k)): _camel_keys(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_camel_keys(v) for v in value]
    return value


def _small(report: Mapping[str, Any]) -> dict[str, Any]:
    """A target's report without bulky parts (the full one is the artifact's OCI referrer),
    its keys in camelCase like the rest of the status."""
    kept = {k: v for k, v in report.items() if k != "compile"}
    compile_report = report.get("compile")
    if isinstance(compile_report, Mapping):
        kept["compile"] = {
            k: v for k, v in compile_report.items() if isinstance(v, int | float | str | bool)
        }
    return dict(_camel_keys(kept))


def build_report(per_target: Mapping[str, Any]) -> dict[str, Any]:
    """A summary for the printer columns (worst target wins) plus every target's own report."""
    summary: dict[str, Any] = {}
    reports = [r for r in per_target.values() if isinstance(r, Mapping)]
    for key, (source_key, pick) in REPORT_SUMMARY.items():
        values = [v for r in reports for v in [_find_number(r, source_key)] if v is not None]
        if values:
            worst = pick(values)
            summary[key] = round(worst, 3) if key == "speedup" else worst
    speedups = {
        t: v for t, r in per_target.items() if isinstance(r, Mapping)
        for v in [_find_number(r, "speedup")] if v is not None
    }  # fmt: skip
    if speedups:
        summary["speedupTarget"] = min(speedups, key=lambda t: speedups[t])
    summary["targets"] = {t: _small(r) for t, r in per_target.items() if isinstance(r, Mapping)}
    return summary


def speedup_text(report: Mapping[str, Any]) -> str | None:
    """``1.84x cpu-x86_64``: the printer column (worst target, named)."""
    if "speedup" not in report:
        return None
    return f"{report['speedup']:.2f}x {report.get('speedupTarget', '')}".strip()


def _digest_of(result: Mapping[str, Any]) -> str | None:
    index = result.get("index") or {}
    if index.get("digest"):
        return str(index["digest"])
    artifacts = result.get("artifacts") or []
    return str(artifacts[0]["digest"]) if len(artifacts) == 1 else None


def build_progress_status(
    status: Mapping[str, Any], generation: int, progress: Mapping[str, Any], now: str
) -> dict[str, Any]:
    """The status patch for a ``Progress.to_json()`` of the followed task (may be a no-op)."""
    phase = str(progress.get("phase") or PENDING)
    previous_phase = str(status.get("phase") or PENDING)
    targets: Mapping[str, Any] = progress.get("targets") or {}
    patch: dict[str, Any] = {"phase": phase}
    if targets:
        patch["stages"] = {
            t: str(p.get("stage") or p.get("state") or "") for t, p in targets.items()
        }
    if phase == SUCCEEDED:
        result: Mapping[str, Any] = progress.get("result") or {}
        patch["artifacts"] = [
            {k: a[k] for k in ("target", "ref", "digest", "size") if k in a}
            for a in result.get("artifacts") or []
        ]
        if result.get("index"):
            patch["index"] = {
                k: result["index"][k] for k in ("ref", "digest") if k in result["index"]
            }
        patch["digest"] = _digest_of(result)
        patch["report"] = build_report(result.get("report") or {})
        message = f"pushed {patch['digest']}" if patch["digest"] else "pushed"
    elif phase == FAILED:
        message = str(progress.get("error") or "the compile failed")
        measured = {t: p["details"] for t, p in targets.items() if p.get("details")}
        patch["report"] = (
            {**build_report(measured), "error": message} if measured else {"error": message}
        )
    elif phase == PENDING and previous_phase == PENDING and status.get("message"):
        message = str(status["message"])  # still queued: keep "queued as <task>"
    else:
        message = _stage_message(phase, targets)
    if "report" in patch:
        patch["speedup"] = speedup_text(patch["report"])
    patch["message"] = message
    if phase == FAILED:
        condition = str(progress.get("condition") or previous_phase)
        reason = str(progress.get("reason") or "Failed")
        updates = _failed_conditions(condition, reason, message)
    else:
        updates = _phase_conditions(phase, previous_phase, message)
    patch["conditions"] = set_conditions(status.get("conditions") or [], updates, generation, now)
    return patch


def status_changed(status: Mapping[str, Any], patch: Mapping[str, Any]) -> bool:
    """Would ``patch`` change anything (lastTransitionTime aside)? Avoids a write per poll."""
    for key, value in patch.items():
        if key == "conditions":
            old = [
                {k: v for k, v in c.items() if k != "lastTransitionTime"}
                for c in status.get("conditions") or []
            ]
            new = [{k: v for k, v in c.items() if k != "lastTransitionTime"} for c in value]
            if old != new:
                return True
        elif status.get(key) != value:
            return True
    return False
