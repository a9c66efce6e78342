"""Fixtures for the operator tests: kmock as the Kubernetes API, a real Redis, a real Celery
worker (the stub in ``stub_worker.py``, or ``cuvil-worker`` for the full flow) and the operator
running for real as the ``cuvil-operator`` process."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.fixtures.kube import REPO, KubeApi, kube_api, kubectl_binary
from tests.fixtures.redis import RedisServer, redis_server, redis_session

__all__ = ["kube_api", "kubectl_binary", "redis_server", "redis_session"]

T = TypeVar("T")
API = "cuvil.dev/v1alpha1"
PLURAL = "modelcompilations"
BIN = Path(sys.executable).parent


def wait_for(check: Callable[[], T | None], timeout: float = 60, what: str = "condition") -> T:
    """Poll ``check`` until it returns something truthy; fail with the last value seen."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")


@dataclass
class Process:
    """A child process with its output in a log file (shown when a test fails)."""

    argv: list[str]
    env: dict[str, str]
    log: Path
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def start(self) -> Process:
        with self.log.open("ab") as out:
            self.popen = subprocess.Popen(
                self.argv,
                env=self.env,
                cwd=REPO,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    def kill(self) -> None:
        """SIGKILL the process group: no cleanup, as a crash or an evicted pod."""
        if self.popen is not None and self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(timeout=10)

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def celery_env(redis: RedisServer, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "CUVIL_BROKER_URL": redis.url(0),
        "CUVIL_RESULT_BACKEND": redis.url(1),
        "CUVIL_VISIBILITY_TIMEOUT": "30",
        **extra,
    }


@dataclass
class StubWorker:
    process: Process
    executions: Path

    def lines(self) -> list[str]:
        return self.executions.read_text().splitlines() if self.executions.exists() else []


@pytest.fixture
def stub_worker(redis_server: RedisServer, tmp_path: Path) -> Iterator[StubWorker]:
    executions = tmp_path / "executions.log"
    env = celery_env(redis_server, CUVIL_STUB_LOG=str(executions))
    argv = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "tests.cuvil_operator.stub_worker",
        "worker",
        "-Q",
        "cuvil.cpu",
        "-P",
        "prefork",
        "-c",
        "2",
        "-n",
        "stub@%h",
        "-l",
        "INFO",
        "--without-gossip",
        "--without-mingle",
    ]
    process = Process(argv, env, tmp_path / "worker.log").start()
    wait_for(lambda: "ready" in process.text(), 60, "the stub worker")
    try:
        yield StubWorker(process, executions)
    finally:
        process.stop()


@dataclass
class Operator:
    """``cuvil-operator`` against the emulated cluster; restartable."""

    env: dict[str, str]
    log: Path
    process: Process | None = None

    def start(self) -> Operator:
        exe = shutil.which("cuvil-operator", path=str(BIN))
        argv = [exe] if exe else [sys.executable, "-m", "cuvil_operator.main"]
        self.process = Process(argv, self.env, self.log).start()
        return self

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()

    def text(self) -> str:
        return self.process.text() if self.process is not None else ""


@pytest.fixture
def running_operator(
    kube_api: KubeApi, redis_server: RedisServer, tmp_path: Path
) -> Iterator[Operator]:
    env = {
        **celery_env(redis_server),
        **kube_api.env(),
        "CUVIL_OPERATOR_POLL_INTERVAL": "0.05",
        "CUVIL_OPERATOR_STALL_SECONDS": "3",
    }
    env["CUVIL_BROKER_URL"], env["CUVIL_RESULT_BACKEND"] = redis_server.url(0), redis_server.url(1)
    running = Operator(env, tmp_path / "operator.log").start()
    try:
        yield running
    finally:
        running.stop()
        print(running.text()[-6000:])  # shown on failure


def get_mc(kube: KubeApi, name: str, namespace: str = "default") -> dict[str, Any] | None:
    return kube.get(API, PLURAL, namespace, name)


def events_for(kube: KubeApi, name: str, namespace: str = "default") -> list[dict[str, Any]]:
    return [
        e
        for e in kube.list("v1", "events", namespace)
        if e.get("involvedObject", {}).get("name") == name
    ]
