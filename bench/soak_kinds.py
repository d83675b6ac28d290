"""Which requests make the server's processes grow: RSS per 1,000 requests of one kind at a time.

    python -m bench.soak_kinds [--placement split] [--kinds plain,stream,drop,giveup] [--batches 10]
                               [--per-batch 1000] [--clients 16] [--artifacts artifacts] [--raw FILE]

Deploys the soak's application (bench/soak.py) and, for each kind of the soak's requests (plain, stream, drop: a
stream the client drops after three tokens, giveup: a plain request the client abandons after 0.3 s), sends
`batches` batches of `per_batch` requests of that kind from `clients` closed-loop clients, sampling the RSS of
the ingress and the model replica after each batch. Reports each process's growth per 1,000 requests fitted over
the batches after the first two (least squares; the first two warm up whatever the kind touches first) and the
statuses; writes --raw. A kind whose growth stays well above the others' is what to look at in a soak's curve.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from bench.soak import _one, free_port, processes, slope, soak_config

WARM_BATCHES = 2  # left out of the fit


async def batch(base: str, kind: str, n: int, clients: int) -> Counter:
    """`n` requests of `kind` from `clients` closed-loop clients; their outcomes."""
    outcomes: Counter = Counter()
    left = n
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        async def loop() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                outcome, _ = await _one(client, kind)
                outcomes[outcome] += 1
        await asyncio.gather(*(loop() for _ in range(clients)))
    return outcomes


def slope_per_1000(points: list[tuple[int, float]]) -> float | None:
    """Least-squares MB per 1,000 requests of (requests so far, RSS MB) points."""
    per_request = slope(points)
    return round(1000 * per_request, 3) if per_request is not None else None


def measure(base: str, kinds: list[str], batches: int, per_batch: int, clients: int) -> dict[str, Any]:
    """Per kind: the RSS (MB) of the ingress and the replica after each batch, the growth, the outcomes."""
    procs = {r: p for r, p in processes().items() if r in ("ingress", "replica")}
    out: dict[str, Any] = {}
    for kind in kinds:
        rss: dict[str, list[float]] = {r: [] for r in procs}
        outcomes: Counter = Counter()
        t0 = time.monotonic()
        for i in range(batches):
            outcomes.update(asyncio.run(batch(base, kind, per_batch, clients)))
            for role, p in procs.items():
                rss[role].append(round(p.memory_info().rss / 2**20, 2))
            print(f"\r {kind} batch {i + 1}/{batches} {({r: v[-1] for r, v in rss.items()})} {dict(outcomes)}",
                  end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
        growth = {role: slope_per_1000([((i + 1) * per_batch, v) for i, v in enumerate(vs)][WARM_BATCHES:])
                  for role, vs in rss.items()}
        out[kind] = {"mb_per_1000": growth, "rss_mb": rss, "outcomes": dict(outcomes),
                     "seconds": round(time.monotonic() - t0, 1)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak_kinds", description=__doc__.split("\n\n")[0])
    p.add_argument("--placement", choices=("colocated", "split"), default="split")
    p.add_argument("--kinds", default="plain,stream,drop,giveup")
    p.add_argument("--batches", type=int, default=10)
    p.add_argument("--per-batch", type=int, default=1000)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--artifacts", type=Path, default=Path("artifacts"), help="holds bundles/generate")
    p.add_argument("--raw", type=Path, default=None,
                   help="the figures' JSON (default: ARTIFACTS/bench/soak_kinds.json)")
    args = p.parse_args(argv)
    if args.batches <= WARM_BATCHES + 1:
        p.error(f"--batches must be more than {WARM_BATCHES + 1}: the first {WARM_BATCHES} are not fitted")
    from serving.server.config import validate_serve_config
    from serving.server.launch import start, stop

    port = free_port()
    start(validate_serve_config(soak_config(args.artifacts, port, args.placement)), timeout_s=600)
    try:
        result = {"placement": args.placement, "per_batch": args.per_batch, "clients": args.clients,
                  "kinds": measure(f"http://127.0.0.1:{port}", args.kinds.split(","), args.batches,
                                   args.per_batch, args.clients)}
    finally:
        stop()
    raw = args.raw or args.artifacts / "bench" / "soak_kinds.json"
    raw.parent.mkdir(parents=True, exist_ok=True)
    raw.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: {"mb_per_1000": v["mb_per_1000"], "outcomes": v["outcomes"]}
                      for k, v in result["kinds"].items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
