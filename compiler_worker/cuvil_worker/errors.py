"""How the worker sorts failures: permanent (fail at once) or transient (retry with backoff).

Permanent: the spec or model is wrong (bad source, export refuses the model, unsupported
precision or target), verification fails, or a gate is not met; running again gives the same
answer. Transient: the registry is unreachable or answers 5xx (``RegistryError.retryable``).
Results in the backend are JSON, so each failure is raised as one of these with a message that
stands on its own (the operator copies it into status.message) and, where something was
measured, ``details`` (JSON: the failing gates, the report so far). Celery stores ``args`` and
rebuilds the exception from them, so both travel as plain arguments. ``reason`` is the
CamelCase reason the operator writes on the condition of the stage that failed (``condition``).
"""

from __future__ import annotations

from typing import Any


class CompileFailed(Exception):
    """A permanent failure of one target; never retried."""

    reason = "CompileFailed"
    condition = "Compiling"

    def __init__(self, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message, details or {})

    @property
    def message(self) -> str:
        return str(self.args[0])

    @property
    def details(self) -> dict[str, Any]:
        return dict(self.args[1]) if len(self.args) > 1 and self.args[1] else {}

    def __str__(self) -> str:
        return self.message


class InvalidSpec(CompileFailed):
    reason = "InvalidSpec"


class ModelNotCompilable(CompileFailed):
    """The model cannot be exported or lowered; the message carries the exporter's reason."""

    reason = "ModelNotCompilable"


class VerificationFailed(CompileFailed):
    reason = "VerificationFailed"
    condition = "Validated"


class GateFailed(CompileFailed):
    """Spec gates are not met; the message names every failing gate with the measured value
    and the limit, ``details`` holds them and the measured report."""

    reason = "GateFailed"
    condition = "Validated"

    @staticmethod
    def describe(gate: str, measured: float, relation: str, limit: float) -> str:
        return f"gate {gate} failed: measured {measured:.6g}, required {relation} {limit:.6g}"


class CompileTimeLimit(CompileFailed):
    """The compile ran past its soft time limit (CUVIL_TASK_TIME_LIMIT)."""

    reason = "TimeLimitExceeded"


class PushRefused(CompileFailed):
    """The registry refused the push for good (denied, bad request); retrying cannot help."""

    reason = "PushRefused"
    condition = "Pushed"


def caused_by(error: BaseException, kind: type[BaseException]) -> bool:
    """Whether ``kind`` is ``error`` or anywhere in its cause/context chain (the exporter wraps
    whatever it meets, a time-limit signal included)."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, kind):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


class RegistryFault(Exception):
    """The registry could not take the push now; the task retries with backoff."""


class IndexIncomplete(Exception):
    """The index task ran before every target's result was readable; it retries shortly."""
