"""Generation through real sidecar processes serving a tiny transformers checkpoint: the
generate extension over REST (JSON and server-sent events) and decoupled ModelStreamInfer
through NVIDIA's tritonclient.

- 16 staggered streams (different prompt lengths and token limits, HTTP and gRPC, one seeded
  sampling stream) through 4 cache slots get exactly the tokens each gets alone, and the
  greedy ones what transformers' ``generate`` gives; requests sharing one ModelStreamInfer
  stream are answered interleaved, each with its own tokens;
- a client that disconnects mid-stream frees its KV slot (``cuvil_generation_running``),
  over REST and over a gRPC stream, and one whose request still waits leaves the queue;
- a request larger than the KV budget is refused at once (413 / RESOURCE_EXHAUSTED), one that
  finds the cache and the queue full is refused 429 / RESOURCE_EXHAUSTED;
- malformed generate requests get clean 4xx answers; a request has a ``cuvil.generate`` span.

Each sidecar runs once on each gRPC front end: gRPC C++ (``native``) and grpcio.
"""

from __future__ import annotations

import http.client
import itertools
import json
import queue
import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient

from cuvil.otlp_receiver import OtlpReceiver
from tests.cuvil_sidecar.conftest import Sidecar, ready_sidecar
from tests.cuvil_sidecar.generation.checkpoints import VOCAB, tiny_llama_checkpoint
from tests.cuvil_sidecar.generation.clients import (
    WAIT_S,
    EventStream,
    grpc_answers,
    grpc_stream,
    http_stream,
    metric,
    post,
)

KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # layers, keys and values, kv heads, head dim, fp32
LONG = 4000  # tokens a stream asks for when it must still run while the test looks


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", tokenizer=True)


@pytest.fixture(scope="module")
def ids_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-ids", tokenizer=False)


FRONT_ENDS = ["native", "grpcio"]


def serving(checkpoint: Path, folder: Path, frontend: str, **settings: str) -> Iterator[Sidecar]:
    """A ready sidecar serving ``checkpoint`` on the gRPC front end ``frontend``."""
    sidecar = Sidecar(checkpoint, folder / "sidecar.log", CUVIL_GRPC_FRONTEND=frontend, **settings)
    with ready_sidecar(sidecar):
        yield sidecar


@pytest.fixture(scope="module", params=FRONT_ENDS)
def batching(
    request: pytest.FixtureRequest,
    checkpoint: Path,
    tmp_path_factory: pytest.TempPathFactory,
    otlp_receiver: OtlpReceiver,
) -> Iterator[Sidecar]:
    """Four slots, prompts in chunks of 8; once on each gRPC front end, the grpcio one with
    REST streams writing three tokens' events at a time."""
    yield from serving(
        checkpoint, tmp_path_factory.mktemp("gen"), request.param,
        CUVIL_GENERATION_SLOTS="4",
        CUVIL_PREFILL_CHUNK="8",
        CUVIL_STREAM_INTERVAL="3" if request.param == "grpcio" else "1",
        OTEL_EXPORTER_OTLP_ENDPOINT=otlp_receiver.endpoint,
        OTEL_EXPORTER_OTLP_INSECURE="true",
        OTEL_BSP_SCHEDULE_DELAY="100",
    )  # fmt: skip


@pytest.fixture(scope="module", params=FRONT_ENDS)
def one_slot(
    request: pytest.FixtureRequest, ids_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Sidecar]:
    """One slot of 4096 positions, a budget of 4050, no waiting room; no tokenizer; once on
    each gRPC front end."""
    yield from serving(
        ids_checkpoint, tmp_path_factory.mktemp("gen-budget"), request.param,
        CUVIL_GENERATION_SLOTS="1",
        CUVIL_GENERATION_MAX_SEQ="4096",
        CUVIL_KV_CACHE_BYTES=str(4050 * KV_BYTES_PER_TOKEN),
        CUVIL_GENERATION_MAX_WAITING="0",
    )  # fmt: skip


