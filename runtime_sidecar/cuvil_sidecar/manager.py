"""The served model's life: the first load, hot reloads, and which model a request gets.

Loading (fetch, verify, load, warm up, golden check) runs on a background thread while the
current model keeps serving. Only a model that passed every step replaces the current one, and
the swap is one assignment on the event loop: a request that already holds the old model
finishes on it (``ServedModel.retire`` waits for it), every later request gets the new one. A
new artifact that fails any step is refused, counted and logged; the old model keeps serving.

A first load that fails is tried again with backoff until one succeeds (``start``). Reloads are
triggered by SIGHUP (reload if the source's digest differs from the served one,
including a retry of a digest that failed before) or by polling every ``CUVIL_POLL_INTERVAL_S``
(reload if the digest differs from the last one tried, so a bad artifact is not retried forever).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from cuvil.artifact.limits import LoadLimits
from cuvil.artifact.trust import TrustSettings
from cuvil_sidecar.config import SidecarConfig
from cuvil_sidecar.errors import ModelNotFound, ModelNotReady
from cuvil_sidecar.generation.loader import load_generation
from cuvil_sidecar.generation.servable import GenerationServable
from cuvil_sidecar.measurement import build_measurement, publish
from cuvil_sidecar.metrics import Metrics
from cuvil_sidecar.process_usage import CpuUtilization, resident_bytes
from cuvil_sidecar.servable import ServedModel
from cuvil_sidecar.source import ModelSource
from cuvil_sidecar.startup import load_checked

log = logging.getLogger("cuvil_sidecar.manager")

ReadyHook = Callable[[bool], Awaitable[None]]
Served = ServedModel | GenerationServable
T = TypeVar("T")


async def in_own_thread(work: Callable[[], T]) -> T:
    """``work()`` on a thread of its own that ends with it.

    Loading runs the model (warm-up, golden check), and libgomp keeps a pool of OpenMP threads
    for every thread that has run a parallel region, for as long as that thread lives. With the
    loader's pool alive beside the serving thread's, libgomp counts more threads than cores and
    its threads stop spinning between parallel regions: every region of a run then has to wake
    a sleeping thread instead of finding it spinning, which slows every call. A thread that ends
    frees its pool, so after a load only the serving thread's remains."""
    thread = ThreadPoolExecutor(1, thread_name_prefix="cuvil-load")
    try:
        return await asyncio.get_running_loop().run_in_executor(thread, work)
    finally:
        thread.shutdown(wait=False)  # its thread ends once the work is done


