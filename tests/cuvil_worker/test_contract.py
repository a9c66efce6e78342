"""The light Celery contract the operator codes against: ids, queues, idempotent submit."""

from __future__ import annotations

import redis
from cuvil_worker import contract

from tests.fixtures.redis import RedisServer


def _request(uid: str = "u1", generation: int = 1) -> dict:
    spec = {"targets": ["cpu-x86_64", "cpu-x86_64-amx"], "source": {"builtin": {"name": "mlp"}}}
    return {
        "uid": uid,
        "generation": generation,
        "namespace": "default",
        "name": "m",
        "spec": spec,
        "traceparent": "",
    }


def queued(broker: redis.Redis) -> int:
    """Messages waiting on cuvil.cpu at any priority step (Redis keeps one list per step)."""
    return sum(int(broker.llen(key)) for key in broker.keys("cuvil.cpu*") if b"binding" not in key)


def test_queue_for_target() -> None:
    assert contract.queue_for_target("cpu-x86_64") == "cuvil.cpu"
    assert contract.queue_for_target("cpu") == "cuvil.cpu"
    assert contract.queue_for_target("cuda-sm_90") == "cuvil.cuda.sm_90"
    assert contract.queue_for_target("cuda-sm_90", override="gpu-big") == "gpu-big"


def test_task_ids() -> None:
    request = _request()
    assert contract.chord_task_id(request) == "cuvil-u1-1"
    assert contract.target_task_id(request, "cpu-x86_64") == "cuvil-u1-1-cpu-x86_64"


def test_the_light_contract_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys, cuvil_worker.contract\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('cuvil.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["['cuvil.targets']"]  # the target vocabulary only


def test_submit_is_idempotent_and_cancel_revokes(redis_server: RedisServer) -> None:
    app = contract.create_app(redis_server.url(0), redis_server.url(1))
    broker = redis.Redis.from_url(redis_server.url(0))
    request = _request()
    assert contract.submit_compilation(app, request) == "cuvil-u1-1"
    assert queued(broker) == 2
    assert contract.submit_compilation(app, request) == "cuvil-u1-1"
    assert queued(broker) == 2, "a repeated submit queued more tasks"
    assert contract.read_progress(app, request).phase == contract.PHASE_PENDING
    contract.submit_compilation(app, _request(generation=2))
    assert queued(broker) == 4, "a new generation is a new compilation"
    contract.cancel_compilation(app, request)
    progress = contract.read_progress(app, request)
    assert progress.phase == contract.PHASE_FAILED
    assert progress.error is not None and "cancelled" in progress.error
