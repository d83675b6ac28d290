"""The engine's public vocabulary: requests, parameters, streamed events, finish reasons and errors.

Shared by the engine (serving/engine*.py), the HTTP layer (serving/server/api.py, serving/server/app.py) and tests.
Token ids only: tokenizing happens at the edge. No torch, no Ray, no FastAPI here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class FinishReason(str, Enum):
    LENGTH = "length"  # max_new_tokens reached (or the KV cache is full)
    STOP = "stop"  # end-of-sequence, a stop token id or a stop string
    CANCELLED = "cancelled"  # the client went away or cancelled
    DEADLINE = "deadline"  # the request's deadline passed
    ERROR = "error"  # the engine failed on this request


class BatchingMode(str, Enum):
    CONTINUOUS = "continuous"  # iteration-level: join at the next step, leave when done
    REQUEST = "request"  # request-level dynamic batching: gather N or wait T, run the batch to its end
    NONE = "none"  # one request at a time


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    repetition_penalty: float = 1.0  # 1 = off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()  # checked by the caller's detokenizer hook, see Request.stop_checker
    beam_size: int = 1  # > 1: beam search (encoder-decoder models), greedy within beams
    length_penalty: float = 1.0  # beam score = logprob / len**length_penalty
    n_best: int = 1  # hypotheses returned by beam search (<= beam_size)
    ignore_eos: bool = False  # benchmarks: eos does not stop the request (it runs to max_new_tokens)
    # Log-probabilities (of the model's distribution, before temperature, penalties and biases): None = off;
    # k >= 0 = each token's own and the k most likely ids' (TokenEvent.logprob / top_logprobs).
    logprobs: int | None = None
    presence_penalty: float = 0.0  # OpenAI's: subtracted from every id already generated
    frequency_penalty: float = 0.0  # OpenAI's: subtracted once per time an id was generated
    logit_bias: tuple[tuple[int, float], ...] = ()  # (id, bias) added to the logits
    min_tokens: int = 0  # eos and the stop ids are banned until this many tokens were generated
    no_repeat_ngram_size: int = 0  # > 0: no n-gram of this size occurs twice among the decoder's tokens
    # Tokens the request emits first whatever the model prefers (teacher forcing), each with its log-probability
    # when asked: a forced translation prefix, scoring a given text, a prompt's own log-probabilities.
    forced_ids: tuple[int, ...] = ()


@dataclass
class GenerationRequest:
    request_id: str
    # Decoder-only: the prompt, starting with the bos id (the API layer prepends it, as in training).
    # Encoder-decoder: the source sentence without special tokens; the engine starts the decoder with bos.
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    deadline: float | None = None  # time.monotonic() after which the request finishes with DEADLINE
    # Lower is served first (vLLM's convention; 0 by default): a waiting request is admitted before those of a
    # higher number, and a request above 0 (bulk work) may fill only part of the waiting queue (scheduler.py).
    priority: int = 0


@dataclass(frozen=True)
class TokenEvent:
    """One streamed item. `token_id` is None on the final event, which carries `finish_reason`."""

    request_id: str
    token_id: int | None
    finish_reason: FinishReason | None = None
    # On the final event of a beam-search request: the n-best hypotheses (token ids, score), best first.
    hypotheses: tuple[tuple[tuple[int, ...], float], ...] = ()
    error: str | None = None
    # With SamplingParams.logprobs: the token's log-probability and the most likely ids' (best first). On a
    # final event that a stop id ended, those of the stop id (`end_token`), which is not streamed as a token.
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    end_token: int | None = None


@dataclass(frozen=True)
class RequestStats:
    """Per-request timings (seconds), emitted once when a request finishes, for the metrics layer."""

    request_id: str
    prompt_tokens: int
    generated_tokens: int
    queue_wait: float  # submit -> first scheduled
    time_to_first_token: float | None  # submit -> first token
    inter_token: tuple[float, ...]  # gaps between consecutive tokens
    e2e: float  # submit -> finished
    finish_reason: FinishReason


@dataclass(frozen=True)
class StepStats:
    """One engine step, for the metrics layer."""

    duration: float
    batch_size: int  # rows (slots) run in this step
    prefill_tokens: int
    decode_tokens: int
    running: int
    waiting: int
    slots_used: int
    slots_total: int


class EngineError(Exception):
    """Base of the errors the HTTP layer maps to status codes (in one place, serving/server/errors.py)."""


class AdmissionRejected(EngineError):
    """The engine is full (slots, waiting queue or token budget): HTTP 429 with Retry-After."""

    def __init__(self, reason: str, retry_after_s: float) -> None:
        super().__init__(f"server overloaded ({reason}); retry after {retry_after_s:.1f}s")
        self.reason, self.retry_after_s = reason, retry_after_s


class InvalidRequest(EngineError):
    """The request cannot be served as given (e.g. prompt longer than the KV cache): HTTP 422/413.

    `field` names the GenerationRequest field at fault in the engine's terms (prompt_ids, max_new_tokens,
    beam_size, ... as in SamplingParams); the server translates it to its API field name."""

    def __init__(self, message: str, field: str | None = None, too_large: bool = False) -> None:
        super().__init__(message)
        self.field, self.too_large = field, too_large

    def __reduce__(self) -> tuple:  # pickles across Ray with its fields
        return InvalidRequest, (str(self), self.field, self.too_large)


class EngineDead(EngineError):
    """The engine's step loop failed and cannot continue: HTTP 503."""