@pytest.fixture(scope="module", params=FRONT_ENDS)
def queue_of_one(
    request: pytest.FixtureRequest, ids_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Sidecar]:
    """One slot of 16384 positions and room for one request to wait; once on each gRPC front
    end."""
    yield from serving(
        ids_checkpoint, tmp_path_factory.mktemp("gen-queue"), request.param,
        CUVIL_GENERATION_SLOTS="1",
        CUVIL_GENERATION_MAX_SEQ="16384",
        CUVIL_GENERATION_MAX_WAITING="1",
    )  # fmt: skip


def staggered_requests() -> list[dict[str, Any]]:
    generator = torch.Generator().manual_seed(5)
    requests = []
    for i in range(16):
        length = 2 + (i * 7) % 37  # 2 .. 38 tokens: several prompts take chunks of 8
        prompt = torch.randint(3, VOCAB, (length,), generator=generator).tolist()
        parameters: dict[str, Any] = {"max_tokens": 4 + (i * 5) % 21}
        if i == 5:
            parameters |= {"temperature": 0.8, "top_k": 20, "seed": 11}
        if i in (8, 9):  # greedy with transformers' repetition penalty
            parameters |= {"repetition_penalty": 1.4 if i == 8 else 0.7}
        requests.append({"input_ids": prompt, "parameters": parameters})
    return requests


def test_sixteen_staggered_streams_get_the_tokens_they_get_alone(
    batching: Sidecar, checkpoint: Path
) -> None:
    requests = staggered_requests()
    together: list[list[int] | None] = [None] * 16
    started = [threading.Event() for _ in requests]
    failures: list[BaseException] = []

    def run(i: int) -> None:
        try:
            if i:  # joins once the stream before it has its first token: mid-batch
                assert started[i - 1].wait(WAIT_S)
            transport = grpc_stream if i % 2 else http_stream
            together[i] = transport(batching, requests[i], started[i].set)
        except BaseException as failure:  # reported below, from the test's thread
            started[i].set()
            failures.append(failure)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S * 2)
    assert not failures, failures
    alone = []
    for request in requests:
        status, answer = post(batching, "/v2/models/tiny/generate", request)
        assert status == 200, answer
        alone.append(answer["output_ids"])
    assert together == alone

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, local_files_only=True).eval()
    for i, request in enumerate(requests):
        if i == 5:
            continue  # the sampled stream: compared with its lone run above
        prompt = torch.tensor([request["input_ids"]])
        reference = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=request["parameters"]["max_tokens"],
            repetition_penalty=request["parameters"].get("repetition_penalty", 1.0),
            do_sample=False,
            pad_token_id=0,
        )[0, prompt.shape[1] :].tolist()
        assert alone[i] == reference, i
    assert metric(batching, "cuvil_generation_running") == 0


def test_requests_sharing_one_grpc_stream_get_their_own_tokens(batching: Sidecar) -> None:
    """Triton's decoupled mode with several requests on one ModelStreamInfer stream: their
    answers come interleaved, each with its request's id, and each request gets the tokens it
    gets alone."""
    requests = staggered_requests()
    client = grpcclient.InferenceServerClient(batching.url)
    results: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(requests))}
    answering: list[str] = []
    try:
        for i, request in enumerate(requests):
            ids = np.asarray(request["input_ids"], dtype=np.int64)
            item = grpcclient.InferInput("input_ids", list(ids.shape), "INT64")
            item.set_data_from_numpy(ids)
            client.async_stream_infer(
                "tiny", [item], request_id=str(i), parameters=request["parameters"]
            )
        finished = 0
        while finished < len(requests):
            result, error = results.get(timeout=WAIT_S)
            assert error is None, error
            response = result.get_response()
            tokens[response.id] += result.as_numpy("output_ids").tolist()
            answering.append(response.id)
            finished += response.parameters["triton_final_response"].bool_param
    finally:
        client.stop_stream()
        client.close()
    for i, request in enumerate(requests):
        status, answer = post(batching, "/v2/models/tiny/generate", request)
        assert status == 200, answer
        assert tokens[str(i)] == answer["output_ids"], i
    # interleaved (batched together), not one request's answers after another's
    changes = sum(a != b for a, b in itertools.pairwise(answering))
    assert len(set(answering)) == len(requests) and changes > len(requests), answering


