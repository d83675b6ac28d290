"""Twelve models on a pool of two replicas that hold four each, under a skewed load (slow; not in CI: ~10 min).

The repository: ten Marian models of different sizes built and imported locally (tests/marian_checkpoint.py,
`kvserve import marian`) and the project's two tiny bundles. The pool: 2 replicas, `max_models_per_replica: 4`.
The load: 8 clients send 1,500 requests, the model of each drawn from a Zipf distribution (s = 1.1) over the twelve,
the text from five sentences. The acceptance: 0 failed requests; every answer equals that model's served alone
(each model in-process, one at a time, the same request); loads, evictions and the cold-start latency reported;
the models each replica holds over time as a plot.

    KVSERVE_POOL_OUT=docs/img pytest tests/test_pool_load.py -m slow -s
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from integration_cluster import integration_config
from marian_checkpoint import build_marian_checkpoint
from test_pool_cluster import variant

pytestmark = pytest.mark.slow

SIZES = [(16, 1), (32, 1), (32, 2), (48, 2), (64, 1), (64, 2), (64, 3), (96, 2), (128, 2), (128, 3)]  # (d_model, layers)
TEXTS = ["the king is dead", "to be or not to be", "my lord, the queen", "what news from rome", "good night"]
CLIENTS, REQUESTS, ZIPF_S = 8, 1500, 1.1


def build_repository(root: Path, bundles: Path) -> list[str]:
    names = []
    for i, (d, layers) in enumerate(SIZES):
        # weights drawn narrower as the model widens, so that logits (and float32 rounding) stay at one scale and
        # the import's parity check (1e-4 on the logits) holds for every size
        ckpt = build_marian_checkpoint(root.parent / f"marian-{i}", seed=i, d_model=d, layers=layers, ffn=2 * d,
                                       init_std=0.4 * (16 / d) ** 0.5)
        name = f"opus-{i:02d}"
        done = subprocess.run([sys.executable, "-m", "kvserve", "import", "marian", str(ckpt), "--out",
                               str(root / name)], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        names.append(name)
    variant(bundles / "bundles" / "translate", root / "kvserve-mt", [])
    variant(bundles / "bundles" / "generate", root / "kvserve-lm", [])
    return names + ["kvserve-mt", "kvserve-lm"]


def body(model: str, text: str) -> tuple[str, dict]:
    if model == "kvserve-lm":
        return "/v1/generate", {"model": model, "prompt": text, "max_tokens": 8}
    return "/v1/translate", {"model": model, "text": text, "max_tokens": 8}


def answer(r: httpx.Response) -> str:
    b = r.json()
    return b["text"] if "text" in b else b["translations"][0]["text"]


def references(repo: Path, names: list[str]) -> dict[tuple[str, str], str]:
    """Each model served alone, in-process: its answer to each text."""
    from serving.engine.config import ReplicaKnobs
    from serving.engine.types import SamplingParams
    from serving.server.config import Limits
    from serving.server.model_pool import ModelPool
    from serving.server.repository import Repository
    from serving.server.service import TextRequest

    async def run() -> dict[tuple[str, str], str]:
        pool = ModelPool(Repository([repo]), Limits(), None, max_models=1,
                         engine=ReplicaKnobs(max_slots=2, provider="cpu", intra_op_threads=1))
        out = {}
        for name in names:
            for text in TEXTS:
                req = TextRequest(text, SamplingParams(max_new_tokens=8), time.time() + 60)
                out[(name, text)] = (await pool.complete(name, req)).text
        await pool.close()
        return out

    return asyncio.run(run())


def replica_holdings() -> dict[str, int]:
    """Models each pool replica holds now, from the nodes' raw metrics (kvserve_model_bytes > 0, by replica)."""
    from serving.server.metrics import RayNodeScraper

    held: dict[str, int] = {}
    for text in asyncio.run(RayNodeScraper().texts()):
        for line in text.splitlines():
            m = re.match(r"^ray_kvserve_model_bytes\{(.*)\} (\S+)$", line)
            if m and float(m.group(2)) > 0:
                replica = re.search(r'replica="([^"]+)"', m.group(1))
                key = replica.group(1) if replica else "?"
                held[key] = held.get(key, 0) + 1
    return held


def serve_pool(bundles: Path, repo: Path, port: int) -> str:
    """The integration config's `translate` plus the repository on a pool of 2 replicas of 4; its base URL."""
    from serving.server.config import validate_serve_config
    from serving.server.launch import start

    cfg = integration_config(bundles, port)
    app = cfg["applications"][0]
    app["args"]["models"] = [m for m in app["args"]["models"] if m["name"] == "translate"]
    app["args"]["repository"] = {"paths": [str(repo)], "max_models_per_replica": 4,
                                 "engine": {"max_slots": 4, "intra_op_threads": 1}}
    app["deployments"] = [d for d in app["deployments"] if d["name"] in ("ingress", "translate")]
    app["deployments"].append({"name": "pool", "num_replicas": 2, "max_ongoing_requests": 32,
                               "ray_actor_options": {"num_cpus": 0.1}, "graceful_shutdown_timeout_s": 5})
    start(validate_serve_config(cfg), timeout_s=300)
    return f"http://127.0.0.1:{cfg['http_options']['port']}"


