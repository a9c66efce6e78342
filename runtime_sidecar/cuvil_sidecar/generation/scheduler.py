"""Continuous batching: the one thread that drives a ``DecoderEngine`` for every stream at once.

Scheduling is per iteration, as in Orca and vLLM: a request that arrives joins the running
batch at the next step, and a sequence that finishes leaves it at once, its slot free for the
next one. Each iteration prefills at most ``prefill_chunk`` prompt tokens, first come first
served (several short prompts together, or one chunk of a long one; an engine with
``extend_many`` writes them in one call), then runs one decode step for every sequence past its
prompt: a long prompt is prefilled over several iterations while the running streams keep
getting a token per iteration, and a burst of short prompts reaches its first tokens in a few
iterations rather than one iteration per prompt.

A prompt's tokens but its last are written with ``engine.extend``, or with the iteration's other
chunks in one ``engine.extend_many`` (no logits: the engine may pad the chunks to a length it
has prepared); its last token joins the decode step of the iteration that finished the rest, as
a row whose logits pick its first token (a one-token prompt goes straight to decode).

With ``prefill_alongside`` (a host whose cores hold two engine threads: the sidecar's engine
runs at one thread on two cores), prompts are written by a prefill thread of their own while
the engine thread runs decode steps, each at ``threads``: a burst of prompts no longer holds up
the running streams, and the two kinds of step use both cores. The two threads never touch the
same slot at once: a sequence decodes only once its prompt is written, and a cancelled one
keeps its slot until the chunk being written for it is done.

Prompts that begin as an earlier sequence's did are not written again (prefix reuse, as vLLM's
prefix caching): with an engine that has ``copy_prefix`` (it then keeps a slot's keys and values
until the slot is written again), a sequence taking a slot starts from the longest run of leading
tokens, ``PREFIX_MIN_TOKENS`` or more, that some slot still holds (a running sequence's written
prompt and tokens, or a finished one's, until its slot is taken), copied into its own slot, or kept
where it already is when that slot is free: a shared system prompt or the earlier turns of a
conversation cost a copy, not a prefill. A prompt still being written takes, before each chunk, what
other slots have written of its next tokens since, and waits while an earlier prompt's chunk in the
same step writes them, so a burst of prompts that share a system prompt writes it once. Positions
hold the same keys and values whichever sequence wrote them, up to the order of floating-point sums
in batched products (as when prompts are packed together), so a stream's tokens are those it gets
without reuse (the tests compare them with transformers' greedy tokens).

Memory is admitted, never discovered: a sequence reserves its prompt plus the tokens it may
generate (its ``max_new_tokens``, cut to what ``max_seq`` leaves) against a budget of cache
positions (``kv_budget_bytes // engine.kv_bytes_per_token``, at most slots times ``max_seq``). A
request that fits when others finish waits in a bounded queue, first come first served; one
more than the queue holds is refused at once (``GenerationQueueFull``), and so is one that could
never fit the budget (``KvBudgetExceeded``). Nothing past the budget is ever allocated.

A sequence's tokens depend only on its own cache slot, its own sampling parameters and its own
``torch.Generator``, so a stream gets the same tokens whoever else runs beside it, and a pick that
fails (nothing finite to draw from) ends that sequence alone. Events go to each sequence's ``sink``
from the engine thread; a cancelled sequence (its client went away) is dropped at the start of the
next iteration and its slot and reservation freed. A transport that cannot cancel a sequence when
its client goes (the native gRPC front end learns it only by asking the call) gives ``submit`` a
``client_gone`` check instead: waiting sequences are asked every ``CLIENT_SWEEP_S``, when their
turn comes and when the queue is full as another request arrives, and a prompt before each of its
chunks, so none is run, or holds a place in the queue, for nobody; a decoding one learns it when
its next token cannot be written.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

import torch

from cuvil.generation.engine import DecoderEngine
from cuvil.generation.penalties import PenaltyState
from cuvil.generation.sampling import SamplingParams, TokenLogprobs, next_tokens, token_logprobs
from cuvil_sidecar.errors import GenerationQueueFull, InvalidInput, KvBudgetExceeded
from cuvil_sidecar.generation.inbox import held_deliveries
from cuvil_sidecar.generation.sequences import (
    FINISH_CANCELLED,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_SHUTDOWN,
    FINISH_STOP,
    Sequence,
    Sink,
    TokenEvent,
    Usage,
    decode_ready,
)

log = logging.getLogger("cuvil_sidecar.generation")

CLIENT_SWEEP_S = 0.05  # how often waiting sequences' clients are asked whether they are gone
PREFIX_MIN_TOKENS = 8  # a shorter common prefix is written again rather than copied


class Scheduler:
    def __init__(
        self,
        engine: DecoderEngine,
        *,
        kv_budget_bytes: int = 0,
        max_waiting: int = 64,
        prefill_chunk: int = 128,
        threads: int = 0,
        prefill_alongside: bool = False,
        reuse_prefixes: bool = True,
        name: str = "generation",
    ) -> None:
        """``kv_budget_bytes`` 0: every slot's whole cache. ``threads``: the engine threads'
        intra-op threads (0: the process's count). ``reuse_prefixes``: with an engine that has
        ``copy_prefix``."""
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be at least 1, not {prefill_chunk}")
        self.engine = engine
        whole = engine.max_batch * engine.max_seq
        by_bytes = kv_budget_bytes // max(1, engine.kv_bytes_per_token)
        self.budget_positions = min(whole, by_bytes) if kv_budget_bytes else whole
        self.max_waiting = max_waiting
        self.prefill_chunk = prefill_chunk
        self.threads = threads
        self.prefill_alongside = prefill_alongside
        self._prefilling: list[Sequence] = []  # being written by the prefill thread
        self._free_slots = list(range(engine.max_batch - 1, -1, -1))
        self._copy_prefix: Callable[[int, int, int], None] | None = (
            getattr(engine, "copy_prefix", None) if reuse_prefixes else None
        )
        self._holders: dict[int, Sequence] = {}  # slot -> the sequence whose keys it holds
        self._reused_tokens = 0
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._running: list[Sequence] = []
        self._reserved = 0
        self._next_sweep = 0.0  # when the waiting sequences' clients are next asked (monotonic)
        self._closed = False
        self._wake = threading.Condition()
        self._threads = [threading.Thread(target=self._loop, name=f"cuvil-{name}", daemon=True)]
        if prefill_alongside:
            self._threads.append(
                threading.Thread(
                    target=self._prefill_loop, name=f"cuvil-{name}-prefill", daemon=True
                )
            )
        for thread in self._threads:
            thread.start()

    def submit(
        self,
        prompt: list[int],
        params: SamplingParams,
        sink: Sink,
        client_gone: Callable[[], bool] | None = None,
        logprobs: int | None = None,
    ) -> Sequence:
        """Queue a sequence; its events go to ``sink`` on the engine thread. Raises at once
        when it can never run, or when the waiting queue is full. ``client_gone`` (any
        thread, cheap): whether the client went away without cancelling; asked while the
        sequence waits and before each of its prompt chunks, so that it is dropped unrun.
        ``logprobs``: each event carries its token's log-probability and this many top ones'."""
        max_seq = self.engine.max_seq
        if not prompt:
            raise InvalidInput("the prompt holds no tokens")
        if len(prompt) >= max_seq:
            raise InvalidInput(
                f"the prompt holds {len(prompt)} tokens; this model takes at most {max_seq - 1} "
                f"(max_seq {max_seq}, prompt and generated tokens together)"
            )
        vocab = self.engine.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise InvalidInput(f"token ids must lie in 0..{vocab - 1}")
        sequence = Sequence(
            prompt=list(prompt),
            params=params,
            sink=sink,
            max_new_tokens=min(params.max_new_tokens, max_seq - len(prompt)),
            generator=params.generator(),
            submitted_ns=time.perf_counter_ns(),
            client_gone=client_gone,
            logprobs=logprobs,
            penalty=PenaltyState(vocab, prompt) if params.penalizes else None,
        )
        if sequence.reserved > self.budget_positions:
            raise KvBudgetExceeded(
                f"the request needs {sequence.reserved} cache positions (prompt "
                f"{len(prompt)} + {sequence.max_new_tokens} new tokens); the KV cache budget "
                f"holds {self.budget_positions}: it can never run here"
            )
        with self._wake:
            if self._closed:
                raise GenerationQueueFull("the generation scheduler is stopping")
            if self._waiting_wanted() >= self.max_waiting and not self._fits_now(sequence):
                raise GenerationQueueFull(
                    f"{self._waiting_wanted()} requests already wait for KV cache room "
                    f"(the queue holds {self.max_waiting}); try again later"
                )
            self._waiting.append(sequence)
            self._wake.notify_all()
        return sequence

    def cancel(self, sequence: Sequence) -> None:
        """Drop the sequence at the next iteration (any thread); its slot is freed."""
        with self._wake:
            sequence.cancelled = True
            self._wake.notify_all()

    def usage(self) -> Usage:
        with self._wake:
            return Usage(
                len(self._running),
                len(self._waiting),
                self._reserved,
                self.budget_positions,
                self._reused_tokens,
            )

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the engine thread; sequences still there end with ``FINISH_SHUTDOWN``."""
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        for thread in self._threads:
            thread.join(timeout_s)

    def _waiting_wanted(self) -> int:
        """Under the lock: the waiting sequences someone still waits for. A full queue asks
        its sequences' clients before refusing a request, so that one whose client went
        since the last sweep holds no place (the engine thread drops it, woken on submit)."""
        if len(self._waiting) < self.max_waiting:
            return len(self._waiting)
        return sum(not sequence.abandoned() for sequence in self._waiting)

    def _fits_now(self, sequence: Sequence) -> bool:
        return (
            not self._waiting
            and bool(self._free_slots)
            and self._reserved + sequence.reserved <= self.budget_positions
        )

    def _loop(self) -> None:
        if self.threads:
            torch.set_num_threads(self.threads)  # this thread's parallel regions only
        while True:
            with self._wake:
                while not self._closed and not self._engine_has_work():
                    self._wake.wait()
                if self._closed:
                    ending = [*self._running, *self._waiting]
                    self._running, self._waiting = [], collections.deque()
                    self._wake.notify_all()  # the prefill thread stops too
                    break
                dropped = self._drop_cancelled()
                dropped += self._admit()
                if self.prefill_alongside:
                    prefills: list[tuple[Sequence, int]] = []
                    self._wake.notify_all()  # the sequences admitted, to the prefill thread
                else:
                    prefills = self._prefill_plan()
            for sequence in dropped:
                self._emit(sequence, None, FINISH_CANCELLED)
            if prefills:
                self._prefill_chunks(prefills)
            with self._wake:  # the prompts finished above (or alongside) decode now too
                decoding = [s for s in self._running if decode_ready(s)]
            if decoding:
                self._decode(decoding)
        for sequence in ending:
            self._emit(sequence, None, FINISH_SHUTDOWN)

    def _engine_has_work(self) -> bool:
        """Under the lock: whether the engine thread has a step to run (with the prefill
        thread alongside, prompts being written are its work, not this thread's)."""
        if not self.prefill_alongside:
            return bool(self._waiting or self._running)
        head = self._waiting[0] if self._waiting else None
        return (
            any(s.cancelled and s not in self._prefilling for s in self._running)
            or any(s.cancelled for s in self._waiting)
            or any(decode_ready(s) for s in self._running)
            or (
                head is not None
                and bool(self._free_slots)
                and self._reserved + head.reserved <= self.budget_positions
            )
        )

    def _prefill_loop(self) -> None:
        """The prefill thread: the running sequences' prompts, in arrival order, in chunks of
        up to ``prefill_chunk`` tokens in all (``_prefill_plan``)."""
        if self.threads:
            torch.set_num_threads(self.threads)
        while True:
            with self._wake:
                job = self._prefill_plan()
                while not job and not self._closed:
                    self._wake.wait()
                    job = self._prefill_plan()
                if self._closed or not job:
                    return
                self._prefilling = [sequence for sequence, _ in job]
            self._prefill_chunks(job)
            with self._wake:
                self._prefilling = []
                self._wake.notify_all()

    def _drop_cancelled(self) -> list[Sequence]:
        now = time.monotonic()
        if self._waiting and now >= self._next_sweep:  # a gone client keeps no place in line
            self._next_sweep = now + CLIENT_SWEEP_S
            for sequence in self._waiting:
                sequence.abandoned()
        dropped = [s for s in self._waiting if s.cancelled]
        if dropped:
            self._waiting = collections.deque(s for s in self._waiting if not s.cancelled)
        # a sequence whose chunk the prefill thread is writing keeps its slot until it is done
        for sequence in [s for s in self._running if s.cancelled and s not in self._prefilling]:
            self._leave(sequence)
            dropped.append(sequence)
        return dropped

    def _admit(self) -> list[Sequence]:
        """Under the lock: waiting sequences take free slots in arrival order; returns those
        found abandoned when their turn came (dropped unrun)."""
        gone = []
        while self._waiting and self._free_slots:
            head = self._waiting[0]
            if head.abandoned():
                gone.append(self._waiting.popleft())
                continue
            if self._reserved + head.reserved > self.budget_positions:
                break  # first come first served: later ones wait behind it
            self._waiting.popleft()
            head.slot = self._take_slot(head)
            self._reserved += head.reserved
            self._running.append(head)
        return gone

    def _take_slot(self, sequence: Sequence) -> int:
        """Under the lock: a free slot for ``sequence``, holding the longest prefix of its
        prompt (but the last token) that any slot holds when that is long enough. The slot
        holding it is taken when it is free and the sequence continues all it holds (a
        conversation's next turn), or no other is free; else the longest-free other slot,
        with the prefix copied in, so that what free slots hold is overwritten oldest first."""
        free = self._free_slots
        if self._copy_prefix is None:
            return free.pop()
        length, source, held = self._longest_held(sequence, 0)
        if length < PREFIX_MIN_TOKENS:
            slot = free[0]
        elif source in free and (length == held or len(free) == 1):
            slot = source
        else:
            slot = next(s for s in free if s != source)
        free.remove(slot)
        if length >= PREFIX_MIN_TOKENS:
            self._copy_prefix(source, slot, length)
            sequence.prefilled = sequence.reused = length
            self._reused_tokens += length
        self._holders[slot] = sequence
        return slot

    def _leave(self, sequence: Sequence) -> None:
        """Under the lock: the sequence's slot and reservation go back (once: a prompt whose
        chunk fails on the prefill thread after the scheduler closed has already left)."""
        if sequence not in self._running:
            return
        self._running.remove(sequence)
        self.engine.release(sequence.slot)
        self._free_slots.append(sequence.slot)
        self._reserved -= sequence.reserved

    def _prefill_plan(self) -> list[tuple[Sequence, int]]:
        """Under the lock: the next prompt chunks, in arrival order, ``prefill_chunk`` tokens
        in all, of sequences not cancelled and whose client is still there. With prefix
        reuse, a prompt first takes what another slot has written of its next tokens since
        it was admitted, and one whose next tokens an earlier prompt's chunk in this plan
        writes waits for that chunk and copies it (a burst of prompts sharing a system
        prompt writes it once)."""
        plan: list[tuple[Sequence, int]] = []
        left = self.prefill_chunk
        for sequence in self._running:
            remaining = len(sequence.prompt) - 1 - sequence.prefilled
            if not remaining or not left:
                continue
            known = sequence.cancelled
            if sequence.abandoned():
                if not known:
                    self._wake.notify_all()  # the engine thread drops it
                continue
            if self._copy_prefix is not None:
                remaining -= self._catch_up(sequence)
                if not remaining:
                    self._wake.notify_all()  # ready to decode, to the engine thread
                    continue
                if any(self._writes_ahead(planned, sequence) for planned, _ in plan):
                    continue
            plan.append((sequence, min(remaining, left)))
            left -= plan[-1][1]
        return plan

    def _catch_up(self, sequence: Sequence) -> int:
        """Under the lock: copy into the sequence's slot the longest prefix of its prompt
        that another slot holds past what it has written; returns the positions gained."""
        if self._copy_prefix is None:
            return 0
        length, source, _ = self._longest_held(sequence, sequence.prefilled)
        if length < sequence.prefilled + PREFIX_MIN_TOKENS:
            return 0
        self._copy_prefix(source, sequence.slot, length)
        gained, sequence.prefilled = length - sequence.prefilled, length
        sequence.reused += gained
        self._reused_tokens += gained
        return gained

    def _longest_held(self, sequence: Sequence, beyond: int) -> tuple[int, int, int]:
        """Under the lock: the longest prefix of the sequence's prompt (but its last token)
        that a slot other than its own holds, if longer than ``beyond``: (its length, that
        slot, how many positions the slot holds); (``beyond``, -1, 0) when none is."""
        wanted = sequence.prompt[:-1]
        found = (beyond, -1, 0)
        for slot, holder in self._holders.items():
            if holder is not sequence:
                written = holder.written()
                common = _common_prefix(wanted, written)
                if common > found[0]:
                    found = (common, slot, len(written))
        return found

    @staticmethod
    def _writes_ahead(planned: Sequence, sequence: Sequence) -> bool:
        """Whether ``planned``'s chunk writes tokens ``sequence``'s prompt needs next (its
        prompt goes on past where ``sequence`` stands, as ``sequence``'s does)."""
        ahead = sequence.prefilled + PREFIX_MIN_TOKENS
        return _common_prefix(sequence.prompt[:-1], planned.prompt[:-1]) >= ahead

    def _prefill_chunks(self, plan: list[tuple[Sequence, int]]) -> None:
        """Write the planned chunks (outside the lock: the engine calls): packed into one
        call where the engine has ``extend_many`` (a failure there fails every sequence in
        it), one ``extend`` each otherwise."""
        pack = getattr(self.engine, "extend_many", None)
        if pack is None or len(plan) == 1:
            for sequence, tokens in plan:
                self._prefill_chunk(sequence, tokens)
            return
        try:
            pack([self._chunk(sequence, tokens) for sequence, tokens in plan])
        except Exception as error:
            self._fail([sequence for sequence, _ in plan], error)
            return
        for sequence, tokens in plan:
            sequence.prefilled += tokens

    def _prefill_chunk(self, sequence: Sequence, tokens: int) -> None:
        try:
            self.engine.extend(*self._chunk(sequence, tokens))
        except Exception as error:
            self._fail([sequence], error)
            return
        sequence.prefilled += tokens

    @staticmethod
    def _chunk(sequence: Sequence, tokens: int) -> tuple[int, torch.Tensor, int]:
        """(slot, the next ``tokens`` of its prompt, their first position)."""
        start = sequence.prefilled
        return sequence.slot, torch.tensor(sequence.prompt[start : start + tokens]), start

    def _decode(self, sequences: list[Sequence]) -> None:
        """One step: each sequence's newest token (a prompt's last, before its first)."""
        slots = [s.slot for s in sequences]
        last = torch.tensor([s.tokens[-1] if s.tokens else s.prompt[-1] for s in sequences])
        positions = torch.tensor([len(s.prompt) + len(s.tokens) - 1 for s in sequences])
        try:
            logits = self.engine.decode(slots, last, positions)
        except Exception as error:
            self._fail(sequences, error)
            return
        params, failures = [s.params for s in sequences], dict[int, Exception]()

        penalties = [s.penalty for s in sequences].__getitem__
        generators = [s.generator for s in sequences]
        tokens = next_tokens(logits, params, generators, penalties, failures.__setitem__)
        with held_deliveries():  # the step's tokens reach each event loop in one wake-up
            for row, (sequence, token) in enumerate(zip(sequences, tokens, strict=True)):
                if row in failures:  # its pick failed: it ends, the others go on
                    self._fail([sequence], failures[row])
                    continue
                top = sequence.logprobs
                scored = None if top is None else token_logprobs(logits[row], token, top)
                self._took(sequence, token, scored)

    def _took(self, sequence: Sequence, token: int, logprobs: TokenLogprobs | None) -> None:
        """Send the sequence's next token, end the sequence if done."""
        sequence.tokens.append(token)
        if sequence.penalty is not None:
            sequence.penalty.add(token)
        finish = None
        if token in sequence.params.eos_token_id:
            finish = FINISH_STOP
        elif len(sequence.tokens) >= sequence.max_new_tokens:
            finish = FINISH_LENGTH
        if finish is not None:
            with self._wake:
                self._leave(sequence)
        self._emit(sequence, token, finish, logprobs=logprobs)

    def _fail(self, sequences: list[Sequence], error: Exception) -> None:
        log.error("the engine failed for %d sequence(s): %r", len(sequences), error)
        with self._wake:
            for sequence in sequences:
                self._leave(sequence)
                if self._holders.get(sequence.slot) is sequence:  # its cache is in doubt
                    del self._holders[sequence.slot]
        for sequence in sequences:
            self._emit(sequence, None, FINISH_ERROR, f"the model failed: {error}")

    @staticmethod
    def _emit(
        sequence: Sequence,
        token: int | None,
        finish: str | None,
        error: str = "",
        logprobs: TokenLogprobs | None = None,
    ) -> None:
        index, now = len(sequence.tokens) - 1, time.perf_counter_ns()
        event = TokenEvent(token, index, finish, error, now, logprobs)
        try:
            sequence.sink(event)
        except Exception:  # a sink's failure is its client's; the other streams go on
            log.exception("a generation sink failed")


def _common_prefix(wanted: list[int], held: list[int]) -> int:
    """How many leading tokens the two lists share (0 when fewer than PREFIX_MIN_TOKENS):
    slices compared in C, halving the range each time."""
    low, high = PREFIX_MIN_TOKENS, min(len(wanted), len(held))
    if high < low or wanted[:low] != held[:low]:
        return 0
    while low < high:  # wanted[:low] == held[:low]; the common length is at most high
        middle = (low + high + 1) // 2
        if wanted[:middle] == held[:middle]:
            low = middle
        else:
            high = middle - 1
    return low
