"""Standard Kubernetes conditions, kept by small pure helpers (API conventions).

A condition's ``lastTransitionTime`` moves only when its ``status`` changes; reason, message and
``observedGeneration`` follow every update. Lists are returned anew, never mutated in place.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from cuvil_operator.crd import CONDITION_TYPES

TRUE, FALSE, UNKNOWN = "True", "False", "Unknown"

Condition = dict[str, Any]


def now_rfc3339() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def get_condition(conditions: Sequence[Mapping[str, Any]], type_: str) -> Condition | None:
    for condition in conditions:
        if condition.get("type") == type_:
            return dict(condition)
    return None


def build_condition(
    type_: str,
    status: str,
    reason: str,
    message: str,
    generation: int,
    now: str,
    previous: Mapping[str, Any] | None = None,
) -> Condition:
    kept = previous.get("lastTransitionTime") if previous is not None else None
    changed = previous is None or previous.get("status") != status or not kept
    return {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": message,
        "observedGeneration": generation,
        "lastTransitionTime": now if changed else kept,
    }


def set_condition(
    conditions: Sequence[Mapping[str, Any]],
    type_: str,
    status: str,
    reason: str,
    message: str,
    generation: int,
    now: str,
) -> list[Condition]:
    """``conditions`` with ``type_`` set; known types keep the order of CONDITION_TYPES."""
    previous = get_condition(conditions, type_)
    updated = build_condition(type_, status, reason, message, generation, now, previous)
    result = [dict(c) for c in conditions if c.get("type") != type_] + [updated]
    order = {name: index for index, name in enumerate(CONDITION_TYPES)}
    return sorted(result, key=lambda c: order.get(c["type"], len(order)))


def set_conditions(
    conditions: Sequence[Mapping[str, Any]],
    updates: Mapping[str, tuple[str, str, str]],
    generation: int,
    now: str,
) -> list[Condition]:
    """Apply ``{type: (status, reason, message)}`` in one go."""
    result = [dict(c) for c in conditions]
    for type_, (status, reason, message) in updates.items():
        result = set_condition(result, type_, status, reason, message, generation, now)
    return result


def is_condition_true(conditions: Sequence[Mapping[str, Any]], type_: str) -> bool:
    condition = get_condition(conditions, type_)
    return condition is not None and condition.get("status") == TRUE
