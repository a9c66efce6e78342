"""Cuvil's compile workers: Celery tasks over ``cuvil`` (see docs/contracts.md).

contract.py         the light contract the operator imports (celery/redis only)
app.py, main.py     the worker's Celery app and the ``cuvil-worker`` entry point
tasks.py            cuvil.compile (one target) and cuvil.push_index (the chord callback)
target_pipeline.py  load -> compile -> validate -> benchmark -> gates -> package -> push
checks.py           verification against eager fp32, latency benchmark, gates
lease.py            keeps held broker messages fresh (short visibility timeout, no dupes)
telemetry.py        OTel: continue ``traceparent``, export over OTLP
config.py, errors.py
"""