def test_text_in_and_out_with_the_tokenizer(batching: Sidecar) -> None:
    body = {"text_input": "the quick fox", "parameters": {"max_tokens": 6, "ignore_eos": True}}
    status, answer = post(batching, "/v2/models/tiny/generate", body)
    assert status == 200, answer
    assert len(answer["output_ids"]) == 6 and answer["finish_reason"] == "length"
    from tests.cuvil_sidecar.generation.checkpoints import train_tokenizer

    tokenizer: Any = train_tokenizer()
    assert answer["text_output"] == tokenizer.decode(answer["output_ids"])
    events = list(EventStream(batching, "tiny", body))
    assert [e["output_ids"][0] for e in events] == answer["output_ids"]
    assert "".join(e["text_output"] for e in events) == answer["text_output"]
    text = answer["text_output"]
    stop = next(text[i : i + 2] for i in range(1, len(text) - 1) if text[i : i + 2].strip())
    body["parameters"] |= {"stop": [stop]}
    status, stopped = post(batching, "/v2/models/tiny/generate", body)
    assert status == 200, stopped
    assert stopped["text_output"] == text[: text.index(stop)]
    assert stopped["finish_reason"] == "stop"
    assert stopped["output_ids"] == answer["output_ids"][: len(stopped["output_ids"])]


def tensor(name: str, values: Any, datatype: str) -> Any:
    kinds = {"BYTES": object, "INT32": np.int32, "BOOL": np.bool_, "FP32": np.float32}
    array = np.asarray(values, dtype=kinds[datatype])
    item = grpcclient.InferInput(name, list(array.shape), datatype)
    item.set_data_from_numpy(array)
    return item


