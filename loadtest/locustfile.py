"""Locust file for kvserve, for people who already run Locust (`pip install 'kvserve[locust]'`).

Each Locust user is one closed-loop client (FastHttpUser, no think time by default) sending the same
requests as `kvserve loadtest` (loadtest/workloads.py: test-split inputs, seeded per request) and reading
answers with the same parser (loadtest/client.py). The request row's response time is the end-to-end
latency (the whole stream read); streamed runs add rows of type TTFT and TPOT; 429 answers are failures
and the user then waits their Retry-After. Output-token totals are logged when the test stops.

Headless run (Locust runs as its own process: gevent patches the interpreter, so never import this file
from the kvserve process):

    locust -f loadtest/locustfile.py --headless --host http://127.0.0.1:8000 \\
        --users 8 --spawn-rate 8 --run-time 60s --stop-timeout 30 \\
        --workload generate --max-tokens 64 --json-file artifacts/locust/generate

`--json-file` holds the final figures (every request, including those finished during --stop-timeout);
`--csv` files are written periodically and may miss the last requests.

Options added to Locust's own: --workload translate|generate|completions, --max-tokens N,
--stream auto|yes|no, --data-dir DIR, --kv-seed N, --think-time S. For open-loop arrivals at a set rate,
queueing percentiles and SLO gating use `kvserve loadtest` instead.
"""
from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator
from typing import Any

from locust import FastHttpUser, between, constant, events, task

from loadtest.client import RequestRecord, StreamParser, parse_json_answer
from loadtest.config import LoadConfig, Workload
from loadtest.workloads import PATHS, Inputs, load_inputs, request_body

RETRY_AFTER_DEFAULT_S, RETRY_AFTER_CAP_S = 1.0, 10.0
_counter = itertools.count()
_shared: dict[str, Any] = {"output_tokens": 0, "started": None}


@events.init_command_line_parser.add_listener
def _add_options(parser: Any) -> None:
    parser.add_argument("--workload", choices=[w.value for w in Workload], default="generate",
                        help="kvserve endpoint to load")
    parser.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every request")
    parser.add_argument("--stream", choices=["auto", "yes", "no"], default="auto",
                        help="stream answers (auto: generate and completions stream)")
    parser.add_argument("--data-dir", default="artifacts/data", help="prepared data with the test split")
    parser.add_argument("--kv-seed", type=int, default=0, help="seeds input choice and sampling")
    parser.add_argument("--think-time", type=float, default=0.0, help="seconds between a user's requests")


def _config(environment: Any, host: str) -> tuple[LoadConfig, Inputs]:
    """The shared config and inputs, built once per Locust process from its options."""
    if "config" not in _shared:
        o = environment.parsed_options
        stream = {"auto": None, "yes": True, "no": False}[o.stream]
        config = LoadConfig(host, workload=Workload(o.workload), concurrency=max(1, int(o.num_users or 1)),
                            max_tokens=o.max_tokens, stream=stream, seed=o.kv_seed, data_dir=o.data_dir)
        _shared["config"], _shared["inputs"] = config, load_inputs(config.workload, config.data_dir)
        logging.info("kvserve locust: %s, inputs: %s", config.workload.value, _shared["inputs"].source)
    return _shared["config"], _shared["inputs"]


@events.test_start.add_listener
def _on_start(environment: Any, **_: Any) -> None:
    _shared["started"], _shared["output_tokens"] = time.perf_counter(), 0


@events.test_stop.add_listener
def _on_stop(environment: Any, **_: Any) -> None:
    if _shared["started"] is not None:
        span = time.perf_counter() - _shared["started"]
        logging.info("kvserve locust: output tokens %d in %.1f s = %.1f tokens/s", _shared["output_tokens"], span,
                     _shared["output_tokens"] / max(span, 1e-9))


def _lines(resp: Any) -> Iterator[bytes]:
    """The body's lines as they arrive. geventhttpclient's read(n) waits for n bytes (a short SSE stream
    would arrive "all at once", hiding TTFT), so lines are read with its socket-level readline."""
    raw = getattr(resp, "_response", None)
    if raw is not None and hasattr(raw, "readline"):
        while line := raw.readline(b"\n"):
            yield line
        return
    line = b""
    for byte in resp.iter_content(chunk_size=1, decode_content=False):  # slow but never delays a line
        line += byte
        if byte == b"\n":
            yield line
            line = b""
    if line:
        yield line


class KvserveUser(FastHttpUser):
    """One closed-loop client; `--think-time` adds a pause between its requests."""

    wait_time = constant(0)

    def on_start(self) -> None:
        self.config, self.inputs = _config(self.environment, self.host)
        think = self.environment.parsed_options.think_time
        if think > 0:
            self.wait_time = between(0.5 * think, 1.5 * think)

    @task
    def send(self) -> None:
        config, index = self.config, next(_counter)
        path = PATHS[config.workload]
        record = RequestRecord(index=index, warmup=False, start=0.0)
        t0 = time.perf_counter()
        with self.client.post(path, json=request_body(config, self.inputs, index), stream=config.streams,
                              catch_response=True, name=path) as resp:
            record.status = resp.status_code
            if resp.status_code == 200:
                self._read(resp, record, t0)
            record.end = time.perf_counter() - t0
            resp.request_meta["response_time"] = record.e2e * 1000.0
            self._judge(resp, record)
        self._report_stream(path, record)
        if record.status == 429:
            retry = resp.headers.get("retry-after")
            wait = float(retry) if retry and retry.replace(".", "", 1).isdigit() else RETRY_AFTER_DEFAULT_S
            time.sleep(min(wait, RETRY_AFTER_CAP_S))

    def _read(self, resp: Any, record: RequestRecord, t0: float) -> None:
        if not self.config.streams:
            parse_json_answer(resp.content, self.config.workload, record)
            return
        parser = StreamParser(self.config.workload, record)
        for line in _lines(resp):
            if parser.feed(line.decode("utf-8", errors="replace").rstrip("\r\n"), time.perf_counter() - t0):
                break
        parser.finish()

    def _judge(self, resp: Any, record: RequestRecord) -> None:
        if record.status != 200:
            body = (resp.text or "")[:200] if record.status is not None else ""
            resp.failure(f"HTTP {record.status}: {body}")
        elif record.error:
            resp.failure(record.error)
        else:
            resp.success()
            _shared["output_tokens"] += record.output_tokens

    def _report_stream(self, path: str, record: RequestRecord) -> None:
        if not record.ok or record.ttft is None:
            return
        fire = self.environment.events.request.fire
        fire(request_type="TTFT", name=path, response_time=record.ttft * 1000.0,
             response_length=record.output_tokens, exception=None, context={})
        if record.tpot is not None:
            fire(request_type="TPOT", name=path, response_time=record.tpot * 1000.0, response_length=0,
                 exception=None, context={})
