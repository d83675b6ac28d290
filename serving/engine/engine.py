"""The inference engine: many concurrent generation requests over one ModelRuntime, on token ids only.

Owns: the public engine API the server codes against (Engine; its RequestHandle), admission, the step loop
(schedule -> run -> update), streaming TokenEvents, finishing requests (stop ids, length, cancellation,
deadlines, errors), the engine's health (a failed step fails only its rows; MAX_CONSECUTIVE_FAILURES in a row,
a step that runs past `step_timeout_s` or a crash of the loop make it dead: `snapshot()["dead_reason"]`),
live reconfiguration and the per-step / per-request stats handed to observers.

The step loop runs in its own thread (`kvserve-step`): schedule, the step's ONNX Runtime work and token choice, then the
update, back to back, so a step starts as soon as the last one ends, whatever the event loop is doing (HTTP, streams).
The event loop submits and cancels (under one lock with the scheduler's state, never held while ONNX Runtime computes)
and receives each step's events, which the step thread hands over just before the next step's ONNX Runtime call, so the
consumers run while the model computes (serving/engine/outbox.py). The watchdog is a task on the event loop: an ONNX
Runtime call cannot be interrupted, so a hung step's thread is abandoned (the engine is dead, every request fails with a
retryable error, and the replica is replaced) rather than waited for.

Conventions: a decoder-only prompt starts with bos (the API layer prepends it); an encoder-decoder prompt is
the source without special tokens and the decoder starts from bos. The token that stops a request (eos or a
stop id) is not streamed. A beam-search request streams its best hypothesis' tokens when the search ends,
then the final event with the n-best hypotheses. Stop strings are the HTTP layer's (it cancels).

Does not own: tokenization, HTTP, Ray, metrics export, the knobs (serving/engine/config.py), request checks (checks.py),
the slot layout and batching policy (scheduler.py), sampling (sampling.py), beam search (beam.py), sessions
(runtime.py), a handle's event queue (handle.py).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

from serving.engine.checks import RequestLimits, admit
from serving.engine.config import EngineConfig, ReplicaKnobs
from serving.engine.handle import RequestHandle
from serving.engine.outbox import Outbox
from serving.engine.runner import RequestState, Runtime, StepResult, StepRunner
from serving.engine.scheduler import DONE, HELD, Phase, Scheduler, Sequence, StepPlan
from serving.engine.types import (
    AdmissionRejected,
    EngineDead,
    FinishReason,
    GenerationRequest,
    InvalidRequest,
    RequestStats,
    StepStats,
    TokenEvent,
)

log = logging.getLogger(__name__)
MAX_CONSECUTIVE_FAILURES = 3  # failing steps in a row before the engine declares itself dead


class Engine:
    def __init__(self, runtime: Runtime, config: EngineConfig) -> None:
        if config.max_slots > runtime.n_slots:
            raise ValueError(
                f"config.max_slots={config.max_slots} exceeds the runtime's n_slots="
                f"{runtime.n_slots}; build the runtime with at least that many slots"
            )
        self.runtime, self.config = runtime, config
        self.is_encoder_decoder = runtime.is_encoder_decoder
        self.vocab_size, self.eos_id, self.max_len = runtime.vocab_size, runtime.eos_id, runtime.max_len
        self.scheduler = Scheduler(config.max_slots, runtime.max_len, config.batching_knobs())
        self.request_limits = RequestLimits.of(runtime, config)
        self._runner = StepRunner(runtime)
        self._live: dict[str, Sequence] = {}
        self._observers: list[tuple[Callable | None, Callable | None]] = []
        # The step thread and the event loop share the scheduler, _live and the outbox: this lock guards them
        # (never held while ONNX Runtime computes). `_wake` wakes an idle step thread.
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._done: asyncio.Future | None = None  # the step thread's end (None: not started, or stopped)
        self._watchdog: asyncio.Task | None = None
        self._step_t0: float | None = None  # perf_counter at the start of the step in flight (None: none)
        self._accepting, self._stopping, self._dead = True, False, False
        self._dead_reason: str | None = None
        self._hung: str | None = None  # set by the watchdog when the step in flight overran
        self._failures = 0
        # What the last step produced for the event loop, handed over once the next step's compute has started.
        self._outbox = Outbox(self._lock)

    @classmethod
    def from_bundle(cls, bundle_dir: str | Path, config: EngineConfig) -> Engine:
        from export.bundle import load_bundle
        from serving.engine.runtime import ModelRuntime  # onnxruntime is imported only when a bundle is served

        runtime = ModelRuntime(
            load_bundle(bundle_dir),
            n_slots=config.max_slots,
            provider=config.provider,
            intra_op_threads=config.intra_op_threads,
        )
        return cls(runtime, config)

    # ---- public API --------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._done is None:
            loop = asyncio.get_running_loop()
            self._outbox.start(loop)
            self._done = loop.create_future()
            threading.Thread(target=self._run, args=(self._done,), name="kvserve-step", daemon=True).start()
            self._watchdog = loop.create_task(self._watch(), name="kvserve-watchdog")

    async def stop(self, drain_timeout_s: float = 30.0) -> None:
        """Stop admitting, let in-flight requests finish (cancel what is left after the timeout), stop."""
        self._accepting = False
        deadline = time.monotonic() + drain_timeout_s
        while self._live and time.monotonic() < deadline and self._done is not None and not self._done.done():
            await asyncio.sleep(0.01)
        with self._lock:
            for seq in self._live.values():
                seq.cancelled = True
            self._stopping = True
        self._wake.set()
        done, watchdog = self._done, self._watchdog  # set together by start()
        if done is not None and watchdog is not None:
            # The watchdog stays on until the thread has ended; once it gives up on a hung step (and ends), that
            # step's thread is abandoned.
            await asyncio.wait({done, watchdog}, return_when=asyncio.FIRST_COMPLETED)
            if self._hung is None:
                await done
            watchdog.cancel()
        self._done = self._watchdog = None
        self._outbox.close()

    def submit(self, req: GenerationRequest) -> RequestHandle:
        """Queue a request (or raise AdmissionRejected / InvalidRequest / EngineDead); iterate the handle."""
        with self._lock:
            if self._dead:
                raise EngineDead(
                    f"the engine is unhealthy ({self._dead_reason}) and is being replaced; retry the request"
                )
            if not self._accepting:
                raise AdmissionRejected("shutting_down", 1.0)
            if req.request_id in self._live:
                raise InvalidRequest(
                    f"request_id {req.request_id!r} is already in flight; use a unique id", field="request_id"
                )
            now = time.monotonic()
            seq = admit(req, self.request_limits, RequestHandle(req.request_id, self.cancel), now)
            self.scheduler.add([seq], now)
            self._live[seq.request_id] = seq
        self._wake.set()
        return seq.payload.handle

    def cancel(self, request_id: str) -> None:
        """Any thread; the request ends at the next step (its slot is free for the step after the one running)."""
        seq = self._live.get(request_id)
        if seq is not None:
            seq.cancelled = True
            self._wake.set()

    def reconfigure(self, config: EngineConfig) -> None:
        """Apply new batching knobs and request bounds live; the replica knobs cannot change."""
        changed = [f for f in ReplicaKnobs.model_fields if getattr(config, f) != getattr(self.config, f)]
        if changed:
            raise ValueError(
                f"{changed} cannot change on a running engine (they size buffers or sessions); "
                f"restart the replica to change them"
            )
        with self._lock:
            self.config = config
            self.scheduler.knobs = config.batching_knobs()
            self.request_limits = RequestLimits.of(self.runtime, config)
        self._wake.set()

    def add_observer(
        self, on_step: Callable[[StepStats], None] | None, on_request: Callable[[RequestStats], None] | None
    ) -> None:
        """`on_step` runs on the step thread after each step, before the next is scheduled (keep it short; it may
        call `cancel`); `on_request` runs on the event loop, before the request's final event reaches it."""
        self._observers.append((on_step, on_request))

    def snapshot(self) -> dict:
        s = self.scheduler
        return {
            "running": len(s.running),
            "waiting": len(s.waiting),
            "slots_used": s.slots_used,
            "slots_total": s.n_slots,
            "mode": s.knobs.batching.value,
            "dead": self._dead,
            "dead_reason": self._dead_reason,
            "accepting": self._accepting,
        }

    # ---- the step loop (its own thread) -------------------------------------------------------------
    def _run(self, done: asyncio.Future) -> None:
        try:
            while not self._dead and not (self._stopping and not self._live):
                self._iteration()
        except Exception as e:  # a bug in the loop itself: nothing can run any more
            log.exception("engine loop crashed")
            with self._lock:
                self._die(f"engine loop crashed: {e!r}")
        finally:
            self._outbox.hand_over()
            self._outbox.call_soon(done.set_result, None)

    def _iteration(self) -> None:
        """One step: schedule -> run -> update. The lock is held while the scheduler's state changes, never
        while ONNX Runtime computes."""
        self._wake.clear()
        with self._lock:
            if self._dead:
                return
            now = time.monotonic()
            plan = self.scheduler.schedule(now)
            for seq, reason in plan.finished:
                self._finish(seq, reason, now, release=False)
            self._runner.queue_moves(plan.moves)
            # compaction leaves no hole below decode_rows: every one of these rows is owned
            rows = cast("list[Sequence]", self.scheduler.owner[: plan.decode_rows])
            t0 = self._step_t0 = None if plan.empty else time.perf_counter()
        if t0 is None:  # an empty plan
            self._outbox.hand_over()
            if not (self._stopping and not self._live):
                self._wake.wait(plan.wake_in)
            return
        try:
            # execute() hands the last step's events over just before its first ONNX Runtime call
            outcome: StepResult | Exception = self._runner.execute(plan, rows, self._outbox.hand_over)
        except Exception as e:  # the runtime failed: fail this step's requests, maybe the engine
            outcome = e
        with self._lock:
            self._step_t0 = None
            if self._dead:  # the watchdog gave up on this step meanwhile: its results go nowhere
                return
            if isinstance(outcome, Exception):
                self._step_failed(plan, outcome)
            else:
                stats = self._update(plan, outcome, time.perf_counter() - t0)
                self._failures = 0
        if isinstance(outcome, Exception):
            self._outbox.hand_over()  # the outbox keeps the order: earlier tokens, then the failures
        else:
            self._notify(stats)

    async def _watch(self) -> None:
        """The watchdog, on the event loop: a step in flight past step_timeout_s makes the engine dead. Its
        thread cannot be stopped (an ONNX Runtime call cannot be interrupted); it is abandoned."""
        timeout = self.config.step_timeout_s
        while not self._dead:
            await asyncio.sleep(min(timeout / 4, 1.0))
            t0 = self._step_t0
            if t0 is None or time.perf_counter() - t0 <= timeout:
                continue
            with self._lock:
                if self._step_t0 != t0 or self._dead:
                    continue
                self._hung = (
                    f"a step ran {time.perf_counter() - t0:.1f}s, past step_timeout_s={timeout:g}s "
                    f"(hung ONNX Runtime call)"
                )
                log.error("engine watchdog: %s; failing every request, the replica must be replaced", self._hung)
                self._die(self._hung)
            self._outbox.hand_over()

    def _update(self, plan: StepPlan, result: StepResult, duration: float) -> StepStats:
        now = time.monotonic()
        self.scheduler.after_step(plan)
        for seq, token, info in result.tokens:
            self._accept(seq, token, now, info=info)
        for seq in result.beams:
            beam = seq.payload.beam
            if beam.done:
                hyps = beam.hypotheses()
                for tok in hyps[0][0] if hyps else ():
                    self._accept(seq, tok, now, check_stop=False)
                self._finish(seq, beam.reason, now, hypotheses=hyps)
        s = self.scheduler
        stats = StepStats(
            duration=duration,
            batch_size=plan.decode_rows + sum(c.seq.width for c in plan.prefill),
            prefill_tokens=result.prefill_tokens,
            decode_tokens=result.decode_tokens,
            running=len(s.running),
            waiting=len(s.waiting),
            slots_used=s.slots_used,
            slots_total=s.n_slots,
        )
        return stats

    def _accept(
        self, seq: Sequence, token: int, now: float, check_stop: bool = True, info: tuple | None = None
    ) -> None:
        """`info`: the token's (logprob, top ids and theirs) when the request asked for them."""
        st: RequestState = seq.payload
        if seq.phase is DONE or seq.phase is HELD:
            return
        logprob, top = info if info is not None else (None, ())
        if check_stop and token in st.end_ids:
            self._finish(seq, FinishReason.STOP, now, end=(token, logprob, top))
            return
        st.tokens.append(token)
        if st.last_token is None:  # the first token (first_token and last_token are set together)
            st.first_token = now
        else:
            st.gaps.append(now - st.last_token)
        st.last_token = now
        if info is None:
            self._outbox.emit(st.handle.put_token, token)
        else:
            self._outbox.emit(st.handle.put, TokenEvent(seq.request_id, token, logprob=logprob, top_logprobs=top))
        if check_stop and len(st.tokens) >= st.req.params.max_new_tokens:
            self._finish(seq, FinishReason.LENGTH, now)

    def _finish(
        self,
        seq: Sequence,
        reason: FinishReason,
        now: float,
        release: bool = True,
        error: str | None = None,
        hypotheses: tuple = (),
        end: tuple = (None, None, ()),
    ) -> None:
        """`end`: the stop id that ended the request, with its logprob and top ids when asked."""
        st: RequestState = seq.payload
        if release:
            self.scheduler.finish(seq, now)
        self._live.pop(seq.request_id, None)
        st.handle.finished = True
        first = seq.first_scheduled if seq.first_scheduled is not None else now
        stats = RequestStats(
            request_id=seq.request_id,
            prompt_tokens=len(st.req.prompt_ids),
            generated_tokens=len(st.tokens),
            queue_wait=first - st.submitted,
            time_to_first_token=None if st.first_token is None else st.first_token - st.submitted,
            inter_token=tuple(st.gaps),
            e2e=now - st.submitted,
            finish_reason=reason,
        )
        for _, on_request in self._observers:  # on the event loop, before the final event
            if on_request is not None:
                self._outbox.emit(on_request, stats)
        self._outbox.emit(
            st.handle.put,
            TokenEvent(
                seq.request_id,
                None,
                reason,
                hypotheses=hypotheses,
                error=error,
                end_token=end[0],
                logprob=end[1],
                top_logprobs=end[2],
            ),
        )

    def _step_failed(self, plan: StepPlan, exc: Exception) -> None:
        log.exception(
            "engine step failed (%d decode rows, %d prefill chunks)", plan.decode_rows, len(plan.prefill), exc_info=exc
        )
        self._failures += 1
        self._runner.pending = []
        if self._failures >= MAX_CONSECUTIVE_FAILURES:
            self._die(f"engine failed {self._failures} steps in a row, last: {exc!r}")
            return
        self._fail(list(self.scheduler.running), f"engine step failed: {exc!r}; retry the request")

    def _die(self, reason: str) -> None:
        """Nothing can run any more: refuse new requests, fail every waiting and running one (retryable: the
        replica's health check now fails and Ray replaces it)."""
        self._dead, self._dead_reason = True, reason
        self._fail(
            list(self.scheduler.running) + list(self.scheduler.waiting),
            f"{reason}; this replica is being replaced, retry the request",
        )

    def _fail(self, victims: list[Sequence], error: str) -> None:
        now = time.monotonic()
        for seq in victims:
            was_held = seq.phase == Phase.HELD
            self.scheduler.drop(seq)
            if not was_held:  # a held request already had its final event
                self._finish(seq, FinishReason.ERROR, now, release=False, error=error)
        for seq in [s for s in self.scheduler.running if s.phase == Phase.HELD]:
            self.scheduler.drop(seq)

    def _notify(self, stats: StepStats) -> None:
        for on_step, _ in self._observers:
            if on_step is None:
                continue
            try:
                on_step(stats)
            except Exception:  # an observer's bug must not stop the engine
                log.exception("engine observer %r failed", on_step)
