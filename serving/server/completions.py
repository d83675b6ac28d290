"""OpenAI's /v1/completions beyond one plain answer: `n`, `best_of`, `echo`, `logprobs`, penalties, `logit_bias`.

Owns: the engine parameters of a completion body, its candidates (each prompt's `best_of` sequences, the i-th
sampled with `seed + i` when a seed is given, so a choice equals the same request with n=1 and that seed),
ranking them (OpenAI: the highest log-probability per token; the `n` best are returned), OpenAI's legacy
`logprobs` object (tokens, token_logprobs, top_logprobs, text_offset), `echo` (the prompt starts the text; with
`logprobs` its tokens are scored too: serving/server/service.py feeds them as forced tokens), and the stream of
several choices at once (their chunks interleaved as they come, each naming its choice's index).

Does not own: the route, limits and versions (serving/server/api.py), the SSE framing and deadline backstop
(serving/server/stream.py), token log-probabilities themselves (serving/engine/).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from serving.engine.types import SamplingParams
from serving.server.errors import ErrorKind, ServiceError
from serving.server.schemas import CompletionRequest
from serving.server.stream import Chunk, chunks_of, close_stream, error_event, openai_finish, usage_of
from serving.server.text_types import StreamPiece, TextRequest, TextResult, TokenLogprob


@dataclass(frozen=True)
class Candidate:
    prompt: int  # index of its prompt
    request: TextRequest


def params_of(body: CompletionRequest, max_new_tokens: int, stops: tuple[str, ...]) -> SamplingParams:
    bias = tuple((int(k), float(v)) for k, v in (body.logit_bias or {}).items())
    ranked = body.best_of is not None and body.best_of > body.n  # ranking needs each token's logprob
    logprobs = body.logprobs if body.logprobs is not None else (0 if ranked else None)
    return SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        stop_strings=stops,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        logit_bias=bias,
        min_tokens=body.min_tokens,
    )


def candidates(
    body: CompletionRequest,
    prompts: list[str],
    make: Callable[..., TextRequest],
    params: SamplingParams,
    max_texts: int,
) -> list[Candidate]:
    """Each prompt's best_of (default n) requests; `make(text, params, echo=...)` builds one."""
    per_prompt = body.best_of or body.n
    if per_prompt * len(prompts) > max_texts:
        raise ServiceError(
            ErrorKind.TOO_LARGE,
            f"{len(prompts)} prompt(s) x {per_prompt} sequences (best_of or n) = "
            f"{per_prompt * len(prompts)} sequences; the limit per request is {max_texts}",
            field="best_of" if body.best_of else "n",
        )
    echo_scored = body.echo and body.logprobs is not None
    out = []
    for p, text in enumerate(prompts):
        for i in range(per_prompt):
            seeded = replace(params, seed=None if params.seed is None else params.seed + i)
            out.append(Candidate(p, make(text, seeded, echo=echo_scored)))
    return out


def choices(
    body: CompletionRequest, prompts: list[str], cands: list[Candidate], results: list[TextResult]
) -> list[dict[str, Any]]:
    """OpenAI's choices: per prompt, its n best candidates (all of them without best_of), indexed in order."""
    out: list[dict[str, Any]] = []
    for p, prompt in enumerate(prompts):
        mine = [r for c, r in zip(cands, results, strict=True) if c.prompt == p]
        if len(mine) > body.n:  # best_of: the highest log-probability per token first (stable: seed order on ties)
            mine = sorted(mine, key=lambda r: -_mean_logprob(r))[: body.n]
        for r in mine:
            out.append(_choice(body, prompt, r, len(out)))
    return out


