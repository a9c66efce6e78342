"""How the worker sorts failures: permanent (fail at once) or transient (retry with backoff).

Permanent: the spec or model is wrong (bad source, export refuses the model, unsupported
precision or target), verification fails, or a gate is not met; running again gives the same
answer. Transient: the registry is unreachable or answers 5xx (``RegistryError.retryable``).
Results in the backend are JSON, so each failure is raised as one of these with a message that
stands on its own (the operator copies it into status.message).
"""

from __future__ import annotations


class CompileFailed(Exception):
    """A permanent failure of one target; never retried."""

    reason = "CompileFailed"


class InvalidSpec(CompileFailed):
    reason = "InvalidSpec"


class ModelNotCompilable(CompileFailed):
    """The model cannot be exported or lowered; the message carries the exporter's reason."""

    reason = "ModelNotCompilable"


class VerificationFailed(CompileFailed):
    reason = "VerificationFailed"


class GateFailed(CompileFailed):
    """A spec gate is not met; the message names the gate, the measured value and the limit."""

    reason = "GateFailed"

    @classmethod
    def of(cls, gate: str, measured: float, relation: str, limit: float) -> GateFailed:
        # One plain message argument, so that Celery can rebuild the exception from JSON.
        return cls(f"gate {gate} failed: measured {measured:.6g}, required {relation} {limit:.6g}")


class CompileTimeLimit(CompileFailed):
    """The compile ran past its soft time limit (CUVIL_TASK_TIME_LIMIT)."""

    reason = "TimeLimitExceeded"


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
