"""Prefix reuse in the scheduler: a prompt that begins as an earlier sequence's (a shared
system prompt, a conversation's earlier turns) starts from the keys a slot already holds, and
every stream still gets exactly the tokens it gets alone.

``PrefixEngine`` is test_scheduler's ``HistoryEngine`` (next token: a hash of everything the
slot holds) with a cache that outlives ``release``, stale positions written over, and
``copy_prefix``: a reuse that took the wrong slot, length or tokens would change the tokens.
The last test runs the real ``EagerDecoderEngine`` on a tiny Llama.
"""

from __future__ import annotations

import pytest
import torch
from cuvil_sidecar.generation.scheduler import PREFIX_MIN_TOKENS, Scheduler

from cuvil.generation.sampling import SamplingParams
from tests.cuvil_sidecar.generation.test_scheduler import (
    VOCAB,
    WAIT_S,
    Collector,
    PackingEngine,
    alone,
    tiny_llama,
)

SYSTEM = [(k * 7 + 5) % VOCAB for k in range(24)]  # a shared leading run of 24 tokens


class PrefixEngine(PackingEngine):
    def release(self, slot: int) -> None:
        pass  # the slot keeps what it holds until written again

    def copy_prefix(self, source: int, target: int, length: int) -> None:
        assert len(self.history[source]) >= length, "a copy of positions never written"
        self.history[target] = self.history[source][:length]
        self.calls.append(("copy", (source, target), length))

    def prefill(
        self, slot: int, token_ids: torch.Tensor, position: int, kind: str = "prefill"
    ) -> torch.Tensor:
        self.history[slot] = self.history[slot][:position]  # stale positions are written over
        return super().prefill(slot, token_ids, position, kind)

    def extend_many(self, chunks: list[tuple[int, torch.Tensor, int]]) -> None:
        for slot, _, position in chunks:
            self.history[slot] = self.history[slot][:position]
        super().extend_many(chunks)


def written(engine: PrefixEngine, since: int) -> int:
    """Prompt tokens the engine was asked to write after its first ``since`` calls."""
    return sum(n for kind, _, n in engine.calls[since:] if kind in ("extend", "extend_many"))


def run(scheduler: Scheduler, prompt: list[int], new_tokens: int) -> list[int]:
    collector = Collector()
    scheduler.submit(prompt, SamplingParams(max_new_tokens=new_tokens), collector)
    return collector.tokens()


def test_a_prompt_that_begins_as_a_finished_ones_writes_only_the_rest() -> None:
    engine = PrefixEngine(max_batch=2, max_seq=128)
    scheduler = Scheduler(engine)
    try:
        first = [*SYSTEM, 1, 2, 3]
        assert run(scheduler, first, 3) == alone(first, SamplingParams(max_new_tokens=3), 128)
        second = [*SYSTEM, 9, 8, 7, 6, 5]
        calls = len(engine.calls)
        assert run(scheduler, second, 4) == alone(second, SamplingParams(max_new_tokens=4), 128)
        assert written(engine, calls) == len(second) - 1 - len(SYSTEM)
        assert scheduler.usage().reused_tokens == len(SYSTEM)
    finally:
        scheduler.close()


def test_a_conversations_next_turn_reuses_the_earlier_answer_too() -> None:
    engine = PrefixEngine(max_batch=3, max_seq=128)
    scheduler = Scheduler(engine)
    try:
        turn = [*SYSTEM, 4, 4, 4]
        answer = run(scheduler, turn, 6)
        following = turn + answer + [11, 12]
        calls = len(engine.calls)
        expected = alone(following, SamplingParams(max_new_tokens=5), 128)
        assert run(scheduler, following, 5) == expected
        # every position the first sequence wrote: its prompt and its answer but the newest
        reused = len(turn) + len(answer) - 1
        assert scheduler.usage().reused_tokens == reused
        assert written(engine, calls) == len(following) - 1 - reused
    finally:
        scheduler.close()


