"""The translation API's decoding controls: sentence splitting, target prefixes, scores, scoring given translations.

Owns: splitting a document into sentences (after . ! ? and their CJK forms, before whitespace) and joining their
translations back with the document's own whitespace, in order; the `TextRequest`s of a /v1/translate body (a
prefix per text is forced, serving/server/service.py) and of a /v1/translate/score body (each target forced and
ended with the end token, every token scored); the `translations` and `scores` of the answers.

Does not own: the routes, limits and versions (serving/server/api.py), decoding itself (serving/engine/).
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from serving.engine.types import SamplingParams
from serving.server.errors import ErrorKind, ServiceError
from serving.server.schemas import ScoreRequest, TranslateRequest
from serving.server.text_types import TextRequest, TextResult

# A sentence ends at . ! ? (or …, 。, ！, ？), closing quotes or brackets included, where whitespace follows.
_SENTENCE_END = re.compile(r"(?<=[.!?\u2026\u3002\uff01\uff1f])([\"'\u201d\u2019)\]]*)(\s+)")


def split_sentences(text: str) -> tuple[list[str], list[str]]:
    """(sentences, the whitespace after each one but the last): `join_sentences` puts them back together."""
    sentences, gaps, start = [], [], 0
    for m in _SENTENCE_END.finditer(text):
        sentences.append(text[start : m.start(2)])
        gaps.append(m.group(2))
        start = m.end()
    if text[start:].strip() or not sentences:
        sentences.append(text[start:])
    else:  # trailing whitespace after the last sentence
        gaps.pop()
    return sentences, gaps


def join_sentences(parts: list[str], gaps: list[str]) -> str:
    return "".join(p + (gaps[i] if i < len(gaps) else "") for i, p in enumerate(parts))


def translate_requests(
    body: TranslateRequest, texts: list[str], params: SamplingParams, max_texts: int, make: Any
) -> tuple[list[TextRequest], list[tuple[int, list[str] | None]]]:
    """The engine requests of a /v1/translate body and, per text, (its first request, the whitespace between its
    sentences when it was split, else None). `make(text, params, field, prefix)` builds one request."""
    params = replace(
        params,
        min_tokens=body.min_tokens,
        no_repeat_ngram_size=body.no_repeat_ngram_size,
        logprobs=0 if body.return_scores else None,
    )
    if body.return_scores and body.beam_size > 1:
        raise ServiceError(
            ErrorKind.INVALID,
            "return_scores gives greedy decoding's scores: use beam_size 1 "
            "(the n_best hypotheses of beam search carry their ranking score; POST "
            "/v1/translate/score gives any translation's log-probability)",
            field="return_scores",
        )
    prefixes = ([body.target_prefix] if isinstance(body.target_prefix, str) else body.target_prefix) or []
    reqs: list[TextRequest] = []
    layout: list[tuple[int, list[str] | None]] = []
    for i, text in enumerate(texts):
        field = "text" if isinstance(body.text, str) else f"text[{i}]"
        if body.split_sentences:
            sentences, gaps = split_sentences(text)
            layout.append((len(reqs), gaps))
            reqs += [make(s, params, field, "") for s in sentences]
        else:
            layout.append((len(reqs), None))
            reqs.append(make(text, params, field, prefixes[i] if prefixes else ""))
    if len(reqs) > max_texts:
        raise ServiceError(
            ErrorKind.TOO_LARGE,
            f"text has {len(reqs)} sentences in all; the limit is {max_texts} per request. Split the document.",
            field="text",
        )
    return reqs, layout


def translations(
    body: TranslateRequest, results: list[TextResult], layout: list[tuple[int, list[str] | None]]
) -> list[dict[str, Any]]:
    out = []
    for first, gaps in layout:
        if gaps is None:
            out.append(_translation(body, results[first]))
            continue
        parts = results[first : first + len(gaps) + 1]
        finish = next((r.finish_reason for r in parts if r.finish_reason != "stop"), "stop")
        out.append(
            {
                "text": join_sentences([r.text for r in parts], gaps),
                "finish_reason": finish,
                "sentences": [r.text for r in parts],
            }
        )
    return out


def _translation(body: TranslateRequest, r: TextResult) -> dict[str, Any]:
    out: dict[str, Any] = {"text": r.text, "finish_reason": r.finish_reason}
    if body.n_best is not None:
        out["n_best"] = [{"text": t, "score": s} for t, s in r.n_best] or [{"text": r.text, "score": 0.0}]
    if body.return_scores:
        out.update(_scores(r))
    return out


def _scores(r: TextResult) -> dict[str, Any]:
    """The sequence log-probability (the end token's included) and each token's, "</s>" for the end token."""
    tokens = [{"token": text, "logprob": lp} for text, lp, _ in r.logprobs]
    if r.end_logprob is not None:
        tokens.append({"token": "</s>", "logprob": r.end_logprob})
    return {"score": sum(t["logprob"] for t in tokens), "token_scores": tokens}


def score_requests(body: ScoreRequest, max_texts: int, max_tokens: int, make: Any) -> list[TextRequest]:
    texts = [body.text] if isinstance(body.text, str) else body.text
    targets = [body.target] if isinstance(body.target, str) else body.target
    if len(texts) > max_texts:
        raise ServiceError(
            ErrorKind.TOO_LARGE,
            f"text has {len(texts)} entries; the limit is {max_texts} per request. Split the list.",
            field="text",
        )
    params = SamplingParams(max_new_tokens=max_tokens, logprobs=0)
    return [
        make(t, params, "text" if isinstance(body.text, str) else f"text[{i}]", target)
        for i, (t, target) in enumerate(zip(texts, targets, strict=True))
    ]


def scores(results: list[TextResult]) -> list[dict[str, Any]]:
    return [_scores(r) for r in results]
