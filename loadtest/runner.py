"""Drive a load test: open-loop arrivals or closed-loop clients, warm-up, bounds, /metrics before and after.

`run_load(config) -> Report` is the library entry point (the CLI and `make bench` both use it).
- Open loop: requests are sent at the arrival times (loadtest/arrivals.py) whether or not earlier ones
  have finished, so queueing in the server shows up as latency; an arrival that finds `max_inflight`
  requests outstanding is dropped and counted (the client, not the server, was saturated).
- Closed loop: `concurrency` clients each send the next request when their last one ends; after a 429 a
  client waits the answer's Retry-After (1 s when absent, at most 10 s) before its next request.
- Requests started during the first `warmup_s` seconds are marked warm-up; the measured phase lasts
  `duration_s` and/or `requests` measured requests, whichever ends first. Requests are never retried.
Traffic goes only to `config.url` (its API path and /metrics): redirects are not followed and proxy
settings from the environment are ignored.
"""
from __future__ import annotations

import asyncio
import math
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

import httpx
from tqdm import tqdm

from loadtest.arrivals import arrival_times
from loadtest.client import RequestRecord, send_request
from loadtest.config import LoadConfig, LoadMode
from loadtest.promscrape import Snapshot, scrape, server_delta
from loadtest.report import Report
from loadtest.workloads import PATHS, Inputs, load_inputs, request_body

RETRY_AFTER_DEFAULT_S = 1.0
RETRY_AFTER_CAP_S = 10.0


@dataclass
class _Run:
    config: LoadConfig
    client: httpx.AsyncClient
    inputs: Inputs
    t0: float
    bar: tqdm
    records: list[RequestRecord] = field(default_factory=list)
    next_index: int = 0
    measured_sent: int = 0
    measured_errors: int = 0
    dropped: int = 0

    @property
    def end(self) -> float:
        d = self.config.effective_duration_s
        return math.inf if d is None else self.config.warmup_s + d

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def may_send(self, t: float) -> bool:
        """Whether a request starting at t (seconds since start) is within the run's bounds."""
        if t >= self.end:
            return False
        limit = self.config.requests
        return t < self.config.warmup_s or limit is None or self.measured_sent < limit

    def new_record(self, scheduled: float | None) -> RequestRecord:
        start = self.now()
        warm = (scheduled if scheduled is not None else start) < self.config.warmup_s
        record = RequestRecord(index=self.next_index, warmup=warm, start=start, scheduled=scheduled)
        self.next_index += 1
        self.measured_sent += not warm
        self.records.append(record)
        return record

    async def send(self, record: RequestRecord) -> RequestRecord:
        c = self.config
        body = request_body(c, self.inputs, record.index)
        await send_request(self.client, c.base_url + PATHS[c.workload], c.workload, body, c.streams, record,
                           self.t0, c.timeout_s)
        if record.warmup:
            self.bar.set_postfix_str("warm-up", refresh=False)
        else:
            self.measured_errors += not record.ok
            self.bar.set_postfix_str(f"errors {self.measured_errors}" if self.measured_errors else "",
                                     refresh=False)
            self.bar.update(1)
        return record


async def _open_loop(run: _Run) -> None:
    c = run.config
    assert c.rate is not None
    tasks: set[asyncio.Task] = set()
    for t in arrival_times(c.rate, c.arrival, c.burstiness, c.seed):
        if not run.may_send(t):
            break
        delay = run.t0 + t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if len(tasks) >= c.max_inflight:
            run.dropped += 1
            continue
        task = asyncio.create_task(run.send(run.new_record(scheduled=t)))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.gather(*tasks)


async def _closed_client(run: _Run) -> None:
    while run.may_send(run.now()):
        record = await run.send(run.new_record(scheduled=None))
        if record.status == 429:
            wait = min(record.retry_after or RETRY_AFTER_DEFAULT_S, RETRY_AFTER_CAP_S)
            await asyncio.sleep(max(0.0, min(wait, run.end - run.now())))


async def _closed_loop(run: _Run) -> None:
    assert run.config.concurrency is not None
    await asyncio.gather(*(_closed_client(run) for _ in range(run.config.concurrency)))


def _http_client(config: LoadConfig) -> httpx.AsyncClient:
    n = config.max_inflight if config.mode is LoadMode.OPEN else config.concurrency
    # The key is read here, at the start of a run, and only ever sent in this header (never in a report).
    headers = {"Authorization": f"Bearer {os.environ[config.api_key_env]}"} if config.api_key_env else {}
    if config.no_cache:
        headers["Cache-Control"] = "no-cache"
    return httpx.AsyncClient(
        timeout=httpx.Timeout(config.timeout_s, connect=min(config.timeout_s, 10.0)),
        limits=httpx.Limits(max_connections=n, max_keepalive_connections=n),
        headers=headers, follow_redirects=False, trust_env=False)


async def run_load(config: LoadConfig) -> Report:
    """Run one load test as `config` says and return its report (nothing is written to disk)."""
    inputs = load_inputs(config.workload, config.data_dir)
    async with _http_client(config) as client:
        before = await scrape(client, config.metrics_url) if config.scrape_metrics else None
        started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
        with tqdm(total=config.requests, unit="req", desc=f"{config.workload.value} {config.mode.value}-loop",
                  file=sys.stderr, disable=not config.progress, dynamic_ncols=True) as bar:
            run = _Run(config, client, inputs, time.perf_counter(), bar)
            await (_open_loop(run) if config.mode is LoadMode.OPEN else _closed_loop(run))
        after = await scrape(client, config.metrics_url) if config.scrape_metrics else None
    server = (server_delta(before, after) if isinstance(before, Snapshot) and isinstance(after, Snapshot)
              else {"available": False, "error": "not scraped (scrape_metrics=False)"})
    return Report.build(config=config.to_dict(), records=run.records, measure_start=config.warmup_s,
                        slos=config.slos, server=server, inputs=inputs.source, inputs_fallback=inputs.fallback,
                        dropped=run.dropped, started_at=started_at)
