"""The continuous-batching scheduler on its own: streams that join and leave at any step get
exactly the tokens they get alone, long prompts are prefilled in chunks between decode steps,
KV memory is admitted against the budget (wait, or refuse at once), cancellation frees a slot.

``HistoryEngine`` is a DecoderEngine whose next token is a function of everything written to
the slot, so a scheduler that mixed up slots, positions or chunk order would change tokens. The
last test runs the real ``EagerDecoderEngine`` on a tiny Llama.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence as Seq

import pytest
import torch
from cuvil_sidecar.errors import GenerationQueueFull, InvalidInput, KvBudgetExceeded
from cuvil_sidecar.generation.scheduler import Scheduler
from cuvil_sidecar.generation.sequences import (
    FINISH_CANCELLED,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    TokenEvent,
)

from cuvil.generation.sampling import SamplingParams

VOCAB = 97
WAIT_S = 60.0


class HistoryEngine:
    """Logits one-hot at a hash of the slot's history; records every call."""

    def __init__(self, max_batch: int, max_seq: int, gate: threading.Event | None = None) -> None:
        self.max_batch, self.max_seq, self.vocab_size = max_batch, max_seq, VOCAB
        self.kv_bytes_per_token = 100
        self.history: list[list[int]] = [[] for _ in range(max_batch)]
        self.calls: list[tuple[str, tuple[int, ...], int]] = []  # kind, slots, tokens
        self.gate = gate or threading.Event()
        if gate is None:
            self.gate.set()
        self.entered = threading.Event()
        self.fail_on: int | None = None  # a token id whose decode raises
        self.nan_on: int | None = None  # a token id whose slot's logits are NaN from then on
        self.pause_at: int | None = None  # a decode step (counted from 1) that waits for…
        self.resume = threading.Event()  # …this, after setting ``paused``
        self.paused = threading.Event()
        self.decodes = 0

    def _logits(self, slot: int) -> torch.Tensor:
        history = self.history[slot]
        logits = torch.zeros(VOCAB)
        logits[(sum(t * (i + 3) for i, t in enumerate(history)) + 7) % VOCAB] = 1.0
        return logits.fill_(float("nan")) if self.nan_on in history else logits

    def prefill(
        self, slot: int, token_ids: torch.Tensor, position: int, kind: str = "prefill"
    ) -> torch.Tensor:
        self.entered.set()
        self.gate.wait(WAIT_S)
        assert position == len(self.history[slot]), "a chunk must start where the slot ends"
        self.history[slot] += token_ids.tolist()
        assert len(self.history[slot]) <= self.max_seq
        self.calls.append((kind, (slot,), token_ids.numel()))  # one append: threads share it
        return self._logits(slot)

    def extend(self, slot: int, token_ids: torch.Tensor, position: int) -> None:
        self.prefill(slot, token_ids, position, "extend")

    def decode(
        self, slots: Seq[int], token_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        self.entered.set()
        self.gate.wait(WAIT_S)
        self.decodes += 1
        if self.decodes == self.pause_at:
            self.paused.set()
            self.resume.wait(WAIT_S)
        if self.fail_on is not None and self.fail_on in token_ids.tolist():
            raise RuntimeError("decode failed")
        rows = []
        for slot, token, position in zip(
            slots, token_ids.tolist(), positions.tolist(), strict=True
        ):
            assert position == len(self.history[slot])
            self.history[slot].append(token)
            assert len(self.history[slot]) <= self.max_seq
            rows.append(self._logits(slot))
        self.calls.append(("decode", tuple(slots), len(slots)))
        return torch.stack(rows)

    def release(self, slot: int) -> None:
        self.history[slot] = []


class PackingEngine(HistoryEngine):
    """A HistoryEngine that also writes several prompts' chunks in one ``extend_many`` call,
    as a compiled model does; ``fail_packs`` makes that call raise."""

    fail_packs = False

    def extend_many(self, chunks: list[tuple[int, torch.Tensor, int]]) -> None:
        if self.fail_packs:
            raise RuntimeError("packed prefill failed")
        self.entered.set()
        self.gate.wait(WAIT_S)
        for slot, token_ids, position in chunks:
            assert position == len(self.history[slot]), "a chunk must start where the slot ends"
            self.history[slot] += token_ids.tolist()
            assert len(self.history[slot]) <= self.max_seq
        slots = tuple(slot for slot, _, _ in chunks)
        self.calls.append(("extend_many", slots, sum(int(c[1].numel()) for c in chunks)))


class Collector:
    def __init__(self) -> None:
        self.events: list[TokenEvent] = []
        self.done = threading.Event()

    def __call__(self, event: TokenEvent) -> None:
        self.events.append(event)
        if event.finish is not None:
            self.done.set()

    def tokens(self) -> list[int]:
        assert self.done.wait(WAIT_S), "the sequence never finished"
        return [e.token for e in self.events if e.token is not None]

    @property
    def finish(self) -> str | None:
        assert self.done.wait(WAIT_S)
        return self.events[-1].finish


def alone(prompt: list[int], params: SamplingParams, max_seq: int = 64) -> list[int]:
    scheduler = Scheduler(HistoryEngine(1, max_seq))
    try:
        collector = Collector()
        scheduler.submit(prompt, params, collector)
        return collector.tokens()
    finally:
        scheduler.close()


def prompt_of(i: int) -> list[int]:
    return [(i * 13 + k) % VOCAB for k in range(3 + (i * 5) % 23)]


@pytest.mark.parametrize("alongside", [False, True], ids=["one_thread", "prefill_alongside"])
def test_staggered_streams_get_the_tokens_they_get_alone(alongside: bool) -> None:
    engine = HistoryEngine(max_batch=4, max_seq=64)
    scheduler = Scheduler(engine, prefill_chunk=8, prefill_alongside=alongside)
    try:
        collectors, requests = [], []
        for i in range(16):
            params = SamplingParams(max_new_tokens=4 + (i * 7) % 17)
            collector = Collector()
            scheduler.submit(prompt_of(i), params, collector)
            collectors.append(collector)
            requests.append((prompt_of(i), params))
            if i % 3 == 0:  # some arrive while others run
                collectors[max(0, i - 2)].done.wait(WAIT_S)
        results = [c.tokens() for c in collectors]
    finally:
        scheduler.close()
    assert results == [alone(prompt, params) for prompt, params in requests]
    assert max(len(slots) for kind, slots, _ in engine.calls if kind == "decode") > 1
    assert all(c.finish == FINISH_LENGTH for c in collectors)


def test_long_prompt_is_prefilled_in_chunks_between_decode_steps() -> None:
    engine = HistoryEngine(max_batch=2, max_seq=4096)
    scheduler = Scheduler(engine, prefill_chunk=8)
    try:
        running = Collector()
        endless = scheduler.submit([1, 2, 3], SamplingParams(max_new_tokens=4000), running)
        while len(running.events) < 2:  # the first stream decodes
            threading.Event().wait(0.001)
        long = Collector()
        scheduler.submit(list(range(60)), SamplingParams(max_new_tokens=2), long)
        long.tokens()
        scheduler.cancel(endless)
        assert running.finish == FINISH_CANCELLED
    finally:
        scheduler.close()
    chunks = [i for i, (kind, _, _) in enumerate(engine.calls) if kind == "extend" and i > 0]
    # 59 tokens in chunks of 8; the 60th goes in with a decode step
    assert [engine.calls[i][2] for i in chunks] == [8] * 7 + [3]
    between = engine.calls[chunks[0] : chunks[-1]]
    assert sum(kind == "decode" for kind, _, _ in between) >= len(chunks) - 1


def test_a_burst_of_short_prompts_shares_each_iterations_prefill_budget() -> None:
    engine = HistoryEngine(max_batch=8, max_seq=4096)
    scheduler = Scheduler(engine, prefill_chunk=16)
    short = [[(i * 11 + k) % VOCAB for k in range(5)] for i in range(6)]
    try:
        running = Collector()
        endless = scheduler.submit([1, 2, 3], SamplingParams(max_new_tokens=4000), running)
        while len(running.events) < 2:  # the first stream decodes
            threading.Event().wait(0.001)
        engine.gate.clear()  # hold the engine while the burst arrives
        collectors = [Collector() for _ in short]
        for prompt, collector in zip(short, collectors, strict=True):
            scheduler.submit(prompt, SamplingParams(max_new_tokens=3), collector)
        engine.gate.set()
        results = [c.tokens() for c in collectors]
        scheduler.cancel(endless)
    finally:
        scheduler.close()
    assert results == [alone(prompt, SamplingParams(max_new_tokens=3)) for prompt in short]
    between: list[list[int]] = [[]]  # prefill sizes between two decode steps
    for kind, _, tokens in engine.calls[1:]:
        if kind == "decode":
            between.append([])
        else:
            between[-1].append(tokens)
    assert max(sum(gap) for gap in between) <= 16  # the budget holds across prompts
    # one iteration: four prompts' first four tokens (each one's fifth goes in with the decode
    # step after them), not one prompt an iteration
    assert [4, 4, 4, 4] in between, [gap for gap in between if gap]


def test_eos_and_max_seq_end_a_sequence() -> None:
    tokens = alone([5, 6], SamplingParams(max_new_tokens=30))
    eos = tokens[3]
    first_eos = tokens.index(eos)
    stopped = Collector()
    scheduler = Scheduler(HistoryEngine(1, 64))
    try:
        scheduler.submit([5, 6], SamplingParams(max_new_tokens=30, eos_token_id=(eos,)), stopped)
        assert stopped.tokens() == tokens[: first_eos + 1]
        assert stopped.finish == FINISH_STOP
        capped = Collector()
        scheduler.submit([5, 6], SamplingParams(max_new_tokens=500), capped)
        assert capped.tokens() == alone([5, 6], SamplingParams(max_new_tokens=62))
        assert capped.finish == FINISH_LENGTH
    finally:
        scheduler.close()


def test_requests_that_can_never_run_are_refused_at_once() -> None:
    engine = HistoryEngine(max_batch=2, max_seq=32)
    scheduler = Scheduler(engine, kv_budget_bytes=20 * engine.kv_bytes_per_token + 99)
    try:
        assert scheduler.budget_positions == 20
        with pytest.raises(InvalidInput, match="at most 31"):
            scheduler.submit(list(range(32)), SamplingParams(), Collector())
        with pytest.raises(InvalidInput, match=r"0\.\.96"):
            scheduler.submit([VOCAB], SamplingParams(), Collector())
        with pytest.raises(KvBudgetExceeded, match=r"needs 32 .*prompt 20 \+ 12 new"):
            scheduler.submit([1] * 20, SamplingParams(max_new_tokens=21), Collector())
        fits = Collector()
        scheduler.submit([1] * 10, SamplingParams(max_new_tokens=10), fits)
        assert len(fits.tokens()) == 10
    finally:
        scheduler.close()


def test_a_full_cache_queues_then_refuses() -> None:
    gate = threading.Event()
    engine = HistoryEngine(max_batch=1, max_seq=32, gate=gate)
    scheduler = Scheduler(engine, max_waiting=1)
    try:
        first, second = Collector(), Collector()
        scheduler.submit([1, 2], SamplingParams(max_new_tokens=3), first)
        assert engine.entered.wait(WAIT_S)  # it holds the only slot
        scheduler.submit([3, 4], SamplingParams(max_new_tokens=3), second)  # waits
        with pytest.raises(GenerationQueueFull, match="queue holds 1"):
            scheduler.submit([5], SamplingParams(), Collector())
        assert scheduler.usage().running == 1 and scheduler.usage().waiting == 1
        gate.set()
        assert first.tokens() and second.tokens() == alone([3, 4], SamplingParams(max_new_tokens=3))
        usage = scheduler.usage()
        assert (usage.running, usage.waiting, usage.reserved_positions) == (0, 0, 0)
    finally:
        gate.set()
        scheduler.close()


@pytest.mark.parametrize("alongside", [False, True], ids=["one_thread", "prefill_alongside"])
def test_cancelling_frees_the_slot_for_the_next_request(alongside: bool) -> None:
    gate = threading.Event()
    engine = HistoryEngine(max_batch=1, max_seq=32, gate=gate)
    scheduler = Scheduler(engine, prefill_alongside=alongside)
    try:
        endless, queued = Collector(), Collector()
        sequence = scheduler.submit([1], SamplingParams(max_new_tokens=30), endless)
        assert engine.entered.wait(WAIT_S)
        scheduler.submit([2, 3], SamplingParams(max_new_tokens=2), queued)
        scheduler.cancel(sequence)
        gate.set()
        assert endless.finish == FINISH_CANCELLED
        assert len(endless.tokens()) < 30
        assert queued.tokens() == alone([2, 3], SamplingParams(max_new_tokens=2))
        assert scheduler.usage().reserved_positions == 0
    finally:
        gate.set()
        scheduler.close()


@pytest.mark.parametrize("alongside", [False, True], ids=["one_thread", "prefill_alongside"])
def test_a_waiting_request_whose_client_went_is_dropped_unrun_when_its_turn_comes(
    alongside: bool,
) -> None:
    """A transport that cannot cancel (the native gRPC front end) gives a ``client_gone``
    check: the request whose client went while it waited never reaches the engine, and the
    one behind it takes the slot."""
    gate = threading.Event()
    engine = HistoryEngine(max_batch=1, max_seq=32, gate=gate)
    scheduler = Scheduler(engine, prefill_alongside=alongside)
    gone = threading.Event()
    try:
        first, abandoned, last = Collector(), Collector(), Collector()
        scheduler.submit([1], SamplingParams(max_new_tokens=3), first)
        assert engine.entered.wait(WAIT_S)  # it holds the only slot
        scheduler.submit([7, 8, 9], SamplingParams(max_new_tokens=3), abandoned, gone.is_set)
        scheduler.submit([2, 3], SamplingParams(max_new_tokens=2), last)
        gone.set()
        gate.set()
        assert abandoned.finish == FINISH_CANCELLED and abandoned.tokens() == []
        assert last.tokens() == alone([2, 3], SamplingParams(max_new_tokens=2))
        # the only prompt written is [2, 3]'s first token: [7, 8, 9] would have been two more
        assert sum(n for kind, _, n in engine.calls if kind != "decode") == 1
        assert scheduler.usage().reserved_positions == 0
    finally:
        gate.set()
        scheduler.close()


def test_a_waiting_request_whose_client_went_leaves_the_queue_while_the_slot_is_busy() -> None:
    engine = HistoryEngine(max_batch=1, max_seq=100_000)
    scheduler = Scheduler(engine, max_waiting=1)
    gone = threading.Event()
    try:
        endless, abandoned = Collector(), Collector()
        running = scheduler.submit([1], SamplingParams(max_new_tokens=90_000), endless)
        while not endless.events:  # it holds the only slot
            threading.Event().wait(0.001)
        scheduler.submit([7, 8], SamplingParams(max_new_tokens=3), abandoned, gone.is_set)
        assert scheduler.usage().waiting == 1
        gone.set()
        assert abandoned.finish == FINISH_CANCELLED and abandoned.tokens() == []
        assert not endless.done.is_set()  # dropped while the only slot was still busy
        assert scheduler.usage().waiting == 0
        queued = scheduler.submit([3], SamplingParams(max_new_tokens=1), Collector())  # room
        scheduler.cancel(queued)
        scheduler.cancel(running)
        assert endless.finish == FINISH_CANCELLED
    finally:
        scheduler.close()


def test_a_full_queue_asks_its_clients_before_refusing_a_request() -> None:
    """The engine is held inside a step, so no sweep runs: the request that finds the queue
    full is taken because the one holding its place has a gone client."""
    gate = threading.Event()
    engine = HistoryEngine(max_batch=1, max_seq=32, gate=gate)
    scheduler = Scheduler(engine, max_waiting=1)
    gone = threading.Event()
    try:
        first, abandoned, taken = Collector(), Collector(), Collector()
        scheduler.submit([1, 2], SamplingParams(max_new_tokens=3), first)
        assert engine.entered.wait(WAIT_S)  # it holds the only slot
        scheduler.submit([7, 8], SamplingParams(max_new_tokens=3), abandoned, gone.is_set)
        with pytest.raises(GenerationQueueFull, match="1 requests already wait"):
            scheduler.submit([5], SamplingParams(), Collector())  # its client is still there
        gone.set()
        scheduler.submit([3, 4], SamplingParams(max_new_tokens=2), taken)
        gate.set()
        assert abandoned.finish == FINISH_CANCELLED and abandoned.tokens() == []
        assert taken.tokens() == alone([3, 4], SamplingParams(max_new_tokens=2))
        assert scheduler.usage().reserved_positions == 0
    finally:
        gate.set()
        scheduler.close()


@pytest.mark.parametrize("alongside", [False, True], ids=["one_thread", "prefill_alongside"])
def test_a_long_prompt_stops_being_written_once_its_client_is_gone(alongside: bool) -> None:
    engine = HistoryEngine(max_batch=1, max_seq=256)
    scheduler = Scheduler(engine, prefill_chunk=4, prefill_alongside=alongside)
    written = threading.Event()
    try:
        chunks = Collector()

        def client_gone() -> bool:  # gone once two chunks are in
            if sum(kind == "extend" for kind, _, _ in engine.calls) >= 2:
                written.set()
            return written.is_set()

        prompt = [k % VOCAB for k in range(1, 200)]
        scheduler.submit(prompt, SamplingParams(max_new_tokens=3), chunks, client_gone)
        assert chunks.finish == FINISH_CANCELLED and chunks.tokens() == []
        extends = [n for kind, _, n in engine.calls if kind == "extend"]
        assert extends == [4, 4], extends  # 198 tokens would have been 50 chunks
        assert scheduler.usage().reserved_positions == 0
    finally:
        scheduler.close()


def test_a_cancelled_prompt_keeps_its_slot_until_its_chunk_is_written() -> None:
    """The prefill thread is writing a chunk of the only slot's prompt when the sequence is
    cancelled; a one-token prompt waiting for that slot decodes only once the chunk is done
    (else both threads would write the slot at once, and the engine's history would break)."""
    gate = threading.Event()
    engine = HistoryEngine(max_batch=1, max_seq=64, gate=gate)
    scheduler = Scheduler(engine, prefill_chunk=4, prefill_alongside=True)
    try:
        long, short = Collector(), Collector()
        sequence = scheduler.submit(list(range(1, 21)), SamplingParams(max_new_tokens=3), long)
        assert engine.entered.wait(WAIT_S)  # its first chunk is being written
        scheduler.submit([5], SamplingParams(max_new_tokens=3), short)
        scheduler.cancel(sequence)
        gate.set()
        assert long.finish == FINISH_CANCELLED and long.tokens() == []
        assert short.tokens() == alone([5], SamplingParams(max_new_tokens=3))
        assert [kind for kind, _, _ in engine.calls] == ["extend", "decode", "decode", "decode"]
        assert scheduler.usage().reserved_positions == 0
    finally:
        gate.set()
        scheduler.close()


def test_prompts_are_written_beside_the_running_decode_steps() -> None:
    """With the prefill thread, a long prompt arriving while a stream runs is written in chunks
    on that thread, and each stream still gets the tokens it gets alone."""
    engine = HistoryEngine(max_batch=2, max_seq=128)
    engine.pause_at = 4  # the running stream holds at its fourth step until the prompt arrives
    scheduler = Scheduler(engine, prefill_chunk=4, prefill_alongside=True)
    try:
        running, arriving = Collector(), Collector()
        scheduler.submit([3, 1], SamplingParams(max_new_tokens=40), running)
        running_params = SamplingParams(max_new_tokens=40)
        assert engine.paused.wait(WAIT_S)
        long_prompt = [(7 * k) % VOCAB for k in range(41)]
        scheduler.submit(long_prompt, SamplingParams(max_new_tokens=2), arriving)
        engine.resume.set()
        assert arriving.tokens() == alone(long_prompt, SamplingParams(max_new_tokens=2))
        assert running.tokens() == alone([3, 1], running_params)
    finally:
        scheduler.close()
    chunks = [tokens for kind, _, tokens in engine.calls if kind == "extend"]
    assert chunks == [1] + [4] * 10  # the running prompt's first token, then 40 in fours


@pytest.mark.parametrize("alongside", [False, True], ids=["one_thread", "prefill_alongside"])
def test_an_engine_failure_ends_only_the_sequences_it_hit(alongside: bool) -> None:
    engine = HistoryEngine(max_batch=2, max_seq=64)
    params = SamplingParams(max_new_tokens=5)
    first_token = alone([9, 9, 9], params)[0]
    engine.fail_on = first_token
    scheduler = Scheduler(engine, prefill_alongside=alongside)
    try:
        failing = Collector()
        scheduler.submit([9, 9, 9], params, failing)
        assert failing.finish == FINISH_ERROR and "decode failed" in failing.events[-1].error
        engine.fail_on = None
        ok = Collector()
        scheduler.submit([4, 4], params, ok)
        assert ok.tokens() == alone([4, 4], params)
    finally:
        scheduler.close()


def test_a_pick_that_fails_ends_its_sequence_and_the_others_go_on() -> None:
    """A sampled row with no finite logit cannot be drawn from: that sequence ends with an
    error, the one decoding beside it gets the tokens it gets alone, and the engine thread
    serves the next request."""
    engine = HistoryEngine(max_batch=2, max_seq=64, gate=threading.Event())
    engine.nan_on = 50
    greedy = SamplingParams(max_new_tokens=6)
    scheduler = Scheduler(engine)
    try:
        broken, beside = Collector(), Collector()
        scheduler.submit([50, 1], SamplingParams(max_new_tokens=6, do_sample=True), broken)
        scheduler.submit([4, 4], greedy, beside)
        engine.gate.set()  # both prompts are in before the first step
        assert broken.finish == FINISH_ERROR and "probability" in broken.events[-1].error
        assert beside.tokens() == alone([4, 4], greedy)
        after = Collector()
        scheduler.submit([7, 7], greedy, after)
        assert after.tokens() == alone([7, 7], greedy)
    finally:
        scheduler.close()


def tiny_llama(positions: int) -> torch.nn.Module:
    """A two-layer Llama over this file's vocabulary, random weights of a fixed seed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=positions,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def test_real_engine_streams_in_a_batch_match_each_alone() -> None:
    from cuvil.generation.eager_engine import EagerDecoderEngine

    model = tiny_llama(128)
    requests = [(prompt_of(i), SamplingParams(max_new_tokens=3 + i * 2)) for i in range(6)] + [
        (prompt_of(7), SamplingParams(max_new_tokens=9, do_sample=True, top_k=10, seed=3))
    ]

    def run(max_batch: int, together: bool) -> list[list[int]]:
        scheduler = Scheduler(EagerDecoderEngine(model, max_batch, 64), prefill_chunk=5)
        try:
            results = []
            collectors = []
            for prompt, params in requests:
                collector = Collector()
                scheduler.submit(prompt, params, collector)
                if not together:
                    results.append(collector.tokens())
                collectors.append(collector)
            return [c.tokens() for c in collectors]
        finally:
            scheduler.close()

    assert run(4, together=True) == run(1, together=False)


@pytest.mark.parametrize("alongside", [False, True], ids=["one_thread", "prefill_alongside"])
def test_an_engine_that_packs_prompts_writes_each_iterations_chunks_in_one_call(
    alongside: bool,
) -> None:
    engine = PackingEngine(max_batch=8, max_seq=64)
    engine.gate.clear()  # the burst queues before the first iteration
    scheduler = Scheduler(engine, prefill_chunk=16, prefill_alongside=alongside)
    prompts = [[(i * 11 + k) % VOCAB for k in range(5 + i)] for i in range(6)]
    params = SamplingParams(max_new_tokens=3)
    try:
        collectors = [Collector() for _ in prompts]
        for prompt, collector in zip(prompts, collectors, strict=True):
            scheduler.submit(prompt, params, collector)
        engine.gate.set()
        results = [c.tokens() for c in collectors]
    finally:
        scheduler.close()
    assert results == [alone(prompt, params) for prompt in prompts]
    writes = [(kind, len(slots), tokens) for kind, slots, tokens in engine.calls]
    writes = [write for write in writes if write[0] != "decode"]
    # 39 prompt tokens (each prompt's last goes in with a decode step) in calls of up to 16:
    # the first prompt may be written alone (the engine thread can take it before the rest
    # arrive), the rest three or more to a call
    assert sum(tokens for _, _, tokens in writes) == sum(len(p) - 1 for p in prompts)
    assert max(tokens for _, _, tokens in writes) <= 16
    assert len(writes) <= 4, writes
    assert any(kind == "extend_many" and slots >= 3 for kind, slots, _ in writes), writes


def test_a_failed_packed_write_ends_the_prompts_in_it_and_nothing_else() -> None:
    engine = PackingEngine(max_batch=4, max_seq=64)
    scheduler = Scheduler(engine, prefill_chunk=32)
    params = SamplingParams(max_new_tokens=30)
    try:
        running = Collector()
        scheduler.submit([1, 2], params, running)
        while len(running.events) < 2:  # the first stream decodes
            threading.Event().wait(0.001)
        engine.gate.clear()
        failing = [Collector(), Collector()]
        for index, collector in enumerate(failing):
            scheduler.submit([5 + index] * 6, params, collector)
        engine.fail_packs = True
        engine.gate.set()
        for collector in failing:
            assert collector.finish == FINISH_ERROR
            assert "packed prefill failed" in collector.events[-1].error
        engine.fail_packs = False
        assert running.tokens() == alone([1, 2], params)
        assert scheduler.usage().running == 0
    finally:
        scheduler.close()