def test_grpc_generation_takes_triton_vllm_and_trt_llm_request_forms(batching: Sidecar) -> None:
    """Text in through ``text_input``; the generate parameters as request parameters, as a
    ``sampling_parameters`` JSON input (vLLM's backend) or as one-element tensors (TensorRT-LLM's);
    ``stream`` false answers once with every token; ``triton_enable_empty_final_response`` ends
    with an empty final answer. Each gives the tokens and text REST's generate gives."""
    body = {"text_input": "the quick fox", "parameters": {"max_tokens": 5, "ignore_eos": True}}
    status, reference = post(batching, "/v2/models/tiny/generate", body)
    assert status == 200, reference
    text = tensor("text_input", ["the quick fox"], "BYTES")

    def ids_and_text(answers: list[Any]) -> tuple[list[int], str]:
        ids, pieces = [], []
        for answer in answers:
            got, texts = answer.as_numpy("output_ids"), answer.as_numpy("text_output")
            ids += [] if got is None else got.tolist()
            pieces += [] if texts is None else [piece.decode() for piece in texts]
        return ids, "".join(pieces)

    expected = (reference["output_ids"], reference["text_output"])
    as_parameters = grpc_answers(batching, [text], body["parameters"])
    assert len(as_parameters) == 5 and ids_and_text(as_parameters) == expected
    vllm = tensor("sampling_parameters", [json.dumps(body["parameters"])], "BYTES")
    assert ids_and_text(grpc_answers(batching, [text, vllm])) == expected
    trt_llm = [tensor("max_tokens", [5], "INT32"), tensor("ignore_eos", [True], "BOOL")]
    assert ids_and_text(grpc_answers(batching, [text, *trt_llm])) == expected
    whole = grpc_answers(batching, [text, vllm, tensor("stream", [False], "BOOL")])
    assert len(whole) == 1 and ids_and_text(whole) == expected
    last = whole[0].get_response().parameters["finish_reason"].string_param
    assert last == reference["finish_reason"] == "length"
    with_empty = grpc_answers(batching, [text, vllm], empty_final=True)
    assert len(with_empty) == 6 and ids_and_text(with_empty) == expected
    assert with_empty[-1].as_numpy("output_ids") is None
    assert not any(
        a.get_response().parameters["triton_final_response"].bool_param for a in with_empty[:-1]
    )
    penalized = {"max_tokens": 12, "ignore_eos": True, "repetition_penalty": 1.5}
    status, reference = post(batching, "/v2/models/tiny/generate", body | {"parameters": penalized})
    assert status == 200, reference
    trt_llm = [tensor("max_tokens", [12], "INT32"), tensor("ignore_eos", [True], "BOOL")]
    trt_llm.append(tensor("repetition_penalty", [1.5], "FP32"))
    penalized_answers = grpc_answers(batching, [text, *trt_llm])
    assert ids_and_text(penalized_answers) == (reference["output_ids"], reference["text_output"])
    with pytest.raises(AssertionError, match=r"INVALID_ARGUMENT.*stream must be a BOOL"):
        grpc_answers(batching, [text, tensor("stream", [1], "INT32")])


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        (b"{not json", 400, "does not parse"),
        ([1, 2], 400, "JSON object"),
        ({"parameters": {}}, 400, "one of text_input"),
        ({"text_input": "a", "input_ids": [1]}, 400, "one of text_input"),
        ({"input_ids": ["a"]}, 400, "token ids"),
        ({"input_ids": [1, VOCAB]}, 400, "0..319"),
        ({"input_ids": []}, 400, "no tokens"),
        ({"input_ids": [1], "parameters": {"max_token": 3}}, 400, "unknown generate param"),
        ({"input_ids": [1], "parameters": {"max_tokens": "ten"}}, 400, "integer"),
        ({"input_ids": [1], "parameters": {"max_tokens": 0}}, 400, "at least 1"),
        ({"input_ids": [1], "parameters": {"temperature": -1}}, 400, "temperature"),
        ({"input_ids": [1], "parameters": {"top_p": 2}}, 400, "top_p"),
        ({"input_ids": [1], "parameters": {"repetition_penalty": 0}}, 400, "must be positive"),
        ({"input_ids": [1], "parameters": {"temperature": float("nan")}}, 400, "finite number"),
        ({"input_ids": [1], "parameters": {"seed": 2**70}}, 400, "64-bit integer"),
        ({"input_ids": [1], "parameters": {"frequency_penalty": "x"}}, 400, "must be a number"),
        ({"input_ids": [1], "max_tokens": 2, "parameters": {"max_tokens": 2}}, 400, "both"),
        ({"input_ids": [1] * 300}, 400, "at most 255"),
    ],
)
def test_malformed_generate_requests_get_clean_4xx(
    batching: Sidecar, body: Any, status: int, says: str
) -> None:
    for route in ("generate", "generate_stream"):
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        got, answer = post(batching, f"/v2/models/tiny/{route}", raw)
        assert (got, says in answer["error"]) == (status, True), answer
    assert post(batching, "/v2/models/nope/generate", {"input_ids": [1]})[0] == 404


def test_tensor_calls_on_a_generation_model_say_what_to_use(batching: Sidecar) -> None:
    client = grpcclient.InferenceServerClient(batching.url)
    item = grpcclient.InferInput("input_ids", [2], "INT64")
    item.set_data_from_numpy(np.array([1, 2], dtype=np.int64))
    with pytest.raises(Exception, match="ModelStreamInfer"):
        client.infer("tiny", [item])
    results: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put(error))
    unknown = grpcclient.InferInput("prompt", [1], "INT64")
    unknown.set_data_from_numpy(np.array([1], dtype=np.int64))
    client.async_stream_infer("tiny", [unknown])
    error = results.get(timeout=WAIT_S)
    client.stop_stream()
    client.close()
    assert "INVALID_ARGUMENT" in str(error) and "unknown input" in str(error)


