"""The scheduler: which requests run in the next engine step, in which KV slots, under which budget.

Pure logic, no tensors and no ONNX Runtime; tests/test_scheduler.py drives it alone.

Owns:
- admission bounds at submit time (waiting requests, waiting tokens) -> AdmissionRejected with a reason
  and a Retry-After estimate from the recent completion rate; the admission order (priority, then arrival);
- the slot layout. Live slots stay contiguous so the runtime binds them as views: decoding rows occupy
  slots [0, D), a request whose prompt is still being prefilled in chunks sits at slot D, joiners follow.
  When a request leaves, the last live decoding slot moves into its hole (one KV row copy each), and the
  chunked-prefill row, if any, moves down to the new D. Beam requests own several slots (not necessarily
  adjacent); each moves like any other;
- the per-step token budget (continuous mode): D decode tokens, then prefill work for the row being
  chunked and for joiners in admission order, counted as rows x padded length (+ encoder tokens) so one step's compute
  is bounded; a long decoder-only prompt is chunked to fit, the first joiner is never starved;
- the three batching modes: CONTINUOUS (join at the next step, leave at once), REQUEST (gather up to
  max_batch_size or wait batch_wait_timeout_s, then run that static batch to its end: rows of finished
  members stay in the batch, HELD, as in a padded batched generate, and nothing joins until all are done),
  NONE (one request at a time);
- cancellation and deadlines: reaped at the start of the next schedule, which frees their slots.

Does not own: tokens, sampling, events, the runtime (serving/engine/engine.py runs what the plan says).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from serving.engine.config import BatchingKnobs
from serving.engine.types import AdmissionRejected, BatchingMode, FinishReason

BULK_QUEUE_SHARE = 0.5  # of max_waiting: the waiting places a request of priority above 0 may take


class Phase(str, Enum):
    WAITING = "waiting"
    PREFILL = "prefill"  # holds its slots; prompt partly in the KV cache (chunked prefill)
    DECODE = "decode"  # one new token per row per step
    HELD = "held"  # finished, but its rows stay in a static (request-level) batch until the batch ends
    DONE = "done"


# The members as module names for the loops that run per row at every step: reading a member off its Enum class
# costs ~0.1 us (a descriptor call), ten times a module global.
PREFILL, DECODE, HELD, DONE = Phase.PREFILL, Phase.DECODE, Phase.HELD, Phase.DONE


@dataclass(eq=False)
class Sequence:
    """The scheduler's view of one request. `payload` is the engine's own per-request state."""

    request_id: str
    prefill_len: int  # decoder tokens to prefill (the prompt; [bos] for encoder-decoder)
    width: int = 1  # KV slots (beam size)
    src_len: int = 0  # encoder tokens (encoder-decoder), counted in the step budget
    max_new_tokens: int = 1
    arrival: float = 0.0
    deadline: float | None = None
    priority: int = 0  # lower first (GenerationRequest.priority)
    payload: Any = None
    phase: Phase = Phase.WAITING
    slots: list[int] = field(default_factory=list)
    prefilled: int = 0
    cancelled: bool = False
    first_scheduled: float | None = None

    @property
    def chunkable(self) -> bool:
        return self.width == 1 and self.src_len == 0

    def work_tokens(self) -> int:
        return self.src_len + self.width * (self.prefill_len + self.max_new_tokens)


@dataclass(frozen=True)
class Chunk:
    """Prefill work for one request in this step: decoder tokens [start, start + length) of its prompt."""

    seq: Sequence
    start: int
    length: int

    @property
    def completes(self) -> bool:
        return self.start + self.length == self.seq.prefill_len


@dataclass
class StepPlan:
    """What the engine runs next: slot moves first, then decode rows [0, decode_rows), then prefill rows
    [prefill_start, prefill_start + sum of widths) in chunk order (each chunk covers seq.width rows)."""

    moves: list[list[tuple[int, int]]] = field(default_factory=list)  # copy_slots batches, in order
    decode_rows: int = 0
    prefill_start: int = 0
    prefill: list[Chunk] = field(default_factory=list)
    finished: list[tuple[Sequence, FinishReason]] = field(default_factory=list)  # reaped, not run
    wake_in: float | None = None  # nothing to run: when to look again (batch timeout / deadline)

    @property
    def empty(self) -> bool:
        return self.decode_rows == 0 and not self.prefill


class Scheduler:
    def __init__(self, n_slots: int, max_len: int, knobs: BatchingKnobs) -> None:
        self.n_slots, self.max_len, self.knobs = n_slots, max_len, knobs
        self.owner: list[Sequence | None] = [None] * n_slots
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # PREFILL, DECODE and HELD
        self._waiting_tokens = 0
        self._used = 0  # slots with an owner (kept, not counted, on the hot path)
        self._finish_times: deque[float] = deque(maxlen=64)

    # ---- admission -------------------------------------------------------------------------------
    def add(self, seqs: list[Sequence], now: float) -> None:
        """Queue requests (all or none) or raise AdmissionRejected. The queue is kept in admission order: by
        priority (lower first), then arrival. A request of priority above 0 (bulk work) may fill only
        BULK_QUEUE_SHARE of the waiting places, so that under overload the 429s fall on it first and the rest of
        the queue stays for requests of priority 0 or below."""
        work = sum(s.work_tokens() for s in seqs)
        bulk = any(s.priority > 0 for s in seqs)
        places = int(self.knobs.max_waiting * BULK_QUEUE_SHARE) if bulk else self.knobs.max_waiting
        # Requests that free slots take at the next step do not really wait: they are not counted.
        if len(self.waiting) + len(seqs) > places + self.n_slots - self.slots_used:
            raise AdmissionRejected("queue_full", self.retry_after(now, len(seqs)))
        if self.waiting and self._waiting_tokens + work > self.knobs.max_waiting_tokens:
            raise AdmissionRejected("queue_tokens", self.retry_after(now, len(seqs)))
        for s in seqs:
            s.arrival = now
            if self.waiting and self.waiting[-1].priority > s.priority:  # ahead of every less urgent one
                at = next(i for i, w in enumerate(self.waiting) if w.priority > s.priority)
                self.waiting.insert(at, s)
            else:
                self.waiting.append(s)
        self._waiting_tokens += work

    def retry_after(self, now: float, n: int = 1) -> float:
        """Seconds until about n queue places free up, from the completion rate of the last requests."""
        times = [t for t in self._finish_times if now - t < 60.0]
        rate = (len(times) - 1) / max(now - times[0], 1e-3) if len(times) >= 2 else 0.0
        over = max(1, len(self.waiting) + n - self.knobs.max_waiting - (self.n_slots - self.slots_used))
        return float(min(60.0, max(0.5, over / rate))) if rate > 0 else 1.0

    # ---- bookkeeping ------------------------------------------------------------------------------
    @property
    def slots_used(self) -> int:
        return self._used

    @property
    def decode_slots(self) -> int:
        return sum(len(s.slots) for s in self.running if s.phase is DECODE or s.phase is HELD)

    def finish(self, seq: Sequence, now: float) -> None:
        """The engine finished a running request (stop, length, error): free or hold its slots."""
        self._finish_times.append(now)
        if self.knobs.batching == BatchingMode.REQUEST and seq.phase != Phase.PREFILL:
            seq.phase = Phase.HELD
            if any(s.phase != Phase.HELD for s in self.running):
                return
            for s in list(self.running):  # the whole static batch is done
                self._release(s)
            return
        self._release(seq)

    def drop(self, seq: Sequence) -> None:
        """Remove a request wherever it is (waiting or running, held or not): engine failures."""
        if seq.phase == Phase.WAITING:
            self._dequeue(seq)
            seq.phase = Phase.DONE
        elif seq.phase != Phase.DONE:
            self._release(seq)

    def _release(self, seq: Sequence) -> None:
        for slot in seq.slots:
            self.owner[slot] = None
        self._used -= len(seq.slots)
        seq.slots, seq.phase = [], Phase.DONE
        self.running.remove(seq)

    def after_step(self, plan: StepPlan) -> None:
        """Record the prefill progress of a step that ran (before finishing any request of it)."""
        for c in plan.prefill:
            c.seq.prefilled = c.start + c.length
            if c.completes and c.seq.phase == Phase.PREFILL:
                c.seq.phase = Phase.DECODE

    # ---- the plan ---------------------------------------------------------------------------------
    def schedule(self, now: float) -> StepPlan:
        plan = StepPlan()
        self._reap(now, plan)
        if self.knobs.batching != BatchingMode.REQUEST or not any(s.phase is not HELD for s in self.running):
            for s in [s for s in self.running if s.phase is HELD]:  # mode changed under a batch
                self._release(s)
        plan.decode_rows = self.decode_slots  # compaction moves rows, it does not change how many
        plan.moves = self._compact(plan.decode_rows)
        plan.prefill_start = plan.decode_rows
        if self.knobs.batching == BatchingMode.CONTINUOUS:
            self._admit_continuous(plan, now)
        elif not self.running:
            self._admit_batch(plan, now)
        if plan.empty and self.waiting:
            plan.wake_in = self._wake_in(now)
        return plan

    def _reap(self, now: float, plan: StepPlan) -> None:
        def expired(s: Sequence) -> FinishReason | None:
            if s.cancelled:
                return FinishReason.CANCELLED
            if s.deadline is not None and now >= s.deadline:
                return FinishReason.DEADLINE
            return None

        for s in list(self.waiting):
            if (reason := expired(s)) is not None:
                self._dequeue(s)
                s.phase = Phase.DONE
                plan.finished.append((s, reason))
        for s in list(self.running):
            if s.phase is not HELD and (reason := expired(s)) is not None:
                plan.finished.append((s, reason))
                self.finish(s, now)

    def _dequeue(self, s: Sequence) -> None:
        self.waiting.remove(s)
        self._waiting_tokens -= s.work_tokens()

    def _compact(self, d: int) -> list[list[tuple[int, int]]]:
        """Move live decode slots into holes below `d` (the decode slots), then the chunked-prefill row to slot d."""
        partial = [s for s in self.running if s.phase is PREFILL]
        assert len(partial) <= 1 and all(x >= d for s in partial for x in s.slots), "layout invariant"
        holes = [i for i in range(d) if self.owner[i] is None]
        tail = sorted(
            (i for i, s in enumerate(self.owner[d:], d) if s is not None and s.phase is not PREFILL),
            reverse=True,
        )
        batches = []
        if holes:
            # as many moves as the shorter list allows: the rest stay where they are
            batches.append(list(zip(tail, holes, strict=False)))
            self._apply(batches[-1])
        if partial and partial[0].slots[0] != d:
            batches.append([(partial[0].slots[0], d)])
            self._apply(batches[-1])
        return batches

    def _apply(self, moves: list[tuple[int, int]]) -> None:
        for src, dst in moves:
            seq = self.owner[src]
            assert seq is not None and self.owner[dst] is None
            self.owner[dst], self.owner[src] = seq, None
            seq.slots[seq.slots.index(src)] = dst

    def _place(self, plan: StepPlan, seq: Sequence, length: int, now: float) -> None:
        """Give a joiner the next free slots (the prefill rows follow each other) and a chunk."""
        start = plan.prefill_start + sum(c.seq.width for c in plan.prefill)
        if seq.phase == Phase.WAITING:
            self._dequeue(seq)
            seq.slots = list(range(start, start + seq.width))
            for slot in seq.slots:
                assert self.owner[slot] is None
                self.owner[slot] = seq
            self._used += seq.width
            seq.phase, seq.first_scheduled = Phase.PREFILL, now
            self.running.append(seq)
        plan.prefill.append(Chunk(seq, seq.prefilled, length))

    def _admit_continuous(self, plan: StepPlan, now: float) -> None:
        budget = self.knobs.max_tokens_per_step - plan.decode_rows
        free = self.n_slots - self.slots_used
        rows, t_max, w_max, enc = 0, 0, 0, 0
        candidates = [s for s in self.running if s.phase is PREFILL] + list(self.waiting)
        for seq in candidates:
            new = seq.phase == Phase.WAITING
            if new and seq.width > free:
                break
            remaining = seq.prefill_len - seq.prefilled
            r, e = rows + seq.width, enc + (seq.src_len * seq.width if new else 0)
            w = max(w_max, seq.prefilled)
            room = self.max_len - w  # the prefill call pads every row to T: max write_pos + T <= M
            if t_max > room:
                break
            first = rows == 0 and plan.decode_rows == 0  # an idle engine must make progress
            fit = min(remaining, room)
            if r * max(t_max, fit) + e <= budget or (first and not seq.chunkable):
                length = fit
            elif seq.chunkable and r * t_max + e <= budget and (budget - e) // r >= 1:
                length = min(fit, (budget - e) // r)
            elif seq.chunkable and first:
                length = min(fit, max(1, budget))
            else:
                break
            self._place(plan, seq, length, now)
            free -= seq.width if new else 0
            rows, t_max, w_max, enc = r, max(t_max, length), w, e
            if length < remaining:
                break  # at most one row is mid-prefill, and it is the last

    def _admit_batch(self, plan: StepPlan, now: float) -> None:
        """REQUEST / NONE: start a new batch when nothing runs; whole prompts, no budget, no chunks."""
        if not self.waiting:
            return
        head = self.waiting[0]
        if self.knobs.batching == BatchingMode.NONE:
            batch = [head]
        else:
            size = min(self.knobs.max_batch_size, self.n_slots)
            batch = list(itertools.islice(self.waiting, size))
            if len(batch) < size and now - head.arrival < self.knobs.batch_wait_timeout_s:
                return
        free = self.n_slots
        for seq in batch:
            if seq.width > free:
                break
            free -= seq.width
            self._place(plan, seq, seq.prefill_len - seq.prefilled, now)

    def _wake_in(self, now: float) -> float | None:
        """How long the engine may sleep while requests wait but nothing can run yet."""
        times = [s.deadline - now for s in self.waiting if s.deadline is not None]
        if self.knobs.batching == BatchingMode.REQUEST and not self.running:
            times.append(self.waiting[0].arrival + self.knobs.batch_wait_timeout_s - now)
        return max(0.0, min(times)) if times else None
