"""Driving the server with wrk, a load generator written in C, beside a one-client TTFT probe.

On a machine with few cores the load generator shares them with the server: kvserve's own load tester
(Python, asyncio + httpx) spends about 0.4 of a core at 32 streaming clients, which the server then lacks,
so through it the HTTP path measures the client as much as the server. wrk (https://github.com/wg/wrk,
Debian/Ubuntu package `wrk`) spends a few hundredths of a core on the same load. Here it runs closed-loop
connections (each sends its next request when the last answer is complete) with request bodies prepared by
loadtest/workloads.py (the same prompts, seeds and output lengths as the Python runs), counts the tokens of
every complete answer from its `usage.completion_tokens` (both `/v1/generate`'s final stream event and
`/v1/completions` carry it) in a Lua response hook, and reports its own CPU. wrk sees whole responses only, so
one more client, in Python, sends streaming requests one after another meanwhile and times the first token
of each: the load's TTFT as a client sees it.

Does not own: the server (bench/http.py), the bodies (loadtest/workloads.py).
"""
from __future__ import annotations

import contextlib
import json
import re
import resource
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

LUA = """
bodies = {%(bodies)s}
i, tokens, answers = %(offset)d, 0, 0  -- globals: done() reads them through thread:get
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
%(headers)srequest = function()
  i = i %% #bodies + 1
  return wrk.format(nil, "%(path)s", nil, bodies[i])
end
response = function(status, headers, body)
  local n = body:match('"completion_tokens":%%s*(%%d+)')
  if status == 200 and n then tokens = tokens + tonumber(n); answers = answers + 1 end
end
threads = {}
setup = function(thread) table.insert(threads, thread) end
done = function(summary, latency, requests)
  local t, a = 0, 0
  for _, thread in ipairs(threads) do t = t + thread:get("tokens"); a = a + thread:get("answers") end
  io.write(string.format("KVSERVE_WRK %%d %%d %%d %%d %%d %%d\\n", t, a, summary.duration,
    latency:percentile(50), latency:percentile(99), summary.errors.status + summary.errors.timeout))
end
"""


def wrk_path() -> str | None:
    return shutil.which("wrk")


def _lua(bodies: list[str], path: str, offset: int, headers: dict[str, str] | None = None) -> str:
    def quote(body: str) -> str:
        level = next(n for n in range(1, 10) if f"]{'=' * n}]" not in body)
        return f"[{'=' * level}[{body}]{'=' * level}]"
    extra = "".join(f"wrk.headers[{json.dumps(k)}] = {json.dumps(v)}\n" for k, v in (headers or {}).items())
    return LUA % {"bodies": ",".join(map(quote, bodies)), "path": path, "offset": offset, "headers": extra}


class TtftProbe:
    """One streaming `/v1/generate` client in a thread: request after request, the time to the first `data:`
    event of each, and the tokens of each complete answer."""

    def __init__(self, url: str, bodies: list[dict[str, Any]], timeout_s: float) -> None:
        self.url, self.bodies, self.timeout_s = url, bodies, timeout_s
        self.ttfts: list[float] = []
        self.tokens = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ttft-probe", daemon=True)

    def __enter__(self) -> "TtftProbe":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(self.timeout_s)

    def _run(self) -> None:
        with httpx.Client(timeout=self.timeout_s, trust_env=False) as client:
            i = 0
            while not self._stop.is_set():
                body = {**self.bodies[i % len(self.bodies)], "stream": True}
                i += 1
                t0 = time.perf_counter()
                try:
                    with client.stream("POST", self.url + "/v1/generate", json=body) as resp:
                        first, last = True, ""
                        for line in resp.iter_lines():
                            if line.startswith("data:"):
                                if first:
                                    self.ttfts.append(time.perf_counter() - t0)
                                    first = False
                                last = line
                    n = re.search(r'"completion_tokens":\s*(\d+)', last)
                    if resp.status_code == 200 and n and not self._stop.is_set():
                        self.tokens += int(n.group(1))
                except httpx.HTTPError:
                    continue


def run_wrk(url: str, path: str, bodies: list[dict[str, Any]], connections: int, seconds: float,
            probe_bodies: list[dict[str, Any]] | None = None, timeout_s: float = 60.0, offset: int | None = None,
            headers: dict[str, str] | None = None) -> dict[str, Any]:
    """`connections` closed-loop clients for `seconds`: wrk's, and the TTFT probe as the last one when
    `probe_bodies` (streaming `/v1/generate` bodies) are given; tokens/s from the answers completed meanwhile.
    wrk sends `bodies` in order from `offset` (default: the middle), wrapping around; `headers` go with each."""
    probe = bool(probe_bodies)
    exe = wrk_path()
    if exe is None:
        raise FileNotFoundError("wrk is not installed (Debian/Ubuntu: apt-get install wrk)")
    n = connections - 1 if probe else connections
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "kvserve.lua"
        script.write_text(_lua([json.dumps(b) for b in bodies], path, len(bodies) // 2 if offset is None else offset,
                               headers))
        cmd = [exe, "-t1", f"-c{n}", f"-d{max(1, round(seconds))}s", "--timeout", f"{timeout_s:g}s", "-s", str(script),
               url]
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        probe_ctx = TtftProbe(url, probe_bodies or [], timeout_s) if probe else None
        with probe_ctx or contextlib.nullcontext():
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + timeout_s + 30)
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    m = re.search(r"KVSERVE_WRK (\d+) (\d+) (\d+) (\d+) (\d+) (\d+)", out.stdout)
    if out.returncode != 0 or m is None:
        raise RuntimeError(f"wrk failed ({out.returncode}): {out.stderr.strip() or out.stdout.strip()}")
    tokens, answers, duration_us, p50_us, p99_us, errors = map(int, m.groups())
    wall = duration_us / 1e6
    ttfts = sorted(probe_ctx.ttfts) if probe_ctx else []
    probe_tokens = probe_ctx.tokens if probe_ctx else 0
    return {"connections": n, "probe": probe, "seconds": wall, "answers": answers, "wrk_tokens": tokens,
            "probe_tokens": probe_tokens, "output_tokens_per_s": (tokens + probe_tokens) / wall,
            "requests_per_s": answers / wall, "e2e_p50_s": p50_us / 1e6, "e2e_p99_s": p99_us / 1e6, "errors": errors,
            "load_generator_cpu": (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) / wall,
            "probe_requests": len(ttfts), "ttft_p50_s": _pct(ttfts, 0.5), "ttft_p99_s": _pct(ttfts, 0.99)}


def _pct(xs: list[float], q: float) -> float | None:
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None
