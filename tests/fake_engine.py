"""A scripted stand-in for serving.engine.engine.Engine, for unit tests of the HTTP/service layers (not the engine).

It follows the engine interface (submit / cancel / add_observer / snapshot, RequestHandle
iteration, stats to observers) and lets a test dictate what the engine does: the reply tokens, a delay per
token, when it refuses (capacity -> AdmissionRejected), and prompts it rejects as too long. It records
which requests were cancelled, so tests can check that the API layer frees engine work (stop strings,
disconnects). The real engine is exercised in tests/test_engine.py and tests/test_server_integration.py.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from model.tokenizer import Tokenizer
from serving.engine.types import (AdmissionRejected, FinishReason, GenerationRequest, InvalidRequest, RequestStats,
                           StepStats, TokenEvent)

CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, goodbye world. STOP here",
          "der schnelle braune fuchs springt", "ünïcödé and emoji 🙂 text"] * 6


def tiny_tokenizer() -> Tokenizer:
    return Tokenizer.train(CORPUS, vocab_size=320)


class FakeHandle:
    def __init__(self, engine: "FakeEngine", req: GenerationRequest) -> None:
        self.engine, self.req, self.request_id = engine, req, req.request_id
        self.cancelled = False

    def cancel(self) -> None:
        self.engine.cancel(self.request_id)

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        return self.engine._run(self)


class FakeEngine:
    def __init__(self, tok: Tokenizer, reply: str, encoder_decoder: bool = False, delay_s: float = 0.0,
                 capacity: int = 100, max_len: int = 64) -> None:
        self.tok, self.is_encoder_decoder = tok, encoder_decoder
        self.reply_ids = tok.encode(reply)
        self.delay_s, self.capacity, self.max_len = delay_s, capacity, max_len
        self.eos_id = tok.eos_id
        self.active: dict[str, FakeHandle] = {}
        self.cancelled: list[str] = []
        self.submitted: list[GenerationRequest] = []
        self.observers: list = []
        self.dead = False  # what the real engine reports once its watchdog or repeated step failures killed it

    def submit(self, req: GenerationRequest) -> FakeHandle:
        if len(self.active) >= self.capacity:
            raise AdmissionRejected("queue_full", 2.0)
        if req.params.beam_size > 1 and not self.is_encoder_decoder:
            raise InvalidRequest(f"beam_size={req.params.beam_size}: beam search is for translation models",
                                 field="beam_size")
        if len(req.prompt_ids) + req.params.max_new_tokens > self.max_len:
            raise InvalidRequest(f"prompt of {len(req.prompt_ids)} tokens + max_new_tokens="
                                 f"{req.params.max_new_tokens} exceeds the KV cache of {self.max_len}",
                                 field="max_new_tokens", too_large=True)
        handle = FakeHandle(self, req)
        self.active[req.request_id] = handle
        self.submitted.append(req)
        return handle

    def cancel(self, request_id: str) -> None:
        handle = self.active.get(request_id)
        if handle is not None and not handle.cancelled:
            handle.cancelled = True
            self.cancelled.append(request_id)

    def add_observer(self, on_step, on_request) -> None:
        self.observers.append((on_step, on_request))

    def snapshot(self) -> dict:
        return {"running": len(self.active), "waiting": 0, "slots_used": len(self.active), "slots_total": 8,
                "dead": self.dead}

    async def _run(self, h: FakeHandle) -> AsyncIterator[TokenEvent]:
        req, start, n, gaps, last = h.req, time.monotonic(), 0, [], None
        reason = FinishReason.STOP
        try:
            for tid in self.reply_ids[: req.params.max_new_tokens]:
                await asyncio.sleep(self.delay_s)
                if h.cancelled:
                    reason = FinishReason.CANCELLED
                    break
                if req.deadline is not None and time.monotonic() > req.deadline:
                    reason = FinishReason.DEADLINE
                    break
                now = time.monotonic()
                gaps += [now - last] if last is not None else []
                last, n = now, n + 1
                self._step()
                if req.params.beam_size == 1:
                    yield TokenEvent(req.request_id, tid)
            else:
                reason = FinishReason.LENGTH if req.params.max_new_tokens < len(self.reply_ids) else reason
            hyps = ()
            if req.params.beam_size > 1:
                best = tuple(self.reply_ids[: req.params.max_new_tokens])
                hyps = tuple((best[: len(best) - k], -0.5 * (k + 1)) for k in range(req.params.n_best))
            self._finish(req, n, start, gaps, reason)
            yield TokenEvent(req.request_id, None, reason, hypotheses=hyps)
        finally:
            self.active.pop(req.request_id, None)

    def _step(self) -> None:
        s = StepStats(duration=0.001, batch_size=len(self.active), prefill_tokens=0, decode_tokens=1,
                      running=len(self.active), waiting=0, slots_used=len(self.active), slots_total=8)
        for on_step, _ in self.observers:
            on_step and on_step(s)

    def _finish(self, req: GenerationRequest, n: int, start: float, gaps: list, reason: FinishReason) -> None:
        now = time.monotonic()
        s = RequestStats(request_id=req.request_id, prompt_tokens=len(req.prompt_ids), generated_tokens=n,
                         queue_wait=0.0005, time_to_first_token=(now - start) if n else None,
                         inter_token=tuple(gaps), e2e=now - start, finish_reason=reason)
        for _, on_request in self.observers:
            on_request and on_request(s)
