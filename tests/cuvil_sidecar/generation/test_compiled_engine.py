"""A compiled generation artifact behind the sidecar's loader and scheduler: the loader hands
out the artifact's compiled engine, and streams that join, leave and prefill in chunks get the
tokens transformers' ``generate`` gives each prompt alone, in process and through a sidecar."""

from __future__ import annotations

import queue
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from cuvil_sidecar.config import SidecarConfig
from cuvil_sidecar.generation import loader
from cuvil_sidecar.generation.scheduler import Scheduler

import cuvil
from cuvil.generation.sampling import SamplingParams
from cuvil.runtime.generation import GenerationModel
from tests.cuvil.generation.families import VOCAB, build
from tests.cuvil_sidecar.conftest import Sidecar, ready_sidecar
from tests.cuvil_sidecar.generation.clients import EventStream
from tests.cuvil_sidecar.generation.test_scheduler import Collector


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    model = build("llama")
    example = {"input_ids": torch.randint(6, VOCAB, (1, 6))}
    compiled = cuvil.jit(model, example, task="text-generation", max_batch=4, max_seq=64)
    path = compiled.save(tmp_path_factory.mktemp("artifact") / "llama", directory=True)
    return model, path


def _prompt(index: int) -> list[int]:
    generator = torch.Generator().manual_seed(index)
    return torch.randint(6, VOCAB, (3 + (index * 7) % 17,), generator=generator).tolist()


def test_the_loader_serves_the_artifacts_compiled_engine(artifact: tuple) -> None:
    model, path = artifact
    config = loader.artifact_config(path)
    assert config["task"] == loader.TASK
    assert config["eos_token_id"] == [model.generation_config.eos_token_id]
    served = loader.ENGINE_FOR_ARTIFACT(path, config, SidecarConfig(str(path), prefill_chunk=5))
    engine = served.engine
    assert isinstance(engine, GenerationModel)
    assert (engine.max_batch, engine.max_seq) == (4, 64)
    assert served.threads is not None
    threads = served.threads.threads
    assert 1 <= threads <= torch.get_num_threads()
    assert {(rows, threads) for rows in (1, 2, 3, 4)} <= set(engine._decode_calls)  # warmed up

    requests = [(_prompt(i), SamplingParams(max_new_tokens=4 + 2 * i)) for i in range(7)]
    expected = [
        model.generate(
            torch.tensor([prompt]), max_new_tokens=params.max_new_tokens, do_sample=False,
            eos_token_id=None,
        )[0, len(prompt) :].tolist()
        for prompt, params in requests
    ]  # fmt: skip
    # 7 streams through 4 slots, chunked prompts: on the engine thread, then with the prompts
    # written on a prefill thread while the compiled decode steps run (two native calls at once)
    for alongside in (False, True):
        scheduler = Scheduler(engine, prefill_chunk=5, threads=threads, prefill_alongside=alongside)
        try:
            collectors = []
            for prompt, params in requests:
                collectors.append(Collector())
                scheduler.submit(prompt, params, collectors[-1])
            streamed = [collector.tokens() for collector in collectors]
        finally:
            scheduler.close()
        assert streamed == expected, f"prefill_alongside={alongside}"


def test_prompts_sharing_leading_tokens_start_from_the_compiled_cache(artifact: tuple) -> None:
    """A shared leading run and a conversation's next turn start from keys another slot
    holds (copied, or kept in place), and answer what transformers gives each prompt."""
    model, path = artifact
    config = loader.artifact_config(path)
    engine = loader.ENGINE_FOR_ARTIFACT(path, config, SidecarConfig(str(path))).engine

    def expected(prompt: list[int], new_tokens: int) -> list[int]:
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None
        )
        return list(out[0, len(prompt) :].tolist())

    shared = _prompt(11)[:12]
    first = [*shared, 7, 8, 9]
    scheduler = Scheduler(engine, prefill_chunk=5)
    try:
        collector = Collector()
        scheduler.submit(first, SamplingParams(max_new_tokens=6), collector)
        answer = collector.tokens()
        assert answer == expected(first, 6)
        requests = [[*first, *answer, 10, 11], [*shared, 12, 13, 14, 15], [*shared, 16]]
        collectors = [Collector() for _ in requests]
        for prompt, collector in zip(requests, collectors, strict=True):
            scheduler.submit(prompt, SamplingParams(max_new_tokens=5), collector)
        assert [c.tokens() for c in collectors] == [expected(p, 5) for p in requests]
        # the next turn: all the first sequence wrote; the other two: the shared run
        assert scheduler.usage().reused_tokens == len(first) + len(answer) - 1 + 2 * len(shared)
    finally:
        scheduler.close()


def test_a_sidecar_serves_the_artifact_with_prompts_written_beside_the_decode_steps(
    artifact: tuple, tmp_path: Path
) -> None:
    """Served end to end at one engine thread (the sidecar has two): prompts go through the
    prefill thread, and concurrent REST streams, then the same requests and more on one gRPC
    ModelStreamInfer stream of the native front end, get transformers' greedy tokens."""
    model, path = artifact
    name = str(loader.artifact_config(path).get("name") or path.stem)
    sidecar = Sidecar(
        path,
        tmp_path / "sidecar.log",
        CUVIL_GRPC_FRONTEND="native",
        CUVIL_GENERATION_THREADS="1",
        CUVIL_PREFILL_CHUNK="5",
    )
    requests = [(_prompt(i), 3 + i) for i in range(6)]
    streamed: list[list[int] | None] = [None] * len(requests)

    def run(index: int) -> None:
        prompt, tokens = requests[index]
        body = {"input_ids": prompt, "parameters": {"max_tokens": tokens}}
        stream = EventStream(sidecar, name, body)
        try:
            streamed[index] = [token for event in stream for token in event["output_ids"]]
        finally:
            stream.close()

    shared = [(_prompt(i), 20 + i) for i in range(12)]  # 12 requests through 4 slots
    with ready_sidecar(sidecar):
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        on_one_stream = one_stream(sidecar, name, shared)
    assert "engine threads 1, prefill alongside" in sidecar.log()
    for (prompt, tokens), got in zip(requests + shared, streamed + on_one_stream, strict=True):
        expected = model.generate(
            torch.tensor([prompt]), max_new_tokens=tokens, do_sample=False, eos_token_id=None
        )
        assert got == expected[0, len(prompt) :].tolist()


def one_stream(sidecar: Sidecar, model: str, requests: list[tuple[list[int], int]]) -> list:
    """Each request's tokens, all requests sent on one ModelStreamInfer stream."""
    client = grpcclient.InferenceServerClient(sidecar.url)
    answers: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    tokens: list[list[int]] = [[] for _ in requests]
    try:
        for index, (prompt, count) in enumerate(requests):
            ids = np.asarray(prompt, dtype=np.int64)
            item = grpcclient.InferInput("input_ids", list(ids.shape), "INT64")
            item.set_data_from_numpy(ids)
            parameters = {"max_tokens": count, "ignore_eos": True}
            client.async_stream_infer(model, [item], request_id=str(index), parameters=parameters)
        finished = 0
        while finished < len(requests):
            result, error = answers.get(timeout=60)
            assert error is None, error
            response = result.get_response()
            tokens[int(response.id)] += result.as_numpy("output_ids").tolist()
            finished += response.parameters["triton_final_response"].bool_param
    finally:
        client.stop_stream()
        client.close()
    return tokens
