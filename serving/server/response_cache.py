"""A bounded in-memory cache of deterministic answers, per model replica and version.

Greedy, beam and seeded requests are batch-invariant here (the same tokens whatever else runs in the step,
tests/test_engine.py), so an identical request to the same model version (same text, parameters and forced text)
gets the same answer: the cache hands it back without the engine. Unseeded sampling is never cached, nor an
answer cut short (deadline, cancellation, error), nor a request that sent `Cache-Control: no-cache`. A replica
holds one model version, so a new version starts with an empty cache (invalidated by version).

Bounded by entries and by the bytes of the texts held; the least recently used goes first. Hits, misses,
evictions and the entries held are metrics (kvserve_response_cache_*), labelled by model and version. Besides each
text's answer it holds whole HTTP answers, keyed by the request's bytes (serving/server/answer_front.py), under
the same bounds.

Does not own: what an answer is (serving/server/service.py), where the cache sits (serving/server/local_model.py).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import replace
from typing import Any

from serving.server.metrics import Recorder
from serving.server.text_types import TextRequest, TextResult

CACHED_FINISH = ("stop", "length")  # answers that ran to their end; a deadline or a cancellation did not


def cache_key(req: TextRequest) -> tuple | None:
    """What makes two requests the same answer; None when the answer is not deterministic or not wanted cached."""
    p = req.params
    if not req.cache or (p.temperature > 0 and p.seed is None):
        return None
    return (req.text, p, req.prefix, req.echo, req.score)


def cacheable(req: TextRequest, result: TextResult) -> bool:
    """Whether `result`, the answer to `req`, is one the cache keeps."""
    return cache_key(req) is not None and result.finish_reason in CACHED_FINISH


ENTRY_OVERHEAD = 1024  # bytes of an entry beyond its texts: its key, params, result and the LRU's node (measured)


def _size(key: tuple, result: TextResult) -> int:
    """An entry's bytes: the request's and the answer's texts, its logprobs and a fixed overhead."""
    texts = [k for k in key if isinstance(k, str)] + [result.text] + [t for t, _ in result.n_best]
    return ENTRY_OVERHEAD + sum(sys.getsizeof(t) for t in texts) + 160 * len(result.logprobs)


class ResponseCache:
    def __init__(self, max_entries: int, max_bytes: int, recorder: Recorder | None, labels: dict[str, str]) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.recorder, self.labels = recorder, labels
        self._entries: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()  # key -> (TextResult or Answer, bytes)
        self.bytes = 0
        self._inflight: dict[tuple, asyncio.Future[TextResult]] = {}  # answers being computed, by key

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple) -> TextResult | None:
        hit = self._lookup(key)
        self._count("hit" if hit else "miss")
        return hit

    def _lookup(self, key: tuple) -> TextResult | None:
        hit = self._entries.get(key)
        if hit is None:
            return None
        self._entries.move_to_end(key)
        return hit[0]

    def put(self, key: tuple, result: TextResult) -> None:
        if result.finish_reason not in CACHED_FINISH:
            return
        self._put(key, result, _size(key, result))

    def get_answer(self, key: Hashable) -> Any:
        """A whole HTTP answer kept by serving/server/answer_front.py (None if not held); its texts count as hits."""
        hit = self._entries.get(key)
        if hit is None:
            return None
        self._entries.move_to_end(key)
        self._count("hit", hit[0].texts)
        return hit[0]

    def put_answer(self, key: Hashable, answer: Any) -> None:
        """Keep a whole HTTP answer (`answer.size` bytes) beside the texts' answers, within the same bounds."""
        self._put(key, answer, ENTRY_OVERHEAD + answer.size)

    def _put(self, key: Hashable, value: Any, size: int) -> None:
        if key in self._entries or size > self.max_bytes:
            return
        self._entries[key] = (value, size)
        self.bytes += size
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            _, (_, freed) = self._entries.popitem(last=False)
            self.bytes -= freed
            if self.recorder:
                self.recorder.inc("kvserve_response_cache_evictions_total", self.labels)
        if self.recorder:
            self.recorder.set("kvserve_response_cache_entries", self.labels, float(len(self._entries)))

    async def complete(self, req: TextRequest, compute: Any) -> TextResult:
        """The cached answer to `req`, else `compute(req)`'s (kept when it may be). An identical request that
        arrives while the first is computed waits for that answer (single flight) instead of computing it again;
        if the first fails, each waiter computes its own."""
        key = cache_key(req)
        if key is None:
            return await compute(req)
        started = time.monotonic()
        hit = self._lookup(key)
        if hit is None and key in self._inflight:
            try:
                hit = await asyncio.shield(self._inflight[key])
            except Exception:  # the first request failed (its own deadline, a refusal): compute this one
                hit = None
        self._count("hit" if hit is not None else "miss")
        if hit is not None:
            return replace(hit, queue_s=0.0, ttft_s=0.0, total_s=time.monotonic() - started, cached=True)
        pending = self._inflight.setdefault(key, asyncio.get_running_loop().create_future())
        try:
            result = await compute(req)
        except BaseException as e:
            if self._inflight.get(key) is pending:
                del self._inflight[key]
                if not pending.done():
                    pending.set_exception(e if isinstance(e, Exception) else RuntimeError("cancelled"))
                    pending.exception()  # retrieved: no "never retrieved" warning when nobody waits
            raise
        self.put(key, result)
        if self._inflight.get(key) is pending:
            del self._inflight[key]
            pending.set_result(result)
        return result

    def _count(self, result: str, texts: int = 1) -> None:
        if self.recorder:
            self.recorder.inc("kvserve_response_cache_requests_total", {**self.labels, "reason": result}, texts)
