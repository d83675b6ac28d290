"""The soak tool itself (slow): `python -m bench.soak` for one minute on a tiny generate model writes its JSON
and plot, sees no 5xx, finds the engine idle afterwards and compares the soaked server with a fresh copy beside it.
The 30-minute soak is `make soak`.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]


def test_the_summary_fits_growth_and_cpu_after_warm_up():
    from bench.soak import summary

    samples = [{"t": t, "rss_mb": {"ingress": 100 + (t - 60) / 60 if t >= 60 else 500.0},
                "cpu_s": {"ingress": 0.5 * t}, "p99_s": 0.1 if t < 300 else 0.2} for t in range(0, 901, 10)]
    s = summary(samples, warmup_s=60)
    assert s["rss_growth_mb_per_10min"] == {"ingress": 10.0}  # 1 MB a minute, the warm-up's 500 MB left out
    assert s["rss_growth_later"] == {"from_6min": {"ingress": 10.0}, "from_10min": {"ingress": 10.0}}
    flattening = [{**x, "rss_mb": {"ingress": min(x["t"], 600) / 60}} for x in samples]  # flat from minute 10
    assert summary(flattening, warmup_s=60)["rss_growth_later"] == {"from_6min": {"ingress": 4.47},
                                                                    "from_10min": {"ingress": 0.0}}
    assert s["cpu_cores"] == {"ingress": 0.5}
    assert (s["p99_first_third_s"], s["p99_last_third_s"]) == (0.1, 0.2)
    # with every request's latency: p99 over each third of the time after warm-up (60-340 s, 620-900 s), every
    # request counted, the warm-up's slow ones left out
    lat = [(t / 10, 9.0 if t < 600 else (0.5 if t % 100 == 0 else 0.1) if t < 6200 else 0.3) for t in range(9001)]
    pooled = summary(samples, warmup_s=60, latencies=lat)
    assert (pooled["p99_first_third_s"], pooled["p99_last_third_s"], pooled["p99_drift"]) == (0.5, 0.3, -0.4)


@pytest.mark.slow
@pytest.mark.parametrize("placement,roles", [("colocated", {"proxy", "haproxy", "ingress"}),
                                             ("split", {"proxy", "haproxy", "ingress", "replica"})])
def test_a_short_soak_writes_its_figures_and_leaves_the_engine_idle(bundles, tmp_path, placement, roles):
    out = tmp_path / "img"
    run = subprocess.run([sys.executable, "-m", "bench.soak", "--minutes", "1", "--artifacts", str(bundles),
                          "--out", str(out), "--placement", placement, "--compare-seconds", "10"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-3000:])
    result = json.loads((bundles / "bench" / "soak.json").read_text())
    assert result["placement"] == placement
    from serving.server.ray_env import MALLOC_ENV
    assert result["ingress_malloc_env"] == MALLOC_ENV  # the server's processes run with kvserve's arenas
    assert (out / "soak.png").stat().st_size > 10_000
    assert not [s for s in result["statuses"] if s.startswith("5")] and result["statuses"].get("200", 0) > 0
    assert set(result["rss_growth_mb_per_10min"]) == roles  # HAProxy too: Serve's data plane
    assert result["idle_after"] == {"kvserve_kv_slots_used": 0.0, "kvserve_waiting_requests": 0.0,
                                    "kvserve_running_requests": 0.0}
    model = "replica" if placement == "split" else "ingress"  # the process that runs the engine
    assert len(result["samples"]) >= 5 and all(s["rss_mb"][model] for s in result["samples"])
    assert set(result["cpu_cores"]) == roles and 0 < result["cpu_cores"][model] < 4
    assert result["cpu_cores"]["haproxy"] < 0.5  # no spinning HAProxy (serving/server/launch.py)
    cap = result["capacity_req_s"]  # the soaked server and a fresh copy beside it, measured alternately at the end
    assert min(cap["start"], cap["soaked"], cap["fresh"]) > 0
    assert cap["soaked_over_fresh"] == round(cap["soaked"] / cap["fresh"], 3)
    side = result["side_by_side"]  # both answered the soak's load, each its own p99
    assert all(side["statuses"][s].get("200", 0) > 0 for s in ("soaked", "fresh")), side
    assert not [k for s in side["statuses"].values() for k in s if k.startswith("5")], side
    assert side["p99_soaked_over_fresh"] == round(side["p99_s"]["soaked"] / side["p99_s"]["fresh"], 3)
