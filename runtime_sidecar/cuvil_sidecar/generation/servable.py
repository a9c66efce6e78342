"""A generation model as the data plane serves it: its scheduler, its tokenizer, and each
request's stream of tokens on the event loop.

``GenerationServable.open`` reads a request against the model (text through the tokenizer,
parameters into ``SamplingParams``), submits it to the scheduler at once, so that a refusal
(the KV budget, a full queue, a bad prompt) is raised before any answer starts, and returns a
``GenerationStream``: the request's tokens as the engine thread picks them, with the text each
completes. Closing a stream that has not finished cancels its sequence, which frees its cache
slot at the scheduler's next step: every front end closes its stream when its client goes away.
Each stream records the generation metrics and its ``cuvil.generate`` span (time to first token,
tokens, why it ended).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from cuvil.generation.sampling import TokenLogprobs
from cuvil_sidecar import tracing
from cuvil_sidecar.config import SidecarConfig
from cuvil_sidecar.errors import InvalidInput, ShuttingDown, SidecarError
from cuvil_sidecar.generation.inbox import LoopInboxes
from cuvil_sidecar.generation.loader import GenerationModel
from cuvil_sidecar.generation.requests import GenerateRequest
from cuvil_sidecar.generation.scheduler import Scheduler
from cuvil_sidecar.generation.sequences import (
    FINISH_CANCELLED,
    FINISH_ERROR,
    FINISH_SHUTDOWN,
    FINISH_STOP,
    Sequence,
    TokenEvent,
)
from cuvil_sidecar.generation.text import Detokenizer, TextCodec
from cuvil_sidecar.messages import ModelMetadata, TensorMetadata
from cuvil_sidecar.metrics import Metrics

log = logging.getLogger("cuvil_sidecar.generation")

VERSION = "1"
RETIRE_POLL_S = 0.005
RETIRE_GRACE_S = 30.0  # how long a replaced or stopping model lets its streams run on
TEXT_INPUT, INPUT_IDS = "text_input", "input_ids"
TEXT_OUTPUT, OUTPUT_IDS = "text_output", "output_ids"


@dataclass(frozen=True)
class GeneratedToken:
    token: int | None
    index: int
    text: str  # what this token completes of the text ("" without a tokenizer)
    finish: str | None  # set on the last one: stop, length, cancelled, error, shutdown
    error: str = ""
    logprobs: TokenLogprobs | None = None  # where the request asked for them


class GenerationServable:
    is_generation = True

    def __init__(self, model: GenerationModel, config: SidecarConfig, metrics: Metrics) -> None:
        self.model = model
        self.name = config.model_name or model.name
        self.version = VERSION
        self.digest = model.digest
        self.index_digest: str | None = None
        self.source_digest = model.source_digest
        self.versions: tuple[str, ...] = (self.version, self.digest)
        self.links = tracing.compile_links(model.config)
        self.text = model.text
        self.scheduler = Scheduler(
            model.engine,
            kv_budget_bytes=config.kv_cache_bytes,
            max_waiting=config.generation_max_waiting,
            prefill_chunk=config.prefill_chunk,
            threads=model.threads.threads if model.threads else 0,
            prefill_alongside=bool(
                config.prefill_alongside and model.threads and model.threads.room_for_two
            ),
            reuse_prefixes=config.reuse_prefixes,
            name=self.name,
        )
        self.metrics = metrics
        self.stream_interval = config.stream_interval  # tokens per write of a REST stream
        self.inboxes = LoopInboxes()  # token events to the streams, per event loop
        self.in_flight = 0
        self._in_flight_lock = threading.Lock()

    def register_gauges(self) -> None:
        usage = self.scheduler.usage
        for name, read in (
            ("cuvil_kv_cache_usage", lambda: usage().fraction),
            ("cuvil_generation_running", lambda: float(usage().running)),
            ("cuvil_generation_waiting", lambda: float(usage().waiting)),
        ):
            self.metrics.gauge(name, self.name, self.version, read)

    @property
    def mode(self) -> str:
        engine = self.model.engine
        threads = self.model.threads
        return (
            f"continuous batching: {engine.max_batch} slots of {engine.max_seq} positions, "
            f"KV budget {self.scheduler.budget_positions} positions"
            + (f", engine threads {threads.threads}" if threads else "")
            + (", prefill alongside" if self.scheduler.prefill_alongside else "")
        )

    def metadata(self) -> ModelMetadata:
        inputs = [TensorMetadata(INPUT_IDS, "INT64", (-1,))]
        outputs = [TensorMetadata(OUTPUT_IDS, "INT64", (-1,))]
        if self.text is not None:
            inputs.insert(0, TensorMetadata(TEXT_INPUT, "BYTES", (1,)))
            outputs.insert(0, TensorMetadata(TEXT_OUTPUT, "BYTES", (-1,)))
        return ModelMetadata(
            name=self.name,
            versions=self.versions,
            platform=f"cuvil_{self.model.config.get('target', 'cpu')}",
            inputs=tuple(inputs),
            outputs=tuple(outputs),
        )

    def prompt_of(self, request: GenerateRequest) -> tuple[int, ...]:
        if request.prompt is not None:
            return request.prompt
        if self.text is None:
            raise InvalidInput(
                f"model {self.name!r} has no tokenizer: send {INPUT_IDS} (token ids), "
                f"not {TEXT_INPUT}"
            )
        return self.text.encode(request.text or "")

    def open(self, request: GenerateRequest) -> GenerationStream:
        """Submit the request (raising its refusal now) and return its stream."""
        if request.stop and self.text is None:
            raise InvalidInput(f"stop strings need a tokenizer; model {self.name!r} has none")
        prompt = self.prompt_of(request)
        return GenerationStream(self, request, prompt)

    def acquire(self) -> GenerationServable:
        with self._in_flight_lock:
            self.in_flight += 1
        return self

    def release(self) -> None:
        with self._in_flight_lock:
            self.in_flight -= 1

    async def retire(self, grace_s: float = RETIRE_GRACE_S) -> None:
        """Let running streams finish for up to ``grace_s``, then stop the scheduler: streams
        still running end with ``shutdown`` (their clients are told)."""
        deadline = time.monotonic() + grace_s
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(RETIRE_POLL_S)
        await asyncio.get_running_loop().run_in_executor(None, self.scheduler.close)
        log.info("retired %s %s", self.name, self.digest)


class GenerationStream:
    """One request's tokens, read with ``async for`` on the event loop, or handed as they are
    delivered to a function (``push``); ``close`` it. It holds the servable it was opened on
    (acquired by the caller) until it ends."""

    def __init__(
        self, servable: GenerationServable, request: GenerateRequest, prompt: tuple[int, ...]
    ) -> None:
        self._servable = servable
        self._request = request
        self.prompt = prompt
        self.tokens: list[int] = []
        self.text = ""
        self.finish: str | None = None
        self.scored: list[GeneratedToken] = []  # the tokens with log-probabilities, as received
        self._inbox = servable.inboxes.of(asyncio.get_running_loop())
        self._events: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self._push: Callable[[GeneratedToken], None] | None = None
        self._started_ns = time.perf_counter_ns()
        self._last_ns = 0
        self._detokenizer: Detokenizer | None = (
            servable.text.detokenizer() if servable.text is not None else None
        )
        self._span = tracing.start_generate_span(servable.name, servable.digest, servable.links)
        try:
            self._sequence: Sequence = servable.scheduler.submit(
                list(prompt),
                request.params,
                self._sink,
                request.client_gone,
                logprobs=request.logprobs,
            )
        except Exception as error:
            tracing.end_generate_span(self._span, error=str(error))
            raise

    @property
    def model_name(self) -> str:
        return self._servable.name

    @property
    def model_version(self) -> str:
        return self._servable.version

    @property
    def request_id(self) -> str:
        return self._request.id

    @property
    def reused_tokens(self) -> int:
        """Prompt tokens copied from a cache slot rather than prefilled (prefix reuse)."""
        return self._sequence.reused

    @property
    def stream_interval(self) -> int:
        """Tokens a streamed REST answer writes at once (``CUVIL_STREAM_INTERVAL``)."""
        return self._servable.stream_interval

    @property
    def codec(self) -> TextCodec | None:
        """The model's tokenizer (None: token ids in and out)."""
        return self._servable.text

    @property
    def with_text(self) -> bool:
        """Whether the model has a tokenizer (text out beside the token ids)."""
        return self._detokenizer is not None

    def _sink(self, event: TokenEvent) -> None:  # on the engine thread
        self._inbox.put(self._deliver, event)

    def push(self, on_token: Callable[[GeneratedToken], None]) -> None:
        """On the loop, instead of ``async for``: each token to ``on_token`` as the inbox
        delivers it (those delivered already first), with no task woken per token: what a
        stream that only writes each token out needs (rest_generate.py). A failure reading an
        event ends the stream with an error token."""
        self._push = on_token
        while not self._events.empty():
            self._deliver(self._events.get_nowait())

    def _deliver(self, event: TokenEvent) -> None:  # on the loop
        push = self._push
        if push is None:
            self._events.put_nowait(event)
            return
        if self.finish is not None:  # closed, or already ended: nothing more goes out
            return
        try:
            token = self._received(event)
        except Exception as error:
            log.exception("a generation stream failed to read its token")
            if self.finish is None:
                self._servable.scheduler.cancel(self._sequence)
                self._finished(FINISH_ERROR, f"the stream failed: {error}")
            token = GeneratedToken(None, event.index, "", FINISH_ERROR, str(error))
        push(token)

    async def last(self) -> GeneratedToken:
        """The stream's last token, once delivered: every token is taken as the inbox
        delivers it (``push``), with no task woken per token, for an answer made of the whole
        (``tokens``, ``text``, ``finish``). Cancelled, it leaves the stream to ``close``."""
        if self.finish is not None:  # closed, or already read to its end
            return GeneratedToken(None, len(self.tokens) - 1, "", self.finish)
        ended: asyncio.Future[GeneratedToken] = asyncio.get_running_loop().create_future()

        def take(token: GeneratedToken) -> None:
            if token.finish is not None and not ended.done():
                ended.set_result(token)

        self.push(take)
        return await ended

    def __aiter__(self) -> GenerationStream:
        return self

    async def __anext__(self) -> GeneratedToken:
        if self.finish is not None:
            raise StopAsyncIteration
        event = await self._events.get()
        return self._received(event)

    def _received(self, event: TokenEvent) -> GeneratedToken:
        servable = self._servable
        name, version = servable.name, servable.version
        finish = event.finish
        piece = ""
        if event.token is not None:
            self.tokens.append(event.token)
            gap = (event.at_ns - self._last_ns) / 1e9 if self._last_ns else None
            servable.metrics.token_generated(name, version, gap)
            if gap is None:
                first = (event.at_ns - self._started_ns) / 1e9
                servable.metrics.observe("cuvil_time_to_first_token_seconds", name, version, first)
                if self.reused_tokens:
                    reused = float(self.reused_tokens)
                    servable.metrics.add("cuvil_prefix_reused_tokens", name, version, reused)
                tracing.first_token(self._span, first)
            self._last_ns = event.at_ns
            if self._detokenizer is not None:
                piece = self._detokenizer.add(event.token)
                if finish is not None:
                    piece += self._detokenizer.flush()
                piece, stopped = self._cut_at_stop(piece)
                if stopped and finish is None:
                    finish = FINISH_STOP
                    servable.scheduler.cancel(self._sequence)  # its cancel event is not read
        if finish is not None:
            self._finished(finish, event.error)
        token = GeneratedToken(event.token, event.index, piece, finish, event.error, event.logprobs)
        if event.logprobs is not None:
            self.scored.append(token)
        return token

    def _cut_at_stop(self, piece: str) -> tuple[str, bool]:
        """The piece up to the first stop string the text now holds, and whether one did."""
        before = len(self.text)
        self.text += piece
        cuts = [at for at in (self.text.find(s) for s in self._request.stop) if at >= 0]
        if not cuts:
            return piece, False
        self.text = self.text[: min(cuts)]
        return self.text[before:], True

    def _finished(self, finish: str, error: str) -> None:
        """Once per stream: it ends, and lets go of the model it held (``acquire``)."""
        servable = self._servable
        self.finish = finish
        servable.release()
        if finish in (FINISH_STOP, "length"):
            servable.metrics.add("nv_inference_request_success", servable.name, servable.version)
        else:
            servable.metrics.add("nv_inference_request_failure", servable.name, servable.version)
        tracing.end_generate_span(
            self._span,
            prompt_tokens=len(self.prompt),
            tokens=len(self.tokens),
            finish=finish,
            error=error,
        )

    def close(self) -> None:
        """The client is done with the stream: a sequence still running is cancelled."""
        if self.finish is None:
            self._servable.scheduler.cancel(self._sequence)
            self._finished(FINISH_CANCELLED, "")


def ended_error(finish: str, error: str) -> SidecarError:
    """What ended a stream that did not finish (an engine failure, a shutdown), as an error."""
    if finish == FINISH_SHUTDOWN:
        return ShuttingDown("the sidecar is stopping; the generation ended early")
    return SidecarError(error or "the generation failed")