def test_a_generation_has_a_span_with_time_to_first_token(
    batching: Sidecar, otlp_receiver: OtlpReceiver
) -> None:
    trace_id = secrets.token_hex(16)
    headers = {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}
    body = {"input_ids": [4, 5, 6], "parameters": {"max_tokens": 3, "ignore_eos": True}}
    assert post(batching, "/v2/models/tiny/generate", body, headers)[0] == 200
    otlp_receiver.wait_for(
        lambda spans: any(s.name == "cuvil.generate" and s.trace_id == trace_id for s in spans)
    )
    spans = {span.name: span for span in otlp_receiver.in_trace(trace_id)}
    generate, server = spans["cuvil.generate"], spans["POST /v2/models/{model}/generate"]
    assert generate.parent_span_id == server.span_id
    assert generate.attributes["cuvil.generate.tokens"] == 3
    assert generate.attributes["cuvil.generate.prompt_tokens"] == 3
    assert generate.attributes["cuvil.generate.finish_reason"] == "length"
    assert 0 < float(generate.attributes["cuvil.generate.time_to_first_token_ms"]) <= generate.ms  # type: ignore[arg-type]


def test_over_budget_requests_are_refused_at_once(one_slot: Sidecar) -> None:
    body = {"input_ids": list(range(3, 103)), "parameters": {"max_tokens": LONG}}
    status, answer = post(one_slot, "/v2/models/tiny-ids/generate", body)
    assert status == 413 and "can never run" in answer["error"], answer
    with pytest.raises(Exception, match=r"RESOURCE_EXHAUSTED.*can never run"):
        grpc_stream(one_slot, body, model="tiny-ids")
    status, answer = post(one_slot, "/v2/models/tiny-ids/generate", {"text_input": "hi"})
    assert status == 400 and "no tokenizer" in answer["error"]


def test_a_disconnected_client_frees_its_slot_and_a_full_cache_refuses(
    one_slot: Sidecar,
) -> None:
    before = metric(one_slot, "cuvil_generation_tokens")
    long = {"input_ids": [7, 8, 9], "parameters": {"max_tokens": LONG, "ignore_eos": True}}
    stream = EventStream(one_slot, "tiny-ids", long)
    first = next(iter(stream))
    assert "text_output" not in first and len(first["output_ids"]) == 1
    assert metric(one_slot, "cuvil_generation_running") == 1
    short = {"input_ids": [7, 8, 9], "parameters": {"max_tokens": 3}}
    status, answer = post(one_slot, "/v2/models/tiny-ids/generate", short)
    assert status == 429 and "try again later" in answer["error"], answer
    with pytest.raises(Exception, match="RESOURCE_EXHAUSTED"):
        grpc_stream(one_slot, short, model="tiny-ids")
    stream.close()  # the client goes away mid-stream
    deadline = time.monotonic() + WAIT_S
    while metric(one_slot, "cuvil_generation_running") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(one_slot, "cuvil_generation_running") == 0
    assert metric(one_slot, "cuvil_kv_cache_usage") == 0
    assert metric(one_slot, "cuvil_generation_tokens") - before < LONG
    status, answer = post(one_slot, "/v2/models/tiny-ids/generate", short)
    assert status == 200 and "text_output" not in answer and len(answer["output_ids"]) <= 3