def zipf_plan(names: list[str]) -> list[tuple[str, str]]:
    rng = np.random.default_rng(0)
    weights = 1.0 / np.arange(1, len(names) + 1) ** ZIPF_S
    return [(names[int(rng.choice(len(names), p=weights / weights.sum()))], TEXTS[int(rng.integers(len(TEXTS)))])
            for _ in range(REQUESTS)]


def drive(base: str, plan: list[tuple[str, str]]) -> list[tuple[str, str, int, str, float]]:
    """CLIENTS clients through the plan: (model, text, status, answer or error, seconds) per request."""
    results: list[tuple[str, str, int, str, float]] = []

    async def run() -> None:
        queue: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
        for item in plan:
            queue.put_nowait(item)
        async with httpx.AsyncClient(base_url=base, timeout=120) as c:
            async def client() -> None:
                while not queue.empty():
                    model, text = queue.get_nowait()
                    path, b = body(model, text)
                    t0 = time.monotonic()
                    r = await c.post(path, json=b)
                    results.append((model, text, r.status_code, answer(r) if r.status_code == 200 else r.text,
                                    time.monotonic() - t0))
            await asyncio.gather(*(client() for _ in range(CLIENTS)))

    asyncio.run(run())
    return results


class Sampler:
    """Models held per replica, every half second, in a thread of its own."""

    def __init__(self) -> None:
        self.timeline: list[tuple[float, dict[str, int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.timeline.append((time.monotonic(), replica_holdings()))
            self._stop.wait(0.5)

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def figures_of(results: list, names: list[str], metrics: str, elapsed: float, wrong: list, failed: list) -> dict:
    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", metrics, re.M))

    latencies = np.array([r[4] for r in results])
    return {"models": len(names), "replicas": 2, "max_models_per_replica": 4, "requests": len(results),
            "failed": len(failed), "answers_differing_from_alone": len(wrong), "seconds": round(elapsed, 1),
            "requests_per_model": {n: sum(1 for r in results if r[0] == n) for n in names},
            "loads": total("kvserve_model_loads_total"), "evictions": total("kvserve_model_evictions_total"),
            "mean_load_s": round(total("kvserve_model_load_seconds_sum")
                                 / max(total("kvserve_model_load_seconds_count"), 1), 3),
            "latency_p50_s": round(float(np.percentile(latencies, 50)), 3),
            "latency_p99_s": round(float(np.percentile(latencies, 99)), 3),
            "latency_max_s": round(float(latencies.max()), 3)}


def test_twelve_models_on_two_replicas_of_four_under_a_zipf_load(bundles, ray_cluster, tmp_path_factory):
    repo = tmp_path_factory.mktemp("pool") / "repository"
    repo.mkdir()
    names = build_repository(repo, bundles)
    want = references(repo, names)
    base = serve_pool(bundles, repo, ray_cluster["port"])
    t0 = time.monotonic()
    with Sampler() as sampler:
        results = drive(base, zipf_plan(names))
    elapsed = time.monotonic() - t0
    failed = [r for r in results if r[2] != 200]
    wrong = [r for r in results if r[2] == 200 and r[3] != want[(r[0], r[1])]]
    figures = figures_of(results, names, httpx.get(base + "/metrics").text, elapsed, wrong, failed)
    print(json.dumps(figures, indent=1))
    out = os.environ.get("KVSERVE_POOL_OUT")
    if out:
        _plot(sampler.timeline, t0, Path(out) / "pool_models_per_replica.png")
        (Path(out) / "pool_load.json").write_text(json.dumps(figures, indent=1))
    assert not failed, failed[:5]
    assert not wrong, wrong[:5]
    assert figures["evictions"] > 0 and figures["loads"] >= len(names)  # the twelve did not fit: evicted, reloaded
    assert all(max(h.values(), default=0) <= 4 for _, h in sampler.timeline)


def _plot(timeline: list[tuple[float, dict[str, int]]], t0: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    replicas = sorted({r for _, h in timeline for r in h})
    fig, ax = plt.subplots(figsize=(7, 3))
    for i, replica in enumerate(replicas):
        ax.step([t - t0 for t, _ in timeline], [h.get(replica, 0) for _, h in timeline], where="post",
                label=f"replica {i + 1}")
    ax.set_xlabel("seconds into the load")
    ax.set_ylabel("models held")
    ax.set_ylim(0, 5)
    ax.set_title("12 models, 2 pool replicas of at most 4, Zipf load")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
