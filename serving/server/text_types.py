"""What a model replica is asked and answers, as plain data that pickles (it crosses Ray's process boundaries):
`TextRequest`, `TextResult`, `StreamPiece` (one streamed piece of text) and a token's log-probabilities
(`TokenLogprob`).

serving/server/service.py's `ModelService` turns a TextRequest into pieces and a TextResult; the API
(serving/server/api.py) builds the requests and shapes the answers. Does not own: errors (`ServiceError`,
serving/server/errors.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from serving.engine.types import SamplingParams


@dataclass(frozen=True)
class TextRequest:
    text: str
    params: SamplingParams
    deadline_wall: float  # time.time() after which the request fails with 504 (wall clock: crosses processes)
    field: str = "prompt"  # the request field that holds `text`, for error messages
    request_id: str = ""
    version: str | None = None  # the model version the client named (`model@version`); None: any
    traceparent: str = ""  # the W3C trace context of the request's span ("" when tracing is off)
    client_request_id: str = ""  # the request's X-Request-Id, for its spans
    priority: int = 0  # lower first (serving/engine/types.py GenerationRequest.priority)
    # Forced tokens (teacher forcing, each scored when params.logprobs is set): `echo` feeds a language model's
    # prompt as forced tokens after bos (its own log-probabilities; the text starts with it); `prefix` is a start
    # the answer must continue (a translation's target prefix); `score` ends the forced text with eos and
    # generates nothing (scoring a given text: params.max_new_tokens is ignored).
    echo: bool = False
    prefix: str = ""
    score: bool = False
    cache: bool = True  # may be answered from the replica's response cache (False: Cache-Control: no-cache)
    arrival_wall: float | None = None  # time.time() when the ingress received the request (server-side TTFT)


# One token's log-probabilities as the API shows them: (its text, its logprob, the most likely tokens' (text,
# logprob), best first).
TokenLogprob = tuple[str, float, tuple[tuple[str, float], ...]]


@dataclass(frozen=True)
class TextResult:
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    queue_s: float | None
    ttft_s: float | None
    total_s: float
    n_best: tuple[tuple[str, float], ...] = ()
    version: str = ""  # the version of the model that answered (its bundle's)
    logprobs: tuple[TokenLogprob, ...] = ()  # with params.logprobs: every token of `text`, forced ones first
    forced: int = 0  # how many of those tokens were forced (the prompt with `echo`, the prefix)
    end_logprob: float | None = None  # with params.logprobs: that of the eos or stop id that ended the text
    cached: bool = False  # answered from the response cache (serving/server/response_cache.py)
    server_ttft_s: float | None = None  # the ingress's arrival to the first token (the hops and queues included)


@dataclass(frozen=True)
class StreamPiece:
    """One streamed piece of text: the text released after token `index` (may be '' while held back).
    The first piece of a stream names the model version that answers (the X-Model-Version header)."""

    text: str
    index: int
    version: str = ""
    logprob: TokenLogprob | None = None  # the token's, with params.logprobs


def answering_version(item: object) -> str:
    """The model version a streamed item names ('' for pieces after the first)."""
    return getattr(item, "version", "")


def is_result(item: object) -> bool:
    """Whether a streamed item is the request's last one (its TextResult)."""
    return isinstance(item, TextResult)