def test_a_client_gone_before_its_whole_answer_frees_its_slot(one_slot: Sidecar) -> None:
    """A non-streaming generate whose client hangs up while its tokens are generated: the
    generation is cancelled (far fewer tokens than asked), its slot freed, the next one runs."""
    before = metric(one_slot, "cuvil_generation_tokens")
    host, port = one_slot.http_url.split(":")
    long = {"input_ids": [7, 8, 9], "parameters": {"max_tokens": LONG, "ignore_eos": True}}
    connection = http.client.HTTPConnection(host, int(port), timeout=WAIT_S)
    connection.request("POST", "/v2/models/tiny-ids/generate", json.dumps(long))
    deadline = time.monotonic() + WAIT_S
    while not metric(one_slot, "cuvil_generation_running") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert metric(one_slot, "cuvil_generation_running") == 1
    connection.close()  # the client goes away before the answer
    while metric(one_slot, "cuvil_generation_running") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(one_slot, "cuvil_generation_running") == 0
    assert metric(one_slot, "cuvil_kv_cache_usage") == 0
    assert metric(one_slot, "cuvil_generation_tokens") - before < LONG
    short = {"input_ids": [7, 8, 9], "parameters": {"max_tokens": 3}}
    status, answer = post(one_slot, "/v2/models/tiny-ids/generate", short)
    assert status == 200 and len(answer["output_ids"]) <= 3, answer


def test_a_cancelled_grpc_stream_frees_its_slot(one_slot: Sidecar) -> None:
    client = grpcclient.InferenceServerClient(one_slot.url)
    results: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    item = grpcclient.InferInput("input_ids", [3], "INT64")
    item.set_data_from_numpy(np.array([7, 8, 9], dtype=np.int64))
    client.async_stream_infer(
        "tiny-ids", [item], parameters={"max_tokens": LONG, "ignore_eos": True}
    )
    result, error = results.get(timeout=WAIT_S)
    assert error is None and len(result.as_numpy("output_ids")) == 1
    assert metric(one_slot, "cuvil_generation_running") == 1
    client.stop_stream(cancel_requests=True)  # the client goes away mid-stream
    client.close()
    deadline = time.monotonic() + WAIT_S
    while metric(one_slot, "cuvil_generation_running") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(one_slot, "cuvil_generation_running") == 0
    status, answer = post(one_slot, "/v2/models/tiny-ids/generate", {"input_ids": [1]})
    assert status == 200, answer


def test_a_queued_grpc_request_whose_client_went_leaves_the_queue(queue_of_one: Sidecar) -> None:
    """A ModelStreamInfer request waiting for the only slot, cancelled by its client, leaves
    the queue while the stream holding the slot runs on: it never runs, nor holds a place in
    line (the native front end asks the call; grpcio cancels the stream's task)."""
    endless = {"input_ids": [7, 8, 9], "parameters": {"max_tokens": 16000, "ignore_eos": True}}
    holder = EventStream(queue_of_one, "tiny-ids", endless)
    events = iter(holder)
    assert next(events)["finish_reason"] is None
    client = grpcclient.InferenceServerClient(queue_of_one.url)
    client.start_stream(callback=lambda result, error: None)
    item = grpcclient.InferInput("input_ids", [3], "INT64")
    item.set_data_from_numpy(np.array([4, 5, 6], dtype=np.int64))
    client.async_stream_infer("tiny-ids", [item], parameters={"max_tokens": 3})
    deadline = time.monotonic() + WAIT_S
    while not metric(queue_of_one, "cuvil_generation_waiting") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert metric(queue_of_one, "cuvil_generation_waiting") == 1
    client.stop_stream(cancel_requests=True)  # the client goes away while its request waits
    client.close()
    deadline = time.monotonic() + 5.0  # the endless stream needs far longer than this
    while metric(queue_of_one, "cuvil_generation_waiting") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert metric(queue_of_one, "cuvil_generation_waiting") == 0
    assert metric(queue_of_one, "cuvil_generation_running") == 1  # the endless stream, still
    holder.close()
    deadline = time.monotonic() + WAIT_S
    while metric(queue_of_one, "cuvil_generation_running") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(queue_of_one, "cuvil_generation_running") == 0
