"""Stalls, said out loud: a compile no worker can take, a registry that keeps failing, a
compile that never starts within ``spec.timeout``. Pure functions of what the progress timer
saw; the flow (``reconcile_compilation``) posts the Warning and writes the patch.

    NoWorker        Pending, and a queue it needs has no consumer for ``stall_after`` seconds
                    (Compiling=False names the queue and the target)
    RegistryFault   a target retrying a registry fault for ``stall_after`` seconds
                    (Pushed=Unknown names the registry and its error)
    Timeout         still Pending after ``spec.timeout``: cancelled and Failed on Compiling
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cuvil_operator.conditions import FALSE, UNKNOWN, set_conditions

DEFAULT_TIMEOUT_S = 24 * 3600.0
_DURATION = re.compile(r"^([0-9]+)(s|m|h)?$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, None: 1}


def parse_duration(text: Any) -> float:
    """``90``, ``"90s"``, ``"30m"``, ``"2h"`` -> seconds (the CRD's pattern admits these)."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        return float(text)
    match = _DURATION.match(str(text).strip())
    if match is None:
        raise ValueError(f"{text!r} is not a duration like 90s, 30m or 2h")
    return float(int(match.group(1)) * _UNIT_S[match.group(2)])


def seconds_between(earlier: str, later: str) -> float:
    parse = datetime.datetime.fromisoformat
    delta = parse(later.replace("Z", "+00:00")) - parse(earlier.replace("Z", "+00:00"))
    return delta.total_seconds()


@dataclass(frozen=True)
class Stall:
    reason: str
    condition: str
    status: str
    message: str
    fail: bool = False


def find_stall(
    spec: Mapping[str, Any],
    status: Mapping[str, Any],
    patch: Mapping[str, Any],
    progress: Mapping[str, Any],
    idle_queues: Mapping[str, Sequence[str]],
    now: str,
    stall_after: float,
) -> Stall | None:
    """The stall the followed compile is in, if any. ``idle_queues``: queue -> the targets
    waiting on it, for queues no worker consumes now."""
    queued_at = str(status.get("queuedAt") or now)
    waited = seconds_between(queued_at, now)
    if patch.get("phase") == "Pending":
        timeout = parse_duration(spec.get("timeout") or DEFAULT_TIMEOUT_S)
        idle = ", ".join(f"{q} (for {', '.join(t)})" for q, t in sorted(idle_queues.items()))
        if waited >= timeout:
            why = f"; no worker consumes {idle}" if idle else ""
            message = f"no worker started it within spec.timeout ({timeout:g}s){why}"
            return Stall("Timeout", "Compiling", FALSE, message, fail=True)
        if idle and waited >= stall_after:
            message = f"no worker consumes queue {idle}; waiting {waited:.0f}s"
            return Stall("NoWorker", "Compiling", FALSE, message)
    faults = {t: p["fault"] for t, p in (progress.get("targets") or {}).items() if p.get("fault")}
    fault_since = str(status.get("faultSince") or now)
    if faults and seconds_between(fault_since, now) >= stall_after:
        listed = "; ".join(f"{t}: {f}" for t, f in sorted(faults.items()))
        repository = (spec.get("output") or {}).get("repository", "")
        registry = str(repository).split("/", 1)[0]
        message = f"registry {registry} failing for {seconds_between(fault_since, now):.0f}s"
        return Stall("RegistryFault", "Pushed", UNKNOWN, f"{message}, retrying: {listed}")
    return None


def apply_stall(
    status: Mapping[str, Any], patch: Mapping[str, Any], stall: Stall, generation: int, now: str
) -> dict[str, Any]:
    """``patch`` with the stall on its condition, on Ready, and as the message."""
    updated = dict(patch)
    conditions = patch.get("conditions") or status.get("conditions") or []
    updates = {
        stall.condition: (stall.status, stall.reason, stall.message),
        "Ready": (FALSE, stall.reason, stall.message),
    }
    updated["conditions"] = set_conditions(conditions, updates, generation, now)
    updated["message"] = stall.message
    updated["stalled"] = stall.reason
    if stall.fail:
        updated["phase"] = "Failed"
    return updated