class ModelManager:
    def __init__(
        self,
        config: SidecarConfig,
        source: ModelSource,
        metrics: Metrics,
        on_ready: ReadyHook | None = None,
    ) -> None:
        self.config = config
        self.source = source
        self.metrics = metrics
        self.current: Served | None = None
        self.reason = "starting"
        self._on_ready = on_ready
        self._tried_digest: str | None = None
        self._lock = asyncio.Lock()
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="cuvil-load")
        self._retiring: set[asyncio.Task[None]] = set()
        self._publishing: set[asyncio.Task[bool]] = set()
        self._cpu = CpuUtilization()

    @property
    def ready(self) -> bool:
        return self.current is not None

    def readiness(self) -> tuple[bool, str]:
        current = self.current
        if current is None:
            return False, f"not ready: {self.reason}"
        index = f" index {current.index_digest}" if current.index_digest else ""
        return True, f"ready: {current.name} {current.digest}{index}"

    def acquire(self, name: str, version: str) -> Served:
        """The model to serve this request, with its in-flight count raised (``release`` it)."""
        current = self.current
        if current is None:
            if self.config.model_name and name != self.config.model_name:
                raise ModelNotFound(
                    f"no model named {name!r}; this sidecar serves only {self.config.model_name!r}"
                )
            raise ModelNotReady(f"model {name!r} is not ready: {self.reason}")
        if name != current.name:
            raise ModelNotFound(
                f"no model named {name!r}; this sidecar serves only {current.name!r}"
            )
        if version and version not in current.versions:
            raise ModelNotFound(
                f"model {name!r} has no version {version!r}; it serves version"
                f" {current.version!r} ({', '.join(current.versions[1:])})"
            )
        return current.acquire()

    async def load(
        self, *, only_if: Callable[[str], bool] | None = None, quiet: bool = False
    ) -> bool:
        """Load the source's artifact and swap it in; True if a new model now serves. With
        ``only_if``, load only when it accepts the source's current digest."""
        async with self._lock:
            loop = asyncio.get_running_loop()
            try:
                digest = await loop.run_in_executor(self._loader, self.source.digest)
            except Exception as error:
                self._refuse(f"cannot read {self.source}: {error}")
                return False
            if only_if is not None and not only_if(digest):
                log.log(
                    logging.DEBUG if quiet else logging.INFO,
                    "%s still has digest %s: nothing to reload",
                    self.source,
                    digest,
                )
                return False
            self._tried_digest = digest
            try:
                trust = TrustSettings.load(self.config.trust_policy, self.config.trusted_keys)
                generation = await self._within_time_limit(
                    lambda: load_generation(self.source, digest, self.config, trust)
                )
            except Exception as error:
                log.debug("load failure", exc_info=True)
                self._refuse(str(error))
                return False
            if generation is not None:
                generating = GenerationServable(generation, self.config, self.metrics)
                generating.register_gauges()
                return await self._swap(generating)
            try:
                loaded = await self._within_time_limit(
                    lambda: load_checked(
                        self.source,
                        source_digest=digest,
                        max_rows=self.config.max_batch_size if self.config.batching else 1,
                        warmup_runs=self.config.warmup_runs,
                        golden_tolerance=self.config.golden_tolerance,
                        progress=self._progress,
                        warmup_shapes=self.config.warmup_shapes,
                        tactics_cache_dir=self.config.tactics_cache,
                        limits=LoadLimits(
                            max_tensor_bytes=self.config.max_tensor_bytes,
                            max_nodes=self.config.max_graph_nodes,
                        ),
                        time_limit_s=self.config.load_timeout_s,
                        trust=trust,
                        measure_runs=self.config.measurement.runs,
                    ),
                )
            except Exception as error:
                log.debug("load failure", exc_info=True)
                self._refuse(str(error))
                return False
            served = ServedModel(loaded, self.config, self.metrics)
            self.metrics.gauge(
                "nv_inference_pending_request_count", served.name, served.version, self._pending
            )
            swapped = await self._swap(served)
            if loaded.measured is not None:
                self._publish(served)
            return swapped

    def _pending(self) -> float:
        current = self.current
        return float(current.batcher.pending) if isinstance(current, ServedModel) else 0.0

    async def _swap(self, new: Served) -> bool:
        """Under the load lock: ``new`` serves from now on; the old model retires."""
        old, self.current = self.current, new
        self.metrics.gauge("cuvil_model_ready", new.name, new.version, lambda: 1.0)
        self.metrics.served(new.name, new.version, new.digest, new.index_digest or "")
        self.metrics.gauge("nv_cpu_utilization", new.name, new.version, self._cpu.read)
        self.metrics.gauge("nv_cpu_memory_used_bytes", new.name, new.version, resident_bytes)
        self.metrics.reload("ok")
        log.info(
            "serving %s %s%s (from %s; %s)",
            new.name,
            new.digest,
            f" index {new.index_digest}" if new.index_digest else "",
            self.source,
            new.mode,
        )
        if old is None:
            if self._on_ready is not None:
                await self._on_ready(True)
        else:
            task = asyncio.create_task(old.retire())
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)
        return True

    async def start(self, first_delay_s: float = 1.0, max_delay_s: float = 60.0) -> None:
        """The first load, tried again with exponential backoff (``first_delay_s`` doubling up
        to ``max_delay_s``) until a model serves or the sidecar stops: a registry that is down,
        or an artifact not pushed yet, delays readiness instead of ending it. Each failure says
        why and when the next try comes (readiness answers 503 with it meanwhile)."""
        delay = first_delay_s
        while self.current is None:
            if await self.load():
                return
            log.warning("the first load failed; trying again in %.0f s", delay)
            self.reason = f"{self.reason} (next try in {delay:.0f} s)"
            await asyncio.sleep(delay)
            delay = min(delay * 2, max_delay_s)

    async def _within_time_limit(self, work: Callable[[], T]) -> T:
        """``work()`` in its own thread, given up after ``CUVIL_LOAD_TIMEOUT_S``: the event loop
        (health, readiness, the running model) never waits on it longer. A thread cannot be
        stopped from outside; ``load_checked`` checks the same limit between its steps and
        ends itself."""
        limit = self.config.load_timeout_s
        try:
            return await asyncio.wait_for(in_own_thread(work), timeout=limit or None)
        except TimeoutError:
            raise TimeoutError(
                f"loading and warming up took longer than CUVIL_LOAD_TIMEOUT_S={limit:g} s"
            ) from None

    async def reload_on_signal(self) -> bool:
        served = self.current.source_digest if self.current else None
        return await self.load(only_if=lambda digest: digest != served)

    async def poll(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await self.load(only_if=lambda digest: digest != self._tried_digest, quiet=True)

    async def close(self, grace_s: float | None = None) -> None:
        """Retire the model served (a generation model's streams get ``grace_s``, or its
        default, to finish before they are ended) and those still retiring."""
        current, self.current = self.current, None
        if current is not None:
            await (current.retire() if grace_s is None else current.retire(grace_s))
        await asyncio.gather(*self._retiring, *self._publishing, return_exceptions=True)
        self._loader.shutdown(wait=False, cancel_futures=True)

    def _publish(self, served: ServedModel) -> None:
        """The warm-up measurement of a model with deferred gates, to the pod's annotation (on
        a thread: the API call never holds the event loop)."""
        loaded = served.loaded
        target = str(served.model.config.get("target") or "")
        measurement = build_measurement(
            loaded.measured or {}, target, served.digest, loaded.deferred or {},
            self.config.measurement,
        )  # fmt: skip
        task = asyncio.create_task(asyncio.to_thread(publish, measurement, self.config.measurement))
        self._publishing.add(task)
        task.add_done_callback(self._publishing.discard)

    def _progress(self, message: str) -> None:
        if self.current is None:
            self.reason = message
        log.info("%s", message)

    def _refuse(self, why: str) -> None:
        self.metrics.reload("refused")
        if self.current is None:
            self.reason = f"loading {self.source} failed: {why}"
            log.error("not ready: %s", self.reason)
        else:
            log.error(
                "refused the new artifact from %s, still serving %s: %s",
                self.source,
                self.current.digest,
                why,
            )
