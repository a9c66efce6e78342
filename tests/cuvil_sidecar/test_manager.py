"""The model manager in process (no gRPC): not ready with a reason when the artifact is bad,
tag/file polling swaps in a new digest, a corrupt one is refused while the old keeps serving;
plus the configuration parser and the sidecar's import boundary."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cuvil_sidecar.batcher import BatchResult
from cuvil_sidecar.config import ConfigError, SidecarConfig
from cuvil_sidecar.errors import ModelNotFound, ModelNotReady
from cuvil_sidecar.manager import ModelManager, in_own_thread
from cuvil_sidecar.metrics import Metrics
from cuvil_sidecar.source import ModelSource

from tests.cuvil_sidecar.conftest import REPO


def corrupt_copy(source: Path, target: Path) -> Path:
    data = bytearray(source.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 8] = bytes(255 - b for b in data[middle : middle + 8])
    target.write_bytes(bytes(data))
    return target


def swap_in(source: Path, target: Path) -> None:
    staging = target.with_name(target.name + ".staging")
    shutil.copyfile(source, staging)
    os.replace(staging, target)


def test_bad_first_artifact_is_not_ready_and_says_why(mlp_artifact: Path, tmp_path: Path) -> None:
    bad = corrupt_copy(mlp_artifact, tmp_path / "bad.cuvil")

    async def scenario() -> None:
        manager = ModelManager(SidecarConfig(model=str(bad)), ModelSource(str(bad)), Metrics())
        assert await manager.load() is False
        ready, reason = manager.readiness()
        assert not ready
        assert "digest" in reason or "not a Cuvil artifact" in reason, reason
        with pytest.raises(ModelNotReady, match="not ready"):
            manager.acquire("mlp", "")
        await manager.close()

    asyncio.run(scenario())


def test_polling_swaps_new_digest_and_refuses_corrupt(
    mlp_artifact: Path, mlp_artifact_v2: Path, tmp_path: Path
) -> None:
    served = tmp_path / "served.cuvil"
    shutil.copyfile(mlp_artifact, served)
    corrupt = corrupt_copy(mlp_artifact, tmp_path / "corrupt.cuvil")

    async def wait(condition, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)

    async def scenario() -> None:
        config = SidecarConfig(model=str(served), warmup_runs=1, poll_interval_s=0.1)
        metrics = Metrics()
        manager = ModelManager(config, ModelSource(str(served)), metrics)
        assert await manager.load()
        assert manager.current is not None
        first = manager.current
        with pytest.raises(ModelNotFound, match="serves only 'mlp'"):
            manager.acquire("other", "")
        held = manager.acquire("mlp", "")  # an in-flight request on the old model
        poller = asyncio.create_task(manager.poll(config.poll_interval_s))
        swap_in(mlp_artifact_v2, served)
        await wait(lambda: manager.current is not first)
        second = manager.current
        assert second is not None and second.digest != first.digest
        assert not first.batcher._closed  # still finishing its in-flight request
        held.release()
        await wait(lambda: first.batcher._closed)
        swap_in(corrupt, served)
        await wait(lambda: metrics.value("cuvil_model_reloads", result="refused") == 1)
        assert manager.current is second
        await asyncio.sleep(0.5)  # the same bad digest is not retried on every poll
        assert metrics.value("cuvil_model_reloads", result="refused") == 1
        poller.cancel()
        await manager.close()

    asyncio.run(scenario())


def test_config_from_environment() -> None:
    config = SidecarConfig.from_env(
        {"CUVIL_MODEL": "/models/m.cuvil", "CUVIL_MAX_BATCH_SIZE": "16", "CUVIL_GRPC_PORT": "9"}
    )
    assert (config.model, config.max_batch_size, config.grpc_port) == ("/models/m.cuvil", 16, 9)
    assert config.batching and config.metrics_port == 8002
    assert not SidecarConfig.from_env({"CUVIL_MODEL": "m", "CUVIL_MAX_BATCH_SIZE": "1"}).batching
    assert config.torch_threads == 0  # torch's default
    one_thread = SidecarConfig.from_env({"CUVIL_MODEL": "m", "CUVIL_TORCH_THREADS": "1"})
    assert one_thread.torch_threads == 1
    assert not config.lone_requests_wait  # a lone request runs at once unless told to wait
    waits = SidecarConfig.from_env({"CUVIL_MODEL": "m", "CUVIL_LONE_REQUESTS": "wait"})
    assert waits.lone_requests_wait
    with pytest.raises(ConfigError, match="CUVIL_LONE_REQUESTS='soon' is not one of"):
        SidecarConfig.from_env({"CUVIL_MODEL": "m", "CUVIL_LONE_REQUESTS": "soon"})
    assert config.stream_interval == 1  # a streamed token is written as it comes
    every_four = SidecarConfig.from_env({"CUVIL_MODEL": "m", "CUVIL_STREAM_INTERVAL": "4"})
    assert every_four.stream_interval == 4
    with pytest.raises(ConfigError, match="CUVIL_STREAM_INTERVAL"):
        SidecarConfig.from_env({"CUVIL_MODEL": "m", "CUVIL_STREAM_INTERVAL": "0"})
    with pytest.raises(ConfigError, match="CUVIL_MODEL is not set"):
        SidecarConfig.from_env({})
    with pytest.raises(ConfigError, match="CUVIL_GRPC_PORT='x' is not an integer"):
        SidecarConfig.from_env({"CUVIL_MODEL": "m", "CUVIL_GRPC_PORT": "x"})


def test_sidecar_imports_only_runtime_and_artifact() -> None:
    probe = (
        "import sys, cuvil_sidecar.main, cuvil_sidecar.server;"
        "print(' '.join(m for m in sys.modules if m.startswith(('cuvil.', 'tritonclient'))))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", probe], check=True, capture_output=True, text=True, cwd=REPO
    ).stdout.split()
    allowed = ("cuvil.runtime", "cuvil.artifact", "cuvil.api", "cuvil.dtypes", "cuvil.ir")
    allowed += ("cuvil.shape_expr", "cuvil.fused_ops", "cuvil.targets", "cuvil.backends")
    allowed += ("cuvil.allowed_ops", "cuvil.shape_bounds")
    allowed += ("cuvil.analysis",)  # the memory plan a loaded model checks its policy against
    allowed += ("cuvil.generation",)  # the engine contract and sampling the scheduler uses
    assert not [m for m in loaded if m.startswith(("cuvil.passes", "cuvil.pipeline"))]
    assert [m for m in loaded if not m.startswith(allowed)] == []
    assert "cuvil.generation.eager_engine" not in loaded  # transformers only for a checkpoint


def test_oci_layout_tag_polling_and_compile_trace_link(
    mlp_artifact: Path, mlp_artifact_v2: Path, tmp_path: Path
) -> None:
    """CUVIL_MODEL as an OCI layout tag: resolved through cuvil.artifact into the node cache;
    moving the tag is picked up by polling; the worker's trace-id annotation on the manifest
    becomes the compile link."""
    from cuvil.artifact import push_artifact

    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    reference = f"oci:{tmp_path / 'layout'}:serving"
    push_artifact(mlp_artifact, reference, annotations={"dev.cuvil.trace-id": trace_id})

    async def scenario() -> None:
        config = SidecarConfig(model=reference, cache_dir=tmp_path / "cache", warmup_runs=1)
        manager = ModelManager(config, ModelSource(reference, config.cache_dir), Metrics())
        assert await manager.load()
        first = manager.current
        assert first is not None
        assert [f"{link.context.trace_id:032x}" for link in first.links] == [trace_id]
        poller = asyncio.create_task(manager.poll(0.1))
        push_artifact(mlp_artifact_v2, reference)
        deadline = time.monotonic() + 60
        while manager.current is first:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        assert manager.current is not None and manager.current.links == ()
        poller.cancel()
        await manager.close()

    asyncio.run(scenario())


def test_joined_batches_respect_the_models_batch_bound(mlp_artifact: Path) -> None:
    """CUVIL_MAX_BATCH_SIZE above the model's declared batch max (64) never builds a batch the
    model would refuse: 3 concurrent requests of 40 rows run as separate batches."""
    import torch

    async def scenario() -> None:
        config = SidecarConfig(
            model=str(mlp_artifact), max_batch_size=128, max_queue_delay_us=50_000, warmup_runs=0
        )
        manager = ModelManager(config, ModelSource(str(mlp_artifact)), Metrics())
        assert await manager.load()
        x = torch.randn(40, 784)

        async def request(rows: int) -> BatchResult:  # held in flight as the data plane holds it
            model = manager.acquire("mlp", "")
            try:
                return await model.batcher.submit({"x": x[:rows]}, rows=rows, key="same")
            finally:
                model.release()

        model = manager.acquire("mlp", "")
        assert model.batcher.max_rows == 64
        model.release()
        results = await asyncio.gather(*(request(40) for _ in range(3)))
        assert [r.batch_rows for r in results] == [40, 40, 40]
        assert all(r.outputs["output"].shape == (40, 10) for r in results)
        small = await asyncio.gather(*(request(8) for _ in range(4)))
        assert max(r.batch_requests for r in small) > 1
        await manager.close()

    asyncio.run(scenario())


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_a_load_leaves_no_openmp_threads_behind() -> None:
    """Loading runs on a thread that ends with it, taking its OpenMP pool along: a pool left
    beside the serving thread's makes libgomp stop spinning, and every model run slower."""
    import torch

    def parallel_work() -> float:
        x = torch.randn(512, 512)
        return float((x @ x).sum())  # a parallel region: this thread gets an OpenMP pool

    async def main() -> tuple[float, int]:
        before = _os_threads()
        result = await in_own_thread(parallel_work)
        deadline = time.monotonic() + 5
        while _os_threads() > before and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        left = _os_threads() - before
        with pytest.raises(ZeroDivisionError):
            await in_own_thread(lambda: 1 / 0)
        return result, left

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        result, left = asyncio.run(main())
    finally:
        torch.set_num_threads(threads)
    assert result != 0.0
    assert left <= 0, f"{left} threads outlived the load"
