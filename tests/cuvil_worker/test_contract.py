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


def test_the_current_request_moves_on_and_a_cancel_is_a_tombstone(
    redis_server: RedisServer,
) -> None:
    app = contract.create_app(redis_server.url(0), redis_server.url(1))
    first, second = _request(uid="u2"), _request(uid="u2", generation=2)
    assert not contract.is_current_known(app, first)
    contract.submit_compilation(app, first)
    assert contract.not_current(app, first) is None
    contract.submit_compilation(app, second)
    assert "moved on to cuvil-u2-2" in (contract.not_current(app, first) or "")
    contract.cancel_compilation(app, first)  # the stale cancel leaves the newer one alone
    assert contract.not_current(app, second) is None
    contract.cancel_compilation(app, second)
    assert "was deleted or cancelled" in (contract.not_current(app, second) or "")
    assert contract.submit_compilation(app, second) == "cuvil-u2-2"
    assert contract.not_current(app, second) is not None, "a repeated submit resurrected it"
    app.backend.client.delete("cuvil:current:u2")  # Redis lost its data
    assert contract.not_current(app, second) is None
    assert not contract.is_current_known(app, second)


def test_a_submit_left_publishing_is_published_again(redis_server: RedisServer) -> None:
    app = contract.create_app(redis_server.url(0), redis_server.url(1))
    broker = redis.Redis.from_url(redis_server.url(0))
    request = _request(uid="u3")
    before = queued(broker)
    key = contract.SUBMITTED_KEY.format(chord_id=contract.chord_task_id(request))
    app.backend.client.set(key, contract.PUBLISHING)  # the submitter died before publishing
    assert not contract.is_submitted(app, request)
    contract.submit_compilation(app, request)
    assert queued(broker) == before + 2
    assert contract.is_submitted(app, request)
    contract.submit_compilation(app, request)
    assert queued(broker) == before + 2


def queued_cleanups(broker: redis.Redis, queue: str) -> list[list[str]]:
    """The ledger labels of each ``cuvil.cleanup`` message waiting on ``queue``."""
    import base64
    import json

    found = []
    for key in broker.keys(f"{queue}*"):
        if b"binding" in key or key.decode().split(":")[0] != queue:
            continue
        for raw in broker.lrange(key, 0, -1):
            message = json.loads(raw)
            if message["headers"]["task"] == contract.TASK_CLEANUP:
                args, _kwargs, _embed = json.loads(base64.b64decode(message["body"]))
                found.append(args[1])
    return found


def test_a_cancel_sends_a_cleanup_to_every_queue_the_request_used(
    redis_server: RedisServer,
) -> None:
    """Each cleanup goes where the workers that pushed its manifests consume: a GPU queue
    without a live worker does not hold back the CPU target's cleanup."""
    app = contract.create_app(redis_server.url(0), redis_server.url(1))
    broker = redis.Redis.from_url(redis_server.url(0))
    request = _request(uid="u4")
    request["spec"]["targets"] = ["cuda-sm_90", "cpu-x86_64", "cpu-x86_64-amx"]
    contract.submit_compilation(app, request)
    contract.cancel_compilation(app, request)
    assert queued_cleanups(broker, "cuvil.cuda.sm_90") == [["cuda-sm_90", contract.INDEX_LABEL]]
    assert queued_cleanups(broker, "cuvil.cpu") == [["cpu-x86_64", "cpu-x86_64-amx"]]
    request["spec"]["queue"] = "gpu-big"  # one queue for all: one cleanup for everything
    assert contract.cleanup_plan(request) == {
        "gpu-big": ["cuda-sm_90", "cpu-x86_64", "cpu-x86_64-amx", contract.INDEX_LABEL]
    }


def test_the_current_key_expires_unless_the_operator_keeps_it(
    redis_server: RedisServer,
) -> None:
    """An object that went away without a cancel (the broker was down past the delete
    handler's retries) leaves a current-key that nobody refreshes: it expires."""
    import time

    app = contract.create_app(redis_server.url(0), redis_server.url(1))
    client = app.backend.client
    first, second = _request(uid="u5"), _request(uid="u5", generation=2)
    contract.submit_compilation(app, first, current_ttl=2)
    assert 0 < client.ttl("cuvil:current:u5") <= 2
    time.sleep(1.5)
    assert contract.keep_current(app, first, ttl=2)
    time.sleep(1.0)  # 2.5 s after the submit: alive only because it was kept
    assert contract.not_current(app, first) is None and contract.is_current_known(app, first)
    time.sleep(1.5)
    assert not contract.is_current_known(app, first), "the unkept key did not expire"
    assert contract.keep_current(app, first, ttl=2), "a followed request's key is written again"
    assert contract.not_current(app, first) is None
    contract.submit_compilation(app, second, current_ttl=2)
    assert not contract.keep_current(app, first, ttl=60), "a stale request kept the key"
    assert client.get("cuvil:current:u5") == b"cuvil-u5-2" and client.ttl("cuvil:current:u5") <= 2
    contract.cancel_compilation(app, second)
    assert not contract.keep_current(app, second, ttl=60)
    assert "was deleted or cancelled" in (contract.not_current(app, second) or "")
