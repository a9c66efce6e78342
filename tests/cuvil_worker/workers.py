"""Real ``cuvil-worker`` subprocesses for the worker tests, and helpers to follow compilations.

Each worker runs in its own process group (``start_new_session``), so ``kill_hard`` takes the
Celery parent and its prefork child down together, as a node failure or an OOM kill would.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from celery import Celery
from cuvil_worker import contract

WORKER = Path(sys.executable).with_name("cuvil-worker")


@dataclass
class WorkerProcess:
    name: str
    log_path: Path
    process: subprocess.Popen[bytes]
    started: float = field(default_factory=time.monotonic)

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait_ready(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if " ready." in self.log:
                return
            if self.process.poll() is not None:
                raise RuntimeError(f"worker {self.name} exited:\n{self.log[-3000:]}")
            time.sleep(0.1)
        raise TimeoutError(f"worker {self.name} not ready in {timeout}s:\n{self.log[-3000:]}")

    def kill_hard(self) -> None:
        """SIGKILL the whole worker (parent and pool children): nothing gets to clean up."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGQUIT)  # Celery's cold shutdown: no waiting
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.kill_hard()


def worker_env(broker: str, backend: str, work_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "CUVIL_"))}
    env.update(
        CUVIL_BROKER_URL=broker,
        CUVIL_RESULT_BACKEND=backend,
        CUVIL_WORK_DIR=str(work_dir),
        CUVIL_VISIBILITY_TIMEOUT="6",
        CUVIL_RESTORE_INTERVAL="1",
        CUVIL_BENCH_ITERATIONS="10",
        CUVIL_TORCH_THREADS="1",
        CUVIL_RETRY_BACKOFF_MAX="2",
        CUVIL_TASK_TIME_LIMIT="300",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        OTEL_TRACES_EXPORTER="none",
        OTEL_METRICS_EXPORTER="none",
        OTEL_LOGS_EXPORTER="none",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


def start_worker(
    env: Mapping[str, str], log_dir: Path, queues: str = "cuvil.cpu", name: str | None = None
) -> WorkerProcess:
    name = name or f"w{uuid.uuid4().hex[:6]}"
    log_path = log_dir / f"{name}.log"
    log = log_path.open("ab")
    process = subprocess.Popen(
        [str(WORKER), "--queues", queues, "--hostname", f"{name}@test", "--loglevel", "INFO"],
        env=dict(env),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    log.close()
    return WorkerProcess(name, log_path, process)


def compilation_request(
    spec: Mapping[str, Any], *, uid: str | None = None, traceparent: str = ""
) -> dict[str, Any]:
    return {
        "uid": uid or uuid.uuid4().hex[:12],
        "generation": 1,
        "namespace": "default",
        "name": "test",
        "spec": dict(spec),
        "traceparent": traceparent,
    }


def wait_done(
    app: Celery, request: Mapping[str, Any], timeout: float = 120.0, workers: Sequence[Any] = ()
) -> contract.Progress:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        progress = contract.read_progress(app, request)
        if progress.done:
            return progress
        time.sleep(0.1)
    logs = "\n".join(w.log[-3000:] for w in workers)
    raise TimeoutError(f"compilation not done in {timeout}s: {progress}\n{logs}")


def wait_state(
    app: Celery, task_id: str, states: tuple[str, ...], timeout: float = 60.0
) -> tuple[str, Any]:
    from celery.result import AsyncResult

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = AsyncResult(task_id, app=app)
        if result.state in states:
            return result.state, result.info
        time.sleep(0.05)
    raise TimeoutError(f"{task_id} never reached {states} (now {result.state})")


def idle_cpu_seconds() -> float:
    """Machine-wide idle CPU time so far (all cores, idle + iowait), from /proc/stat."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    return (int(fields[3]) + int(fields[4])) / os.sysconf("SC_CLK_TCK")
