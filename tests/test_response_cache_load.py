"""The response cache under load (slow): half the requests repeated, cache on vs off, side by side.

The served model is the published translator (artifacts/bundles/translate, `make serve` exports it); the load is
`CLIENTS` concurrent clients over the everyday test sentences, each sent twice in a shuffled order, through the
HTTP API in-process (tests/test_response_cache.py's CachedBackend: the replica's LocalModel, its engine, its cache).
Also: 10,000 distinct answers keep the cache within its byte bound, as tracemalloc measures it.

    KVSERVE_CACHE_OUT=figures.json pytest tests/test_response_cache_load.py -m slow -s
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import time
import tracemalloc
from pathlib import Path

import httpx
import pytest

from serving.engine.config import BatchingKnobs, ReplicaKnobs
from serving.engine.types import SamplingParams
from serving.server.api import create_app
from serving.server.config import Limits, ModelSpec
from serving.server.local_model import LocalModel
from serving.server.metrics import Recorder
from serving.server.response_cache import ResponseCache
from serving.server.service import TextRequest, TextResult
from test_response_cache import CachedBackend

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
BUNDLE = ROOT / "artifacts" / "bundles" / "translate"
SENTENCES = ROOT / "published" / "eval" / "everyday.en-de.tsv"
CLIENTS = 8


def _hits(recorder: Recorder) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for f in text_string_to_metric_families(recorder.exposition()) for s in f.samples
               if s.name == "kvserve_response_cache_requests_total" and s.labels.get("reason") == "hit")


async def _rate(cache_entries: int, texts: list[str]) -> tuple[float, float]:
    """(requests/s, cache hits)."""
    recorder = Recorder("prometheus")
    spec = ModelSpec(name="translate", bundle=BUNDLE, response_cache_entries=cache_entries,
                     engine=ReplicaKnobs(max_slots=16, provider="cpu", intra_op_threads=2))
    limits = Limits()
    model = await LocalModel.load(spec, str(BUNDLE), limits, BatchingKnobs(), recorder)
    app = create_app(CachedBackend(model, recorder), limits, recorder)
    queue: asyncio.Queue[str] = asyncio.Queue()
    for t in texts:
        queue.put_nowait(t)

    async def client(c: httpx.AsyncClient) -> None:
        while not queue.empty():
            r = await c.post("/v1/translate", json={"text": queue.get_nowait(), "max_tokens": 64})
            assert r.status_code == 200, r.text

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=120) as c:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(c) for _ in range(CLIENTS)))
        elapsed = time.perf_counter() - t0
    await model.engine.stop()
    return len(texts) / elapsed, _hits(recorder)


@pytest.mark.skipif(not BUNDLE.is_dir(), reason="no exported translator: run `make serve` (or kvserve up) first")
def test_with_half_the_requests_repeated_the_engine_computes_each_text_once():
    """Every repeat is a hit (single flight: a repeat of a request still in flight waits for it), so the engine
    does half the work. The requests/s gained are printed, not asserted: in-process, the client and the HTTP
    path share the engine's two cores (docs/api.md has the figures through `kvserve serve`)."""
    sources = [line.split("\t")[0] for line in SENTENCES.read_text().splitlines() if line.strip()][:80]
    texts = sources * 2  # every sentence twice: half the requests repeat one before
    random.Random(0).shuffle(texts)
    rates: dict[int, list[float]] = {0: [], 4096: []}
    for entries in (0, 4096, 0, 4096):  # alternated, so that a busy machine weighs on both alike
        rate, hits = asyncio.run(_rate(entries, texts))
        rates[entries].append(rate)
        assert hits == (len(texts) - len(set(texts)) if entries else 0)
    off, on = (sum(rates[e]) / len(rates[e]) for e in (0, 4096))
    figures = {"requests": len(texts), "distinct": len(set(texts)), "clients": CLIENTS,
               "requests_per_s_cache_off": [round(r, 2) for r in rates[0]],
               "requests_per_s_cache_on": [round(r, 2) for r in rates[4096]],
               "gain": round(on / off, 3)}
    print(json.dumps(figures))
    if os.environ.get("KVSERVE_CACHE_OUT"):
        Path(os.environ["KVSERVE_CACHE_OUT"]).write_text(json.dumps(figures, indent=1))
    assert on > off, figures


def test_10000_distinct_answers_stay_within_the_byte_bound():
    bound = 2 * 2**20
    cache = ResponseCache(max_entries=1_000_000, max_bytes=bound, recorder=None, labels={})
    rng = random.Random(1)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for i in range(10_000):
        text = " ".join(str(rng.random()) for _ in range(12))  # ~230 characters in, ~230 out
        req = TextRequest(text, SamplingParams(max_new_tokens=64), 0.0)
        cache.put((req.text, req.params, "", False, False),
                  TextResult(text=text[::-1], finish_reason="stop", prompt_tokens=40, completion_tokens=40,
                             queue_s=0.0, ttft_s=0.0, total_s=0.0))
    held = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert cache.bytes <= bound and 0 < len(cache) < 10_000
    assert held <= 1.25 * bound, (held, bound, len(cache))