@pytest.mark.parametrize("alongside", [False, True], ids=["one_thread", "prefill_alongside"])
def test_streams_sharing_a_system_prompt_get_the_tokens_they_get_alone(alongside: bool) -> None:
    """Streams join while others sharing their first 24 tokens are written, decode or have
    finished: reuse from running and from free slots, each stream's tokens its own."""
    engine = PrefixEngine(max_batch=3, max_seq=128)
    scheduler = Scheduler(engine, prefill_chunk=8, prefill_alongside=alongside)
    requests = [(SYSTEM + [(i * 11 + k) % VOCAB for k in range(1 + i % 5)], 3 + i % 6)
                for i in range(12)]  # fmt: skip
    try:
        collectors = []
        for i, (prompt, new_tokens) in enumerate(requests):
            collectors.append(Collector())
            scheduler.submit(prompt, SamplingParams(max_new_tokens=new_tokens), collectors[-1])
            if i % 4 == 1:
                collectors[-1].done.wait(WAIT_S)
        results = [collector.tokens() for collector in collectors]
        reused = scheduler.usage().reused_tokens
    finally:
        scheduler.close()
    expected = [alone(p, SamplingParams(max_new_tokens=n), 128) for p, n in requests]
    assert results == expected
    assert reused >= len(SYSTEM) * 6 and any(kind == "copy" for kind, _, _ in engine.calls)


@pytest.mark.parametrize("alongside", [False, True], ids=["one_thread", "prefill_alongside"])
def test_a_burst_sharing_a_system_prompt_writes_it_once(alongside: bool) -> None:
    """Six prompts arrive together, before anything is written: the first writes the shared
    24 tokens, and the others, though the step's budget of 40 tokens has room for theirs,
    wait for that chunk and copy it."""
    engine = PrefixEngine(max_batch=6, max_seq=128)
    scheduler = Scheduler(engine, prefill_chunk=40, prefill_alongside=alongside)
    requests = [[*SYSTEM, *[(i * 5 + k) % VOCAB for k in range(2 + i)]] for i in range(6)]
    engine.gate.clear()  # nothing runs until all six are queued
    try:
        collectors = [Collector() for _ in requests]
        for prompt, collector in zip(requests, collectors, strict=True):
            scheduler.submit(prompt, SamplingParams(max_new_tokens=3), collector)
        engine.gate.set()
        results = [collector.tokens() for collector in collectors]
        reused = scheduler.usage().reused_tokens
    finally:
        engine.gate.set()
        scheduler.close()
    assert results == [alone(p, SamplingParams(max_new_tokens=3), 128) for p in requests]
    assert reused == 5 * len(SYSTEM)
    own = sum(len(prompt) - 1 - len(SYSTEM) for prompt in requests)
    assert written(engine, 0) == len(SYSTEM) + own


def test_short_common_prefixes_and_a_scheduler_told_not_to_are_written_again() -> None:
    engine = PrefixEngine(max_batch=2, max_seq=128)
    scheduler = Scheduler(engine)
    try:
        short = SYSTEM[: PREFIX_MIN_TOKENS - 1]
        run(scheduler, [*short, 1, 2], 2)
        run(scheduler, [*short, 3, 4], 2)
        assert scheduler.usage().reused_tokens == 0
    finally:
        scheduler.close()
    off = Scheduler(PrefixEngine(max_batch=2, max_seq=128), reuse_prefixes=False)
    try:
        run(off, [*SYSTEM, 1], 2)
        run(off, [*SYSTEM, 2], 2)
        assert off.usage().reused_tokens == 0
    finally:
        off.close()


def test_a_failed_step_leaves_nothing_to_reuse() -> None:
    engine = PrefixEngine(max_batch=1, max_seq=128)
    scheduler = Scheduler(engine)
    try:
        engine.fail_on = 77  # the prompt's last token: its first decode step fails
        failed = Collector()
        scheduler.submit([*SYSTEM, 77], SamplingParams(max_new_tokens=3), failed)
        assert failed.done.wait(WAIT_S) and failed.finish == "error"
        engine.fail_on = None
        again = [*SYSTEM, 5, 6]
        calls = len(engine.calls)
        assert run(scheduler, again, 3) == alone(again, SamplingParams(max_new_tokens=3), 128)
        assert written(engine, calls) == len(again) - 1  # all of it written again
    finally:
        scheduler.close()


def test_the_real_engine_reusing_a_prefix_matches_a_fresh_prefill() -> None:
    from cuvil.generation.eager_engine import EagerDecoderEngine

    model = tiny_llama(256)
    scheduler = Scheduler(EagerDecoderEngine(model, max_batch=2, max_seq=128))
    try:
        turn = [*SYSTEM, 3, 1, 4]
        answer = run(scheduler, turn, 5)
        following = turn + answer + [1, 5, 9, 2]
        tokens = run(scheduler, following, 6)
        assert scheduler.usage().reused_tokens == len(turn) + len(answer) - 1
    finally:
        scheduler.close()
    with torch.inference_mode():
        reference = model.generate(
            torch.tensor([following]), max_new_tokens=6, do_sample=False, eos_token_id=None
        )
    assert tokens == reference[0, len(following) :].tolist()
