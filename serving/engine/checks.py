"""Request validation at submit time: a request the engine cannot serve is refused before it waits.

Owns: the checks of a GenerationRequest against the model (vocabulary, KV cache length, architecture) and
the engine's limits, each failing with InvalidRequest naming the field, the value, the limit and the fix;
and the construction of the request's engine state (decoder prompt, stop ids, generator, beam search) and of
its scheduler Sequence (`admit`).

Does not own: admission bounds (serving/engine/scheduler.py), HTTP status codes (serving/server/errors.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from serving.engine.beam import BeamSearch
from serving.engine.config import EngineConfig
from serving.engine.handle import RequestHandle
from serving.engine.runner import RequestState
from serving.engine.sampling import adjusts_logits, is_plain_greedy, is_plain_sampling, make_generator
from serving.engine.scheduler import Sequence
from serving.engine.types import GenerationRequest, InvalidRequest, SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    """What a request is checked against: the model's facts and the engine's request bounds."""

    vocab_size: int
    bos_id: int
    eos_id: int
    max_len: int  # decoder KV cache length
    max_src_len: int  # longest source (encoder-decoder); = max_len for a decoder-only model
    is_encoder_decoder: bool
    max_prompt_tokens: int
    max_new_tokens: int
    max_beam_size: int  # min(the config's max_beam_size, the engine's KV slots)
    banned_ids: tuple[int, ...] = ()  # token ids the model never generates (the bundle's generation.banned_ids)

    @classmethod
    def of(cls, runtime: Any, config: EngineConfig) -> RequestLimits:
        return cls(
            vocab_size=runtime.vocab_size,
            bos_id=runtime.bos_id,
            eos_id=runtime.eos_id,
            max_len=runtime.max_len,
            max_src_len=getattr(runtime, "max_src_len", None) or runtime.max_len,
            is_encoder_decoder=runtime.is_encoder_decoder,
            max_prompt_tokens=config.max_prompt_tokens,
            max_new_tokens=config.max_new_tokens,
            max_beam_size=min(config.max_beam_size, config.max_slots),
            banned_ids=tuple(getattr(runtime, "banned_ids", ())),
        )


def _ids_ok(ids: object, vocab: int) -> bool:
    return isinstance(ids, (list, tuple)) and all(
        isinstance(i, (int, np.integer)) and not isinstance(i, bool) and 0 <= i < vocab for i in ids
    )


def check_params(p: SamplingParams, lim: RequestLimits) -> None:
    most = lim.max_new_tokens + len(p.forced_ids)  # forced tokens are the client's, not generated work
    if not 1 <= p.max_new_tokens <= most:
        raise InvalidRequest(f"max_new_tokens={p.max_new_tokens} must be between 1 and {most}", field="max_new_tokens")
    if not (math.isfinite(p.temperature) and p.temperature >= 0):
        raise InvalidRequest(
            f"temperature={p.temperature} must be a finite number >= 0 (0 = greedy)", field="temperature"
        )
    if p.top_k < 0:
        raise InvalidRequest(f"top_k={p.top_k} must be >= 0 (0 = off)", field="top_k")
    if not 0 < p.top_p <= 1:
        raise InvalidRequest(f"top_p={p.top_p} must be in (0, 1] (1 = off)", field="top_p")
    if not (math.isfinite(p.repetition_penalty) and p.repetition_penalty > 0):
        raise InvalidRequest(
            f"repetition_penalty={p.repetition_penalty} must be a finite number > 0 (1 = off)",
            field="repetition_penalty",
        )
    if not _ids_ok(p.stop_token_ids, lim.vocab_size):
        raise InvalidRequest(
            f"stop_token_ids={list(p.stop_token_ids)} must be token ids in [0, {lim.vocab_size})",
            field="stop_token_ids",
        )
    limit = lim.max_beam_size
    if not 1 <= p.beam_size <= limit:
        raise InvalidRequest(
            f"beam_size={p.beam_size} must be between 1 and {limit} (max_beam_size and KV slots of this engine)",
            field="beam_size",
        )
    if p.beam_size > 1:
        if not lim.is_encoder_decoder:
            raise InvalidRequest(
                f"beam_size={p.beam_size}: beam search is for translation (encoder-decoder) "
                f"models; this model is decoder-only: use beam_size=1",
                field="beam_size",
            )
        if p.temperature > 0:
            raise InvalidRequest(
                f"beam_size={p.beam_size} with temperature={p.temperature}: beam search is "
                f"deterministic; set temperature=0",
                field="beam_size",
            )
    _check_scoring(p, lim)
    if not 1 <= p.n_best <= p.beam_size:
        raise InvalidRequest(f"n_best={p.n_best} must be between 1 and beam_size={p.beam_size}", field="n_best")
    if not math.isfinite(p.length_penalty):
        raise InvalidRequest(f"length_penalty={p.length_penalty} must be a finite number", field="length_penalty")


def _check_scoring(p: SamplingParams, lim: RequestLimits) -> None:
    """Log-probabilities, penalties, biases and forced tokens: checked values, and greedy or sampled rows only."""
    if p.logprobs is not None and not 0 <= p.logprobs <= lim.vocab_size:
        raise InvalidRequest(f"logprobs={p.logprobs} must be between 0 and {lim.vocab_size}", field="logprobs")
    for name in ("presence_penalty", "frequency_penalty"):
        if not (math.isfinite(getattr(p, name)) and -2.0 <= getattr(p, name) <= 2.0):
            raise InvalidRequest(f"{name}={getattr(p, name)} must be between -2 and 2 (0 = off)", field=name)
    bad = [i for i, b in p.logit_bias if not (0 <= i < lim.vocab_size and math.isfinite(b) and -100 <= b <= 100)]
    if bad:
        raise InvalidRequest(
            f"logit_bias: ids {bad[:5]} are outside [0, {lim.vocab_size}) or their bias outside [-100, 100]",
            field="logit_bias",
        )
    if not (0 <= p.min_tokens <= p.max_new_tokens):
        raise InvalidRequest(
            f"min_tokens={p.min_tokens} must be between 0 and max_new_tokens={p.max_new_tokens}", field="min_tokens"
        )
    if p.no_repeat_ngram_size < 0:
        raise InvalidRequest(
            f"no_repeat_ngram_size={p.no_repeat_ngram_size} must be >= 0 (0 = off)", field="no_repeat_ngram_size"
        )
    if not _ids_ok(p.forced_ids, lim.vocab_size) or len(p.forced_ids) > p.max_new_tokens:
        raise InvalidRequest(
            f"forced_ids: {len(p.forced_ids)} token ids in [0, {lim.vocab_size}), at most "
            f"max_new_tokens={p.max_new_tokens}",
            field="forced_ids",
        )
    asked = [
        n
        for n in (
            "logprobs",
            "forced_ids",
            "min_tokens",
            "no_repeat_ngram_size",
            "logit_bias",
            "presence_penalty",
            "frequency_penalty",
        )
        if getattr(p, n) not in (None, 0, 0.0, ())
    ]
    if asked and p.beam_size > 1:
        raise InvalidRequest(
            f"{asked[0]} is for greedy or sampled decoding; beam search (beam_size="
            f"{p.beam_size}) does not take it: use beam_size=1",
            field=asked[0],
        )


def check_request(req: GenerationRequest, lim: RequestLimits) -> RequestState:
    """Validate a request and build its engine state (its handle and submit time: `admit`)."""
    if not isinstance(req.request_id, str) or not req.request_id:
        raise InvalidRequest(f"request_id={req.request_id!r} must be a non-empty string", field="request_id")
    p = req.params
    check_params(p, lim)
    ids, n = req.prompt_ids, len(req.prompt_ids) if isinstance(req.prompt_ids, (list, tuple)) else 0
    what = "source" if lim.is_encoder_decoder else "prompt"
    if n == 0 or not _ids_ok(ids, lim.vocab_size):
        raise InvalidRequest(
            f"prompt_ids: the {what} must be a non-empty list of token ids in "
            f"[0, {lim.vocab_size}), got {str(ids)[:80]}",
            field="prompt_ids",
        )
    longest = lim.max_prompt_tokens
    if lim.is_encoder_decoder:
        longest = min(longest, lim.max_src_len)
    else:  # the prompt itself must fit in the KV cache
        longest = min(longest, lim.max_len)
    if n > longest:
        raise InvalidRequest(
            f"prompt_ids: the {what} has {n} tokens; at most {longest} are accepted", field="prompt_ids", too_large=True
        )
    decoder_prompt = [lim.bos_id] if lim.is_encoder_decoder else [int(i) for i in ids]
    # The KV cache must hold every token fed to the decoder: the decoder prompt and all but the last new token.
    if len(decoder_prompt) + p.max_new_tokens - 1 > lim.max_len:
        room = lim.max_len - len(decoder_prompt) + 1
        raise InvalidRequest(
            f"{what} of {len(decoder_prompt)} decoder tokens + max_new_tokens={p.max_new_tokens} "
            f"exceeds the model's KV cache of {lim.max_len} tokens: ask for at most "
            f"{room} new tokens",
            field="max_new_tokens",
            too_large=True,
        )
    end_ids = frozenset(p.stop_token_ids) | ({lim.eos_id} if not p.ignore_eos else set())
    source = [int(i) for i in ids] if lim.is_encoder_decoder else []
    adjusts = adjusts_logits(p)
    state = RequestState(
        req=req,
        handle=None,
        decoder_prompt=decoder_prompt,
        source=source,
        end_ids=end_ids,
        plain=is_plain_greedy(p),
        sampled=is_plain_sampling(p),
        adjusts=adjusts,
        extra=adjusts or p.logprobs is not None or bool(p.forced_ids),
    )
    if p.beam_size > 1:
        state.beam = BeamSearch(p.beam_size, p.max_new_tokens, end_ids, p.length_penalty, p.n_best, lim.banned_ids)
    elif not state.plain:
        state.rng = make_generator(p.seed)
    return state


def admit(req: GenerationRequest, lim: RequestLimits, handle: RequestHandle, now: float) -> Sequence:
    """The request checked (`check_request`), as the scheduler's Sequence; its RequestState, with `handle` and
    submitted at `now`, is the payload."""
    state = check_request(req, lim)
    state.handle, state.submitted = handle, now
    p = req.params
    return Sequence(
        request_id=req.request_id,
        prefill_len=len(state.decoder_prompt),
        width=p.beam_size,
        src_len=len(req.prompt_ids) if lim.is_encoder_decoder else 0,
        max_new_tokens=p.max_new_tokens,
        deadline=req.deadline,
        priority=req.priority,
        payload=state,
    )
