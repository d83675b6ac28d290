"""Text in, text out around one Engine: what a model replica serves, without Ray or HTTP.

Owns: tokenizing prompts (with the bundle's tokenizer), the prompt-size limit, deadlines, streaming text
through `IncrementalDecoder`, stop strings (held back while they might still match, the engine request
cancelled the moment one appears), n-best decoding of beam hypotheses, usage and timings, per-request
metrics from the engine's observers.

Does not own: errors (serving/server/errors.py owns `ServiceError`, turns engine errors into one with the API's field
names, and maps its `ErrorKind` to an HTTP status), Ray (serving/server/replica.py wraps this class in a deployment), or
scheduling and batching (serving/engine/). Everything that crosses a process boundary here (`TextRequest`, `TextResult`,
`StreamPiece`: serving/server/text_types.py, importable from here too; `ServiceError`) pickles.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import replace
from typing import Any, Protocol

from model.tokenizer import IncrementalDecoder, Tokenizer
from serving.engine.types import (
    EngineError,
    FinishReason,
    GenerationRequest,
    RequestStats,
    SamplingParams,
    StepStats,
    TokenEvent,
)
from serving.server import tracing
from serving.server.errors import ErrorKind, ServiceError, from_engine
from serving.server.metrics import Recorder
from serving.server.stops import StopMatcher
from serving.server.text_types import StreamPiece, TextRequest, TextResult, TokenLogprob
from serving.server.text_types import answering_version as answering_version  # re-exported
from serving.server.text_types import is_result as is_result  # re-exported


class EngineLike(Protocol):
    is_encoder_decoder: bool

    def submit(self, req: GenerationRequest) -> Any: ...
    def add_observer(
        self, on_step: Callable[[StepStats], None] | None, on_request: Callable[[RequestStats], None] | None
    ) -> None: ...
    def snapshot(self) -> dict: ...


class ModelService:
    """Serves one model: `complete` (whole answer) and `stream` (pieces, then the TextResult)."""

    def __init__(
        self,
        name: str,
        engine: EngineLike,
        tokenizer: Tokenizer,
        max_prompt_tokens: int,
        recorder: Recorder | None = None,
        version: str = "",
    ) -> None:
        self.name, self.engine, self.tok, self.version = name, engine, tokenizer, version
        self.max_prompt_tokens = max_prompt_tokens
        self.recorder = recorder
        self.labels = {"model": name, "version": version}  # of every metric this service records
        # The engine's stats of each request whose stream is still open (None until they arrive; its result
        # reads queue_wait): a request whose client left never collects them, so none are kept past the stream.
        self._stats: dict[str, RequestStats | None] = {}
        engine.add_observer(self._on_step, self._on_request)

    @property
    def task(self) -> str:
        return "translate" if self.engine.is_encoder_decoder else "generate"

    # -- public API ---------------------------------------------------------------------------------
    async def complete(self, req: TextRequest) -> TextResult:
        """The whole answer. Without stop strings (which end a request early, token by token) the engine's events
        are taken at once when the request finishes (`RequestHandle.gathered`): one wake-up, not one per token."""
        result = None
        async for item in self.stream(req, gather=not req.params.stop_strings):
            if isinstance(item, TextResult):
                result = item
        assert result is not None, "stream ended without a result"
        if result.finish_reason == FinishReason.DEADLINE.value:
            raise ServiceError(
                ErrorKind.DEADLINE,
                f"request passed its deadline after {result.total_s:.2f}s "
                f"({result.completion_tokens} tokens generated)",
            )
        return result

    async def stream(self, req: TextRequest, gather: bool = False) -> AsyncGenerator[StreamPiece | TextResult, None]:
        """Pieces of text as tokens arrive, then one TextResult. Raises ServiceError before the first piece.
        `gather`: the pieces come at the end, all at once (`complete`); the timings are the same."""
        gen, started = self._prepare(req), time.monotonic()
        matcher = StopMatcher(req.params.stop_strings)
        decoder = IncrementalDecoder(self.tok)
        text, index, ttft, finish, handle, done = "", 0, None, FinishReason.LENGTH, None, False
        hyps: tuple[tuple[tuple[int, ...], float], ...] = ()  # a beam search's n best (ids, score)
        events, stats, scored, end_lp, server_ttft = None, None, [], None, None
        n_forced = len(gen.params.forced_ids)
        self._stats[gen.request_id] = None
        try:
            events, handle = self._events(gen, req.field, gather)
            async for ev in events:
                if ev.token_id is None:  # the final event
                    done, finish, hyps, end_lp = True, ev.finish_reason or FinishReason.STOP, ev.hypotheses, ev.logprob
                    if ev.error:
                        raise ServiceError(ErrorKind.UNAVAILABLE, f"engine failed on this request: {ev.error}")
                    break
                if ttft is None:
                    ttft, server_ttft = self._first_token(req, handle, started)
                piece = decoder.push(ev.token_id)
                # forced text is the client's: stop strings are looked for in what the model generates
                released, stopped = (piece, False) if index < n_forced else matcher.push(piece)
                text += released
                lp = self._logprob(piece, ev.logprob, ev.top_logprobs) if ev.logprob is not None else None
                if lp is not None:
                    scored.append(lp)
                yield StreamPiece(released, index, self.version if index == 0 else "", lp)
                index += 1
                if stopped:
                    finish = FinishReason.STOP
                    self._count_cancel("stop_string")
                    break
            if not matcher.stopped:  # the decoder may hold an incomplete character; the matcher, a prefix
                rest = self.tok.decode(decoder.ids)[len(decoder.emitted) :]
                tail, stopped = matcher.push(rest) if rest else ("", False)
                finish = FinishReason.STOP if stopped else finish
                tail += "" if stopped else matcher.flush()
                if tail:
                    text += tail
                    yield StreamPiece(tail, max(index - 1, 0))
        except (GeneratorExit, asyncio.CancelledError):  # the caller went away (or gave up at the deadline)
            self._count_cancel("deadline" if time.time() >= req.deadline_wall else "disconnect")
            raise
        finally:
            stats = self._stats.pop(gen.request_id, None)  # before any await: a cancelled caller may not pass one
            if handle is not None and not done:  # stop string, client gone or error: free the slot now
                _cancel_quietly(handle)
            if events is not None:
                await events.aclose()
        result = self._result(gen, req, text, index, finish, hyps, ttft, started, stats)
        yield replace(
            result,
            logprobs=tuple(scored),
            forced=n_forced,
            end_logprob=end_lp,
            server_ttft_s=server_ttft,
            completion_tokens=result.completion_tokens - min(n_forced, index),
        )

    def tokenize(self, text: str, add_special_tokens: bool = True) -> dict[str, Any]:
        """The ids the model reads for `text` (vLLM's /tokenize answer): with `add_special_tokens`, a language
        model's prompt starts with bos, as a request's does."""
        ids = self.tok.encode(text)
        if add_special_tokens and not self.engine.is_encoder_decoder:
            ids = [_special(self.tok.bos_id)] + ids
        return {"tokens": ids, "count": len(ids), "max_model_len": getattr(self.engine, "max_len", None)}

    def detokenize(self, ids: list[int]) -> str:
        bad = [i for i in ids if not 0 <= i < self.tok.vocab_size]
        if bad:
            raise ServiceError(
                ErrorKind.INVALID,
                f"tokens holds ids outside the vocabulary [0, {self.tok.vocab_size}): {bad[:5]}",
                field="tokens",
            )
        return self.tok.decode(ids)

    # -- internals ------------------------------------------------------------------------------------
    def _first_token(self, req: TextRequest, handle: Any, started: float) -> tuple[float, float | None]:
        """(ttft, server-side ttft) of the request's first token: when it reached this event loop."""
        at, wall = getattr(handle, "first_at", None) or (time.monotonic(), time.time())
        return at - started, self._server_ttft(req, wall)

    def _server_ttft(self, req: TextRequest, first_wall: float) -> float | None:
        """The ingress's arrival to the first token (wall clocks: the ingress may be another process or node)."""
        if req.arrival_wall is None:
            return None
        seconds = max(0.0, first_wall - req.arrival_wall)
        if self.recorder:
            self.recorder.observe("kvserve_server_time_to_first_token_seconds", self.labels, seconds)
        return seconds

    def _logprob(self, piece: str, logprob: float, top: tuple[tuple[int, float], ...]) -> TokenLogprob:
        """The token's text as it appears in the answer, and its alternatives' texts (each decoded alone)."""
        return piece, logprob, tuple((self.tok.token_bytes(i), lp) for i, lp in top)

    def _forced(self, req: TextRequest, ids: list[int]) -> tuple[list[int], SamplingParams]:
        """The engine's prompt and params for a request with forced tokens (TextRequest.echo/prefix/score)."""
        p = req.params
        if not (req.echo or req.prefix or req.score):
            return ids, p
        forced: list[int] = []
        if req.echo and not self.engine.is_encoder_decoder:
            forced, ids = ids[1:], ids[:1]  # after bos, the prompt is forced: each of its tokens scored
        forced += self.tok.encode(req.prefix) if req.prefix else []
        if req.score:
            forced.append(_special(self.tok.eos_id))
        new = len(forced) if req.score else len(forced) + p.max_new_tokens
        return ids, replace(
            p,
            forced_ids=tuple(forced),
            max_new_tokens=new,
            min_tokens=p.min_tokens + len(forced) if p.min_tokens else 0,
        )

    def _prepare(self, req: TextRequest) -> GenerationRequest:
        if req.version is not None and req.version != self.version:  # reached a replica of another version
            raise ServiceError(
                ErrorKind.NOT_FOUND,
                f"model {self.name}@{req.version} is not served here: this "
                f"replica serves version {self.version} (the version was replaced, or is being "
                f"rolled out); name the model without a version, or one of GET /v1/models",
                field="model",
            )
        remaining = req.deadline_wall - time.time()
        if remaining <= 0:
            raise ServiceError(ErrorKind.DEADLINE, "request deadline passed before it reached the model")
        ids = self.tok.encode(req.text)
        if len(ids) > self.max_prompt_tokens:
            raise ServiceError(
                ErrorKind.TOO_LARGE,
                f"{req.field} has {len(ids)} tokens; the limit is {self.max_prompt_tokens}. Shorten it.",
                field=req.field,
            )
        if not self.engine.is_encoder_decoder:
            ids = [_special(self.tok.bos_id)] + ids  # an LM sequence starts with bos (model/decode.py)
        elif not ids:
            ids = [_special(self.tok.pad_id)]  # an empty source is one pad token, as export/evaluate.py encodes it
        ids, params = self._forced(req, ids)
        return GenerationRequest(
            request_id=req.request_id or uuid.uuid4().hex,
            prompt_ids=ids,
            params=params,
            deadline=time.monotonic() + remaining,
            priority=req.priority,
        )

    def _events(
        self, gen: GenerationRequest, text_field: str, gather: bool = False
    ) -> tuple[AsyncGenerator[TokenEvent, None], Any]:
        """The request's events (all at once at the end with `gather`) and its engine handle; `text_field` names
        the prompt in a refusal."""
        try:
            handle = self.engine.submit(gen)
        except EngineError as e:
            raise from_engine(e, self.name, text_field) from e
        return handle.gathered() if gather else handle.__aiter__(), handle

    def _result(
        self,
        gen: GenerationRequest,
        req: TextRequest,
        text: str,
        n_tokens: int,
        finish: FinishReason,
        hyps: tuple,
        ttft: float | None,
        started: float,
        stats: RequestStats | None,
    ) -> TextResult:
        if finish == FinishReason.DEADLINE and n_tokens == 0 and not hyps:
            raise ServiceError(
                ErrorKind.DEADLINE,
                f"request passed its deadline ({time.monotonic() - started:.2f}s) before producing a token",
            )
        n_best: tuple[tuple[str, float], ...] = ()
        if hyps:  # beam search: the best hypothesis is the answer
            n_best = tuple((self.tok.decode(ids), float(score)) for ids, score in hyps[: req.params.n_best])
            text, n_tokens = n_best[0][0], len([i for i in hyps[0][0] if i != self.tok.eos_id])
            text = StopMatcher(req.params.stop_strings).trim(text)
        prompt_tokens = self._user_tokens(gen) + len(gen.params.forced_ids) - req.score  # forced: the client's
        tracing.record_engine(req.traceparent, self.name, req.client_request_id, stats)
        return TextResult(
            text=text,
            finish_reason=finish.value,
            prompt_tokens=prompt_tokens,
            completion_tokens=n_tokens,
            queue_s=stats.queue_wait if stats else None,
            ttft_s=ttft,
            total_s=time.monotonic() - started,
            n_best=n_best,
            version=self.version,
        )

    def _user_tokens(self, gen: GenerationRequest) -> int:
        """Prompt tokens as the user counts them: without the bos or the pad of an empty source."""
        if self.engine.is_encoder_decoder:
            return 0 if gen.prompt_ids == [self.tok.pad_id] else len(gen.prompt_ids)
        return len(gen.prompt_ids) - 1

    def _count_cancel(self, reason: str) -> None:
        if self.recorder:
            self.recorder.inc("kvserve_cancellations_total", {**self.labels, "reason": reason})

    def _on_request(self, s: RequestStats) -> None:
        if s.request_id in self._stats:  # its stream is open
            self._stats[s.request_id] = s
        if self.recorder is None:
            return
        m, r = self.labels, self.recorder
        r.inc("kvserve_prompt_tokens_total", m, s.prompt_tokens)
        r.inc("kvserve_generated_tokens_total", m, s.generated_tokens)
        r.observe("kvserve_queue_wait_seconds", m, s.queue_wait)
        if s.time_to_first_token is not None:
            r.observe("kvserve_time_to_first_token_seconds", m, s.time_to_first_token)
        for gap in s.inter_token:
            r.observe("kvserve_inter_token_latency_seconds", m, gap)
        if s.finish_reason == FinishReason.DEADLINE:
            self._count_cancel("deadline")

    def _on_step(self, s: StepStats) -> None:
        if self.recorder is None:
            return
        m, r = self.labels, self.recorder
        r.observe("kvserve_engine_step_duration_seconds", m, s.duration)
        r.observe("kvserve_engine_batch_size", m, s.batch_size)
        self.record_gauges(
            {"running": s.running, "waiting": s.waiting, "slots_used": s.slots_used, "slots_total": s.slots_total}
        )

    def record_gauges(self, snap: dict | None = None) -> None:
        """Running/waiting/slot gauges from a step or `engine.snapshot()` (the deployment polls when idle)."""
        if self.recorder is None:
            return
        snap = snap if snap is not None else self.engine.snapshot()
        m = self.labels
        for key, metric in (
            ("running", "kvserve_running_requests"),
            ("waiting", "kvserve_waiting_requests"),
            ("slots_used", "kvserve_kv_slots_used"),
            ("slots_total", "kvserve_kv_slots_capacity"),
        ):
            if key in snap:
                self.recorder.set(metric, m, float(snap[key]))


def _special(token_id: int | None) -> int:
    """A special token's id (the tokenizers refuse to load without their bos, eos and pad)."""
    assert token_id is not None, "the tokenizer lacks a special token"
    return token_id


def _cancel_quietly(handle: Any) -> None:
    try:
        handle.cancel()
    except Exception:  # the request already finished: nothing to cancel
        pass
