"""SIGTERM to the images' entry point, `kvserve serve`, with streams in flight (slow; a Ray cluster of its own).

`kvserve serve` runs as a subprocess, exactly as the Docker images run it (`kvserve serve --config ...`), with
a model slow enough that 20 streams of 200 tokens are still running when the process gets SIGTERM (what
`docker stop` and a pod's deletion send). Then: no stream is cut short (each reaches its final event), new
requests get 503 + Retry-After while it drains, and the process exits within the drain timeout.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from conftest import free_port, wait_serving
from reliability_cluster import write_long_bundles

pytestmark = [pytest.mark.slow, pytest.mark.cluster]  # the cluster suite CI runs (`make test-cluster`)
ROOT = Path(__file__).resolve().parents[1]
STREAMS, TOKENS = 20, 200


def _config(art: Path, port: int, path: Path) -> Path:
    """The shipped config (the models in the ingress replica) serving one model, `generate`, from bundles/long."""
    cfg = yaml.safe_load((ROOT / "deploy" / "serve_config.yaml").read_text())
    cfg["http_options"]["port"] = port
    app = cfg["applications"][0]
    app["args"]["models"] = [{"name": "generate", "bundle": "bundles/long", "colocated": True,
                              "engine": {"max_slots": 32, "intra_op_threads": 1, "provider": "cpu"}}]
    ingress = next(d for d in app["deployments"] if d["name"] == "ingress")
    ingress["ray_actor_options"] = {"num_cpus": 0.5}
    ingress["user_config"]["models"] = {"generate": ingress["user_config"]["models"]["generate"]}
    path.write_text(yaml.safe_dump(cfg))
    return path


def _stream(base: str, out: list, started: threading.Event) -> None:
    """One stream; `started` is set at its first event, or when it ended without one (its entry in `out` says why:
    a status, or the exception in place of the events)."""
    body = {"prompt": "the quick brown fox", "max_tokens": TOKENS, "ignore_eos": True, "stream": True}
    events: list = []
    status = None
    try:
        with httpx.Client(base_url=base, timeout=120) as c, c.stream("POST", "/v1/generate", json=body) as r:
            status = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    started.set()
    except httpx.HTTPError as e:
        events.append({"error": repr(e)})
    finally:
        out.append((status, events, time.monotonic()))
        started.set()


def test_sigterm_drains_streams_refuses_new_requests_and_exits(bundles, tmp_path):
    write_long_bundles(bundles)
    port = free_port()
    config = _config(bundles, port, tmp_path / "serve_config.yaml")
    log = tmp_path / "serve.log"  # a file, not a pipe: nobody reads a pipe while the streams run
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvserve", "serve", "--config", str(config), "--artifacts",
                                 str(bundles), "--num-cpus", "2"], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_serving(proc, log)
        base = f"http://127.0.0.1:{port}"
        results: list = []
        firsts = [threading.Event() for _ in range(STREAMS)]
        threads = [threading.Thread(target=_stream, args=(base, results, e), daemon=True) for e in firsts]
        for t in threads:
            t.start()
        assert all(e.wait(60) for e in firsts), "the streams did not start"
        assert not results, f"streams ended before the signal: {[(s, e[-1:]) for s, e, _ in results]}"
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        refused = _first_refusal(base)
        refused_at = time.monotonic()
        for t in threads:
            t.join(120)
        code = proc.wait(timeout=120)
        exited_s = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    whole = [events for status, events, _ in results if status == 200 and events and "finish_reason" in events[-1]]
    still_streaming = sum(ended > refused_at for _, _, ended in results)
    print(f"SIGTERM with {STREAMS} streams in flight: {len(whole)} finished whole, new requests refused with "
          f"{refused} while {still_streaming} streams were still running, process exited {exited_s:.1f}s after the "
          f"signal (code {code})")
    assert len(whole) == STREAMS, [(s, e[-1] if e else None) for s, e, _ in results]
    assert still_streaming > 0, "every stream ended before the drain refused a request: nothing was in flight"
    assert all(len(events) == TOKENS + 1 for events in whole)  # every token, then the final event
    assert refused is not None and refused[0] == 503 and refused[1] is not None, refused
    assert code == 0 and exited_s < 60 + 30, (code, exited_s, log.read_text()[-2000:])


def _first_refusal(base: str, timeout_s: float = 15) -> tuple[int, str | None] | None:
    """(status, Retry-After) of the first new request the draining server refuses."""
    t0 = time.monotonic()
    with httpx.Client(base_url=base, timeout=10) as c:
        while time.monotonic() - t0 < timeout_s:
            try:
                r = c.post("/v1/generate", json={"prompt": "a", "max_tokens": 1})
            except httpx.HTTPError:
                return None
            if r.status_code != 200:
                return r.status_code, r.headers.get("retry-after")
            time.sleep(0.05)
    return None
