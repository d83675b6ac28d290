"""Slow clients before authentication, on the production configuration (slow; `make test-slow`).

The shipped config on a real cluster (tests/test_production.py's `prod` server): 1,000 connections that send a
request's headers a few bytes at a time (slowloris), renewed as HAProxy cuts them off after its
`timeout http-request` (serving/server/haproxy.py), while normal requests run. Not in the cluster suite CI runs:
its pass mark is a latency ratio, measured on 2 shared cores.
"""
from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from reliability_cluster import report
from test_production import prod  # noqa: F401 -- the fixture: the shipped config on the test cluster

pytestmark = [pytest.mark.slow]


SLOW_CONNECTIONS = 1000


def _slowloris(port: int, stop: threading.Event, opened: list) -> None:
    """Keep SLOW_CONNECTIONS connections open that send a request's headers a few bytes at a time, opening a new
    one for each that HAProxy closes (`timeout http-request`)."""
    import socket

    def connect() -> socket.socket:
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"POST /v1/generate HTTP/1.1\r\nHost: t\r\n")
        s.setblocking(False)
        opened[0] += 1
        return s

    conns = [connect() for _ in range(SLOW_CONNECTIONS)]
    while not stop.wait(1.0):
        for i, s in enumerate(conns):
            try:
                s.send(b"X-a: b\r\n")
            except OSError:  # closed by HAProxy: open another
                s.close()
                conns[i] = connect()
    for s in conns:
        s.close()


def test_a_thousand_slow_clients_leave_normal_requests_p99_within_1_5x(prod, n=120):
    """Slowloris before authentication: 1,000 connections sending their headers slowly (renewed as HAProxy cuts
    them off) while normal requests run; their p99 stays within 1.5x of the same requests without them."""
    body = {"text": ["the quick brown fox"], "max_tokens": 8}

    async def p99() -> float:
        sem = asyncio.Semaphore(4)
        async with httpx.AsyncClient(base_url=prod.base, timeout=30) as c:
            async def one() -> float:
                async with sem:
                    t0 = time.monotonic()
                    r = await c.post("/v1/translate", json=body)
                    assert r.status_code == 200, r.text
                    return time.monotonic() - t0
            times = sorted(await asyncio.gather(*(one() for _ in range(n))))
        return times[int(0.99 * (n - 1))]

    port = prod.raw["http_options"]["port"]
    asyncio.run(p99())  # warm
    quiet = asyncio.run(p99())
    stop, opened = threading.Event(), [0]
    attacker = threading.Thread(target=_slowloris, args=(port, stop, opened), daemon=True)
    attacker.start()
    try:
        time.sleep(2)
        loud = asyncio.run(p99())
    finally:
        stop.set()
        attacker.join(30)
    report("slowloris", slow_connections=SLOW_CONNECTIONS, opened=opened[0], requests=n,
           p99_quiet_ms=round(quiet * 1000, 1), p99_under_slowloris_ms=round(loud * 1000, 1),
           ratio=round(loud / quiet, 2))
    assert opened[0] >= SLOW_CONNECTIONS
    assert loud <= 1.5 * quiet, (loud, quiet)
