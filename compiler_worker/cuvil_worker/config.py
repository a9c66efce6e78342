"""The worker's configuration, read from the environment once (``WorkerConfig.from_env``).

| variable | default | meaning |
|---|---|---|
| CUVIL_BROKER_URL | redis://127.0.0.1:6379/0 | Celery broker (Redis) |
| CUVIL_RESULT_BACKEND | redis://127.0.0.1:6379/1 | Celery results and progress |
| CUVIL_REGISTRY_CONFIG | ~/.docker/config.json | docker config with registry credentials |
| CUVIL_WORK_DIR | $TMPDIR/cuvil-worker | scratch: packaged artifacts kept for retries |
| CUVIL_VISIBILITY_TIMEOUT | 60 | s before a dead worker's task is handed to another |
| CUVIL_RESTORE_INTERVAL | 5 | s between sweeps for such tasks |
| CUVIL_TASK_TIME_LIMIT | 3600 | s a compile may run (soft limit 30 s earlier) |
| CUVIL_PUSH_RETRIES | 8 | retries of registry faults (backoff 2, 4, … 60 s) |
| CUVIL_RETRY_BACKOFF_MAX | 60 | s, the longest wait between registry retries |
| CUVIL_BENCH_ITERATIONS | 30 | timed runs each of eager and compiled |
| CUVIL_TORCH_THREADS | (torch's default) | intra-op threads per worker process |
| CUVIL_WARM_UP | 1 | run one tiny torch.export before forking (first compile ~10 s faster) |
| CUVIL_SIGNING_KEY | (unsigned) | ECDSA P-256 key (PEM, a mounted secret) signing pushes |
| CUVIL_SIGNING_KEY_PASSWORD_FILE | (none) | file holding the key's password, if it is encrypted |
| CUVIL_SIGNER | cuvil-worker | the signer name the signatures claim (shown by `cuvil inspect`) |
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cuvil_worker.contract import DEFAULT_BROKER_URL, DEFAULT_RESULT_BACKEND

if TYPE_CHECKING:
    from cuvil.artifact.trust import Signer


@dataclass(frozen=True)
class WorkerConfig:
    broker_url: str = DEFAULT_BROKER_URL
    result_backend: str = DEFAULT_RESULT_BACKEND
    registry_config: Path | None = None
    work_dir: Path = Path(tempfile.gettempdir()) / "cuvil-worker"
    visibility_timeout: float = 60.0
    restore_interval: float = 5.0
    task_time_limit: float = 3600.0
    push_retries: int = 8
    retry_backoff_max: float = 60.0
    bench_iterations: int = 30
    torch_threads: int | None = None
    warm_up: bool = True
    signing_key: Path | None = None
    signing_key_password_file: Path | None = None
    signer_name: str = "cuvil-worker"

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> WorkerConfig:
        env = dict(os.environ if env is None else env)
        default = cls()
        registry_config = env.get("CUVIL_REGISTRY_CONFIG")
        threads = env.get("CUVIL_TORCH_THREADS")
        return cls(
            broker_url=env.get("CUVIL_BROKER_URL", default.broker_url),
            result_backend=env.get("CUVIL_RESULT_BACKEND", default.result_backend),
            registry_config=Path(registry_config) if registry_config else None,
            work_dir=Path(env.get("CUVIL_WORK_DIR", str(default.work_dir))),
            visibility_timeout=float(
                env.get("CUVIL_VISIBILITY_TIMEOUT", default.visibility_timeout)
            ),
            restore_interval=float(env.get("CUVIL_RESTORE_INTERVAL", default.restore_interval)),
            task_time_limit=float(env.get("CUVIL_TASK_TIME_LIMIT", default.task_time_limit)),
            push_retries=int(env.get("CUVIL_PUSH_RETRIES", default.push_retries)),
            retry_backoff_max=float(env.get("CUVIL_RETRY_BACKOFF_MAX", default.retry_backoff_max)),
            bench_iterations=int(env.get("CUVIL_BENCH_ITERATIONS", default.bench_iterations)),
            torch_threads=int(threads) if threads else None,
            warm_up=env.get("CUVIL_WARM_UP", "1").lower() not in ("0", "false", "no"),
            signing_key=_path(env.get("CUVIL_SIGNING_KEY")),
            signing_key_password_file=_path(env.get("CUVIL_SIGNING_KEY_PASSWORD_FILE")),
            signer_name=env.get("CUVIL_SIGNER") or default.signer_name,
        )

    def signer(self) -> Signer | None:
        """The key pushed manifests are signed with (read when a push needs it), or None."""
        if self.signing_key is None:
            return None
        from cuvil.artifact.trust import Signer

        environ = {"CUVIL_SIGNING_KEY": str(self.signing_key), "CUVIL_SIGNER": self.signer_name}
        if self.signing_key_password_file is not None:
            environ["CUVIL_SIGNING_KEY_PASSWORD_FILE"] = str(self.signing_key_password_file)
        return Signer.from_env(environ)

    @property
    def soft_time_limit(self) -> float:
        # Room between soft and hard limit for the task to fail cleanly (a quarter, at most 30 s).
        return self.task_time_limit - min(30.0, self.task_time_limit * 0.25)

    def backoff(self, retries: int) -> float:
        """Seconds before registry retry number ``retries`` (0-based): 2, 4, 8, … capped."""
        return float(min(2.0 ** (retries + 1), self.retry_backoff_max))


def _path(text: str | None) -> Path | None:
    return Path(text) if text and text.strip() else None
