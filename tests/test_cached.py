"""`Cached` (serving/server/cached.py) and the cheap /metrics it makes (serving/server/ingress.py RayBackend):
one fetch for many concurrent callers (single flight), a value reused for `ttl_s`, errors not cached, a caller
that goes away not cancelling the others' fetch; and the cross-node scrape's blocking parts (Ray's node
table, parsing every node's exposition) off the event loop. The slow test of /metrics under load is in
tests/test_reliability_clients.py.
"""
from __future__ import annotations

import asyncio
import time

import pytest

from serving.server.cached import Cached
from test_readiness import _max_loop_gap


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_concurrent_callers_share_one_fetch_and_the_value_lives_ttl_s():
    clock, calls = Clock(), []

    async def fetch() -> int:
        calls.append(1)
        await asyncio.sleep(0.05)
        return len(calls)
    cached = Cached(fetch, ttl_s=1.0, clock=clock)
    assert await asyncio.gather(*(cached.get() for _ in range(100))) == [1] * 100
    clock.now = 0.99
    assert await cached.get() == 1 and len(calls) == 1
    clock.now = 1.01
    assert await asyncio.gather(cached.get(), cached.get()) == [2, 2] and cached.fetches == 2


async def test_within_stale_s_callers_get_the_last_value_while_one_fetch_refreshes_it(caplog):
    clock, gate, calls = Clock(), asyncio.Event(), []

    async def fetch() -> int:
        calls.append(1)
        if len(calls) > 1:
            await gate.wait()
        if len(calls) == 3:
            raise RuntimeError("node exporter down")
        return len(calls)
    cached = Cached(fetch, ttl_s=1.0, stale_s=6.0, clock=clock)
    assert await cached.get() == 1  # the first call ever waits
    clock.now = 5.0
    assert await asyncio.gather(*(cached.get() for _ in range(10))) == [1] * 10 and len(calls) == 2
    gate.set()
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert await cached.get() == 2 and len(calls) == 2  # refreshed, fresh again
    clock.now = 10.0
    assert await cached.get() == 2  # stale; this refresh fails ...
    await asyncio.sleep(0.01)
    assert "node exporter down" in caplog.text and await cached.get() == 2  # ... and is retried
    await asyncio.sleep(0.01)
    assert len(calls) == 4 and await cached.get() == 4
    clock.now = 20.0  # after a quiet spell the last value is too old to serve: the caller waits for a fresh one
    assert await cached.get() == 5


async def test_a_failed_fetch_reaches_every_waiter_and_is_not_cached():
    outcomes = [ValueError("node down"), 7]

    async def fetch() -> int:
        await asyncio.sleep(0.01)
        out = outcomes.pop(0)
        if isinstance(out, Exception):
            raise out
        return out
    cached = Cached(fetch, ttl_s=60)
    results = await asyncio.gather(cached.get(), cached.get(), return_exceptions=True)
    assert [type(r) for r in results] == [ValueError, ValueError]
    assert await cached.get() == 7 and cached.fetches == 2


async def test_a_caller_that_goes_away_does_not_cancel_the_fetch_of_the_others():
    async def fetch() -> str:
        await asyncio.sleep(0.1)
        return "text"
    cached = Cached(fetch, ttl_s=60)
    first = asyncio.create_task(cached.get())
    second = asyncio.create_task(cached.get())
    await asyncio.sleep(0.02)
    first.cancel()  # e.g. its HTTP client disconnected
    assert await second == "text" and cached.fetches == 1
    with pytest.raises(asyncio.CancelledError):
        await first


EXPOSITION = ('# HELP ray_node_cpu_utilization Ray\'s own metric: dropped\n# TYPE ray_node_cpu_utilization gauge\n'
              'ray_node_cpu_utilization{ip="127.0.0.1"} 42.0\n# TYPE ray_kvserve_requests_total counter\n'
              'ray_kvserve_requests_total{model="generate",endpoint="/v1/generate",status="200",'
              'replica="a",WorkerId="w"} 3.0\n')


async def _node_exporter(hits: list) -> tuple[asyncio.AbstractServer, int]:
    """A local HTTP server posing as a Ray node's metrics exporter."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        hits.append(1)
        body = EXPOSITION.encode()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        writer.close()
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def test_metrics_scrape_is_off_the_event_loop_single_flight_and_cached(monkeypatch):
    import ray

    from serving.server import ingress

    hits, node_calls = [], []
    server, port = await _node_exporter(hits)

    def nodes() -> list[dict]:  # ray.nodes(): a blocking call to Ray's GCS
        node_calls.append(1)
        time.sleep(0.5)
        return [{"Alive": True, "NodeManagerAddress": "127.0.0.1", "MetricsExportPort": port},
                {"Alive": False, "NodeManagerAddress": "127.0.0.1", "MetricsExportPort": 1}]
    monkeypatch.setattr(ray, "nodes", nodes)
    backend = ingress.RayBackend({}, {}, {}, "kvserve")
    try:
        texts, gap = await _max_loop_gap(asyncio.gather(*(backend.metrics_text() for _ in range(50))))
        assert len(set(texts)) == 1 and node_calls == [1] and hits == [1], (node_calls, hits)
        assert 'kvserve_requests_total{endpoint="/v1/generate",model="generate",status="200"} 3.0' in texts[0]
        assert "cpu_utilization" not in texts[0]
        assert gap < 0.25, f"the event loop stalled {gap:.3f}s during the scrape"
        await backend.metrics_text()
        assert node_calls == [1]  # within METRICS_TTL_S: the same scrape
        assert backend._metrics.ttl_s >= 0.5 / ingress.SCRAPE_SHARE  # a 0.5 s scrape is repeated less often
        backend._metrics.ttl_s = 0  # expired but within stale_s: the last scrape answers while the next one runs
        again, gap = await _max_loop_gap(backend.metrics_text())
        assert again is texts[0] and gap < 0.25
        await asyncio.sleep(0.7)
        assert node_calls == [1, 1] and hits == [1, 1]
    finally:
        server.close()
        await server.wait_closed()


class Exposition:
    """serving.server.api.Backend that hands out one exposition object until it changes."""

    def __init__(self) -> None:
        self.text = "kvserve_requests_total 1.0\n" * 2000

    def model_tasks(self) -> dict[str, str]:
        return {}

    async def models_ready(self) -> dict[str, bool]:
        return {}

    async def metrics_text(self) -> str:
        return self.text


async def test_metrics_are_gzipped_once_per_exposition_for_clients_that_accept_it(monkeypatch):
    import gzip

    import httpx

    from serving.server.api import create_app
    from serving.server.config import Limits
    from serving.server.metrics import Recorder

    compressed, real = [], gzip.compress
    monkeypatch.setattr(gzip, "compress", lambda data, *a: compressed.append(len(data)) or real(data, *a))
    backend = Exposition()
    app = create_app(backend, Limits(), Recorder("prometheus"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        answers = [await client.get("/metrics", headers={"Accept-Encoding": "gzip"}) for _ in range(5)]
        assert all(r.headers["content-encoding"] == "gzip" and r.text == backend.text for r in answers)
        assert compressed == [len(backend.text)] and int(answers[0].headers["content-length"]) < len(backend.text) / 20
        backend.text = backend.text + "kvserve_requests_total 2.0\n"  # the next scrape
        assert (await client.get("/metrics")).text == backend.text and len(compressed) == 2
        plain = await client.get("/metrics", headers={"Accept-Encoding": "identity"})
        assert "content-encoding" not in plain.headers and plain.text == backend.text
        assert plain.headers["content-type"].startswith("text/plain; version=0.0.4")