def usage(cands: list[Candidate], results: list[TextResult]) -> dict[str, int]:
    """Each prompt's tokens once, every candidate's generated tokens (best_of's discarded ones too)."""
    prompt = sum(
        r.prompt_tokens
        for i, (c, r) in enumerate(zip(cands, results, strict=True))
        if i == 0 or cands[i - 1].prompt != c.prompt
    )
    completion = sum(r.completion_tokens for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _mean_logprob(r: TextResult) -> float:
    scored = r.logprobs[r.forced :]
    return sum(lp for _, lp, _ in scored) / len(scored) if scored else 0.0


def _choice(body: CompletionRequest, prompt: str, r: TextResult, index: int) -> dict[str, Any]:
    scored_prompt = body.echo and body.logprobs is not None  # the text already starts with the prompt
    text = r.text if scored_prompt or not body.echo else prompt + r.text
    entries = r.logprobs if scored_prompt else r.logprobs[r.forced :]
    logprobs = None
    if body.logprobs is not None:
        start = len(prompt) if body.echo and not scored_prompt else 0
        logprobs = logprobs_object(entries, start)
    return {"text": text, "index": index, "logprobs": logprobs, "finish_reason": openai_finish(r.finish_reason)}


def logprobs_object(entries: tuple[TokenLogprob, ...] | list[TokenLogprob], offset: int = 0) -> dict[str, list]:
    """OpenAI's legacy logprobs: each token's text, its logprob, the most likely tokens' (the chosen one among
    them, as vLLM gives it) and its character offset in the choice's text."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for text, lp, top in entries:
        out["tokens"].append(text)
        out["token_logprobs"].append(lp)
        alternatives = dict(top)
        alternatives.setdefault(text, lp)
        out["top_logprobs"].append(alternatives)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


async def stream_choices(
    body: CompletionRequest,
    prompt: str,
    streams: list[tuple[Chunk | None, AsyncIterator[Chunk]]],
    head: dict[str, Any],
    deadline_wall: float,
) -> AsyncIterator[list[dict | str]]:
    """OpenAI's chunks of `n` streamed choices, interleaved as they come; a usage chunk if asked; `[DONE]`."""
    queue: asyncio.Queue[tuple[int, Chunk | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, first: Chunk | None, rest: AsyncIterator[Chunk]) -> None:
        try:
            async for chunk in chunks_of(first, rest, deadline_wall):
                queue.put_nowait((index, chunk))
            queue.put_nowait((index, None))
        except Exception as e:  # handed to the consumer, which ends the stream with an error event
            queue.put_nowait((index, e))

    def event(index: int, text: str, finish: str | None, logprobs: dict | None) -> dict[str, Any]:
        return {**head, "choices": [{"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish}]}

    tasks = [asyncio.ensure_future(pump(i, first, rest)) for i, (first, rest) in enumerate(streams)]
    offsets, results, open_ = [0] * len(streams), [], len(streams)
    try:
        if body.echo and body.logprobs is None:  # echo's text, before any token
            yield [event(i, prompt, None, None) for i in range(len(streams))]
            offsets = [len(prompt)] * len(streams)
        while open_:
            index, item = await queue.get()
            if item is None:
                open_ -= 1
                continue
            if isinstance(item, BaseException):
                yield [error_event(item)]
                break
            out: list[dict | str] = []
            for piece in item:
                if isinstance(piece, StreamPiece):
                    lp = None
                    if body.logprobs is not None and piece.logprob is not None:
                        lp = logprobs_object([piece.logprob], offsets[index])
                        offsets[index] += len(piece.logprob[0])
                    if piece.text or lp is not None:
                        out.append(event(index, piece.text, None, lp))
                else:
                    results.append(piece)
                    out.append(event(index, "", openai_finish(piece.finish_reason), None))
            if out:
                yield out
        if (body.stream_options or {}).get("include_usage") and results:
            usage = [usage_of(r) for r in results]
            total = {k: sum(u[k] for u in usage) for k in usage[0]}
            total["prompt_tokens"] = usage[0]["prompt_tokens"]  # one prompt, streamed n times
            total["total_tokens"] = total["prompt_tokens"] + total["completion_tokens"]
            yield [{**head, "choices": [], "usage": total}]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    yield ["[DONE]"]


async def start_all(
    starts: list[Awaitable[tuple[Chunk | None, AsyncIterator[Chunk]]]],
) -> list[tuple[Chunk | None, AsyncIterator[Chunk]]]:
    """Every stream's first chunk (a refusal of any is the request's HTTP status; the others are closed)."""
    tasks = [asyncio.ensure_future(s) for s in starts]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        for t in tasks:
            if t.done() and not t.cancelled() and t.exception() is None:
                await close_stream(t.result()[1])
        raise
