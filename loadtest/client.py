"""One request, timed: send a JSON body, read the JSON answer or the SSE stream, record what happened.

Owns the per-request record and the parsing of the three endpoints' answers (JSON bodies, kvserve's
`data: {"token": ...}` stream, OpenAI's `data: {...choices...}` / `data: [DONE]` stream). Times are
`time.perf_counter()` seconds relative to the run's start. It never retries and never follows redirects;
scheduling requests is loadtest/runner.py's business, statistics are loadtest/stats.py's.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from loadtest.config import Workload

ERROR_BODY_CHARS = 300


@dataclass
class RequestRecord:
    index: int
    warmup: bool
    start: float  # seconds since the run started, when the request was sent
    scheduled: float | None = None  # open loop: when it should have been sent
    end: float = 0.0
    status: int | None = None  # HTTP status; None when no answer came (connection error, timeout)
    error: str | None = None  # None = success
    ttft: float | None = None  # streamed only: first token's arrival - start
    token_times: list[float] = field(default_factory=list)  # streamed: each token event's arrival - start
    output_tokens: int = 0  # usage.completion_tokens, else the streamed token events
    prompt_tokens: int | None = None
    usage_reported: bool = False
    finish_reason: str | None = None
    retry_after: float | None = None  # seconds, from a 429's Retry-After header

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (tokens - 1); streamed only."""
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def error_kind(self) -> str:
        """The key this request is counted under in "errors by status"."""
        if self.status is not None and self.status != 200:
            return str(self.status)
        return (self.error or "ok").split(":", 1)[0]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(e2e=self.e2e, tpot=self.tpot)
        return d


async def send_request(client: httpx.AsyncClient, url: str, workload: Workload, body: dict[str, Any],
                       stream: bool, record: RequestRecord, t0: float, timeout_s: float) -> RequestRecord:
    """Fill `record` with the outcome of one POST; never raises for server or network failures."""
    try:
        await asyncio.wait_for(_exchange(client, url, workload, body, stream, record, t0), timeout_s)
    except asyncio.TimeoutError:
        record.error = f"timeout: no complete answer within {timeout_s:g} s"
    except httpx.HTTPError as e:
        record.error = f"{type(e).__name__}: {e}"
    record.end = time.perf_counter() - t0
    return record


async def _exchange(client: httpx.AsyncClient, url: str, workload: Workload, body: dict[str, Any],
                    stream: bool, record: RequestRecord, t0: float) -> None:
    async with client.stream("POST", url, json=body) as resp:
        record.status = resp.status_code
        if resp.status_code != 200:
            record.retry_after = _retry_after(resp.headers.get("retry-after"))
            text = (await resp.aread()).decode("utf-8", errors="replace")[:ERROR_BODY_CHARS]
            record.error = f"http {resp.status_code}: {text}"
            return
        if stream:
            await _read_stream(resp, workload, record, t0)
        else:
            parse_json_answer(await resp.aread(), workload, record)


def _retry_after(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None  # an HTTP-date; the runner treats it like a missing header


def parse_json_answer(raw: bytes, workload: Workload, record: RequestRecord) -> None:
    """Fill `record` from a non-streamed answer body (also used by loadtest/locustfile.py)."""
    try:
        obj = json.loads(raw)
        if workload is Workload.TRANSLATE:
            record.finish_reason = obj["translations"][0].get("finish_reason")
        elif workload is Workload.GENERATE:
            record.finish_reason = obj.get("finish_reason")
        else:
            record.finish_reason = obj["choices"][0].get("finish_reason")
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
        record.error = f"bad_body: {type(e).__name__} {e} in {raw[:ERROR_BODY_CHARS]!r}"
        return
    _take_usage(obj.get("usage"), record)
    if not record.usage_reported:
        record.error = "bad_body: the answer has no usage.completion_tokens"


def _take_usage(usage: Any, record: RequestRecord) -> None:
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        record.output_tokens = usage["completion_tokens"]
        record.prompt_tokens = usage.get("prompt_tokens")
        record.usage_reported = True


async def _read_stream(resp: httpx.Response, workload: Workload, record: RequestRecord, t0: float) -> None:
    parser = StreamParser(workload, record)
    async for line in resp.aiter_lines():
        if parser.feed(line, time.perf_counter() - t0):
            break
    parser.finish()


class StreamParser:
    """Reads one SSE answer line by line into `record` (also used by loadtest/locustfile.py).

    `feed(line, now)` takes one line and its arrival time (run-relative seconds) and returns True when the
    stream has ended (final event, `[DONE]` or an error); `finish()` then checks that it ended properly.
    """

    def __init__(self, workload: Workload, record: RequestRecord) -> None:
        self.workload, self.record = workload, record
        self.done = False
        self.error: str | None = None

    def feed(self, line: str, now: float) -> bool:
        if not line.startswith("data:"):
            return False  # blank separators, comments, event:/id: fields
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return True
        try:
            event = json.loads(data)
        except ValueError:
            event = None
        if not isinstance(event, dict):
            self.error = f"bad_stream: not a JSON object: {data[:ERROR_BODY_CHARS]!r}"
            return True
        if "error" in event:
            self.error = f"stream_error: {str(event['error'])[:ERROR_BODY_CHARS]}"
            return True
        if self.workload is Workload.COMPLETIONS:
            self._completions_event(event, now)
            return False
        self._generate_event(event, now)
        return self.done

    def _generate_event(self, event: dict[str, Any], now: float) -> None:
        if "token" in event:
            self._token(now)
        if "finish_reason" in event:
            self.record.finish_reason = event["finish_reason"]
            _take_usage(event.get("usage"), self.record)
            self.done = True

    def _completions_event(self, event: dict[str, Any], now: float) -> None:
        for choice in event.get("choices") or []:
            if choice.get("text"):
                self._token(now)
            if choice.get("finish_reason"):
                self.record.finish_reason = choice["finish_reason"]
        _take_usage(event.get("usage"), self.record)

    def _token(self, now: float) -> None:
        r = self.record
        if r.ttft is None:
            r.ttft = now - r.start
        r.token_times.append(now - r.start)

    def finish(self) -> None:
        r = self.record
        if self.error:
            r.error = self.error
        elif not self.done:
            ending = "a final event" if self.workload is Workload.GENERATE else "data: [DONE]"
            r.error = f"incomplete_stream: the stream closed without {ending}"
        elif not r.usage_reported:
            r.output_tokens = len(r.token_times)  # the server did not say; count what came
