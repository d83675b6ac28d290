"""Request validation at submit time: a request the engine cannot serve is refused before it waits.

Owns: the checks of a GenerationRequest against the model (vocabulary, KV cache length, architecture) and
the engine's limits, each failing with InvalidRequest naming the field, the value, the limit and the fix;
and the construction of the request's engine state (decoder prompt, stop ids, generator, beam search).

Does not own: admission bounds (serving/engine/scheduler.py), HTTP status codes (serving/server/api.py).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from serving.engine.beam import BeamSearch
from serving.engine.runner import RequestState
from serving.engine.sampling import is_plain_greedy, make_generator
from serving.engine.types import GenerationRequest, InvalidRequest, SamplingParams

if TYPE_CHECKING:
    from serving.engine.engine import Engine


def _ids_ok(ids: object, vocab: int) -> bool:
    return isinstance(ids, (list, tuple)) and all(
        isinstance(i, (int, np.integer)) and not isinstance(i, bool) and 0 <= i < vocab for i in ids)


def check_params(p: SamplingParams, engine: "Engine") -> None:
    cfg = engine.config
    if not 1 <= p.max_new_tokens <= cfg.max_new_tokens:
        raise InvalidRequest(f"max_new_tokens={p.max_new_tokens} must be between 1 and {cfg.max_new_tokens}")
    if not (math.isfinite(p.temperature) and p.temperature >= 0):
        raise InvalidRequest(f"temperature={p.temperature} must be a finite number >= 0 (0 = greedy)")
    if p.top_k < 0:
        raise InvalidRequest(f"top_k={p.top_k} must be >= 0 (0 = off)")
    if not 0 < p.top_p <= 1:
        raise InvalidRequest(f"top_p={p.top_p} must be in (0, 1] (1 = off)")
    if not (math.isfinite(p.repetition_penalty) and p.repetition_penalty > 0):
        raise InvalidRequest(f"repetition_penalty={p.repetition_penalty} must be a finite number > 0 (1 = off)")
    if not _ids_ok(p.stop_token_ids, engine.vocab_size):
        raise InvalidRequest(f"stop_token_ids={list(p.stop_token_ids)} must be token ids in [0, {engine.vocab_size})")
    limit = min(cfg.max_beam_size, engine.scheduler.n_slots)
    if not 1 <= p.beam_size <= limit:
        raise InvalidRequest(f"beam_size={p.beam_size} must be between 1 and {limit} (max_beam_size and "
                             f"KV slots of this engine)")
    if p.beam_size > 1:
        if not engine.is_encoder_decoder:
            raise InvalidRequest(f"beam_size={p.beam_size}: beam search is for translation (encoder-decoder) "
                                 f"models; this model is decoder-only: use beam_size=1")
        if p.temperature > 0:
            raise InvalidRequest(f"beam_size={p.beam_size} with temperature={p.temperature}: beam search is "
                                 f"deterministic; set temperature=0")
    if not 1 <= p.n_best <= p.beam_size:
        raise InvalidRequest(f"n_best={p.n_best} must be between 1 and beam_size={p.beam_size}")
    if not math.isfinite(p.length_penalty):
        raise InvalidRequest(f"length_penalty={p.length_penalty} must be a finite number")


def check_request(req: GenerationRequest, engine: "Engine") -> RequestState:
    """Validate a request and build its engine state (handle and timings are set by the engine)."""
    if not isinstance(req.request_id, str) or not req.request_id:
        raise InvalidRequest(f"request_id={req.request_id!r} must be a non-empty string")
    p = req.params
    check_params(p, engine)
    ids, n = req.prompt_ids, len(req.prompt_ids) if isinstance(req.prompt_ids, (list, tuple)) else 0
    what = "source" if engine.is_encoder_decoder else "prompt"
    if n == 0 or not _ids_ok(ids, engine.vocab_size):
        raise InvalidRequest(f"prompt_ids: the {what} must be a non-empty list of token ids in "
                             f"[0, {engine.vocab_size}), got {str(ids)[:80]}")
    longest = engine.config.max_prompt_tokens
    if engine.is_encoder_decoder:
        longest = min(longest, engine.max_src_len)
    if n > longest:
        raise InvalidRequest(f"prompt_ids: the {what} has {n} tokens; at most {longest} are accepted",
                             too_large=True)
    rt = engine.runtime
    decoder_prompt = [rt.bos_id] if engine.is_encoder_decoder else [int(i) for i in ids]
    # The KV cache must hold every token fed to the decoder: the decoder prompt and all but the last new token.
    if len(decoder_prompt) + p.max_new_tokens - 1 > engine.max_len:
        room = engine.max_len - len(decoder_prompt) + 1
        raise InvalidRequest(f"{what} of {len(decoder_prompt)} decoder tokens + max_new_tokens={p.max_new_tokens} "
                             f"exceeds the model's KV cache of {engine.max_len} tokens: ask for at most "
                             f"{room} new tokens", too_large=True)
    end_ids = frozenset(p.stop_token_ids) | ({engine.eos_id} if not p.ignore_eos else set())
    source = [int(i) for i in ids] if engine.is_encoder_decoder else []
    state = RequestState(req=req, handle=None, decoder_prompt=decoder_prompt, source=source, end_ids=end_ids,
                         plain=is_plain_greedy(p))
    if p.beam_size > 1:
        state.beam = BeamSearch(p.beam_size, p.max_new_tokens, end_ids, p.length_penalty, p.n_best)
    elif not state.plain:
        state.rng = make_generator(p.seed)
    return state
