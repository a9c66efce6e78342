"""A real Celery worker speaking the contract, with a compile that only sleeps through stages.

The operator tests need compiles that take a known few seconds and leave a trace (one log line
per execution), so delete, restart and update land mid-compile and "one task only" can be
counted. Everything else is real: Redis broker and results, the contract's app settings,
chord, custom states, revoke with terminate. The full compile is tested with ``cuvil-worker``.

    celery -A tests.cuvil_operator.stub_worker worker -Q cuvil.cpu -P prefork -c 2

Each stage lasts ``cuvil-stub:stage-seconds`` (a key in the result backend; default 0.5).
Executions are appended to ``$CUVIL_STUB_LOG``.
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any

from cuvil_worker import contract

app = contract.create_app()
DELAY_KEY = "cuvil-stub:stage-seconds"


def _log(line: str) -> None:
    path = os.environ.get("CUVIL_STUB_LOG")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def _stage_seconds() -> float:
    value = app.backend.client.get(DELAY_KEY)
    return float(value) if value else 0.5


def _digest(*parts: Any) -> str:
    return "sha256:" + hashlib.sha256("/".join(map(str, parts)).encode()).hexdigest()


@app.task(name=contract.TASK_COMPILE, bind=True)
def compile_target(self: Any, request: dict[str, Any], target: str) -> dict[str, Any]:
    _log(f"start {self.request.id}")
    delay = _stage_seconds()
    for state, stage in (
        (contract.STATE_COMPILING, "passes"),
        (contract.STATE_VALIDATING, "verify"),
    ):
        self.update_state(state=state, meta={"stage": stage, "target": target})
        time.sleep(delay)
    _log(f"done {self.request.id}")
    repository = request["spec"]["output"]["repository"]
    digest = _digest(request["uid"], request["generation"], target)
    return {
        "target": target,
        "ref": f"{repository}@{digest}",
        "digest": digest,
        "size": 1234,
        "report": {
            "latency_ms": {"eager": 2.0, "cuvil": 1.0, "speedup": 2.0},
            "max_abs_error": 1e-6,
            "gates": _speed_gates(request["spec"].get("gates") or {}, target),
        },
    }


def _speed_gates(gates: dict[str, Any], target: str) -> dict[str, Any]:
    """The speed gates as the real worker reports them: met at 2.0x and 1 ms, or deferred for a
    CUDA target (its speed is not measured on a CPU worker)."""
    measured = {"minSpeedup": (2.0, ">="), "maxLatencyP99Ms": (1.0, "<=")}
    checked: dict[str, Any] = {}
    for gate, (value, relation) in measured.items():
        if gate not in gates:
            continue
        limit = float(gates[gate])
        if target.startswith("cuda-"):
            checked[gate] = {"measured": None, "limit": limit, "deferred": "not measured"}
        else:
            met = value >= limit if relation == ">=" else value <= limit
            checked[gate] = {"measured": value, "limit": limit, "passed": met}
    return checked


@app.task(name=contract.TASK_INDEX, bind=True)
def push_index(self: Any, request: dict[str, Any]) -> dict[str, Any]:
    _log(f"start {self.request.id}")
    self.update_state(state=contract.STATE_PUSHING, meta={"stage": "index", "target": ""})
    time.sleep(_stage_seconds())
    results = [
        app.AsyncResult(contract.target_task_id(request, t)).result
        for t in contract.targets_of(request)
    ]
    repository = request["spec"]["output"]["repository"]
    digest = _digest(request["uid"], request["generation"], "index")
    _log(f"done {self.request.id}")
    return {
        "index": {"ref": f"{repository}@{digest}", "digest": digest},
        "artifacts": [{k: r[k] for k in ("target", "ref", "digest", "size")} for r in results],
        "report": {r["target"]: r["report"] for r in results},
    }


@app.task(name=contract.TASK_CLEANUP)
def cleanup(request: dict[str, Any], labels: list[str] | None = None) -> dict[str, Any]:
    """A cancel's clean-up: the stub pushes nothing, so there is nothing to delete."""
    return {"deleted": []}
