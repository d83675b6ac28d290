"""ONNX Runtime session settings, measured on the engine: graph optimization level, intra-op threads, spinning.

    python -m bench.ort_settings artifacts/bundles/generate artifacts/bundles/translate [--rounds 3]

For each bundle and each setting, the continuous-batching engine in-process (bench/engine.py's closed loop:
C clients, prompts of 4-24 tokens, outputs of 8-128 tokens, eos ignored, 32 KV slots) at 1 and 32 clients;
the settings alternate within every round (the order flips each round) and each keeps its best round (noise
only ever slows a run down). A setting is applied to every session the runtime opens:
- `opt=all|extended|basic|disabled`: `graph_optimization_level` (ORT's default: all);
- `threads=N`: `intra_op_num_threads` (the runtime's `intra_op_threads`, the Serve config's
  `engine.intra_op_threads`; kvserve's default: 1);
- `spin=0|1`: `session.intra_op.allow_spinning` (ORT's default 1: pool threads spin between parallel
  sections, which with more than one thread keeps a core busy while Python runs between steps).

Does not measure: HTTP, other processes sharing the cores (a server's event loop, the load generator), which
a spinning pool takes CPU from. Owns this comparison only.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import onnxruntime as ort

from serving.engine import runtime as runtime_module

LEVELS = {"all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL, "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
          "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC, "disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL}
DEFAULT_SETTINGS = ("opt=all,threads=1", "opt=extended,threads=1", "opt=basic,threads=1",
                    "opt=all,threads=2,spin=1", "opt=all,threads=2,spin=0")


def parse(setting: str) -> dict[str, str]:
    """`opt=all,threads=2,spin=0` -> {"opt": "all", "threads": "2", "spin": "0"}."""
    out = dict(part.split("=", 1) for part in setting.split(",") if part)
    unknown = set(out) - {"opt", "threads", "spin"}
    if unknown or out.get("opt", "all") not in LEVELS or out.get("spin", "1") not in ("0", "1"):
        raise ValueError(f"setting {setting!r}: give opt={'|'.join(LEVELS)}, threads=N, spin=0|1")
    return out


@contextlib.contextmanager
def session_options(setting: dict[str, str]) -> Iterator[None]:
    """Every ort.SessionOptions the runtime creates inside this block carries `setting` (the runtime sets the
    thread count itself, from its `intra_op_threads`)."""
    base = ort.SessionOptions

    class Options(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.graph_optimization_level = LEVELS[setting.get("opt", "all")]
            if "spin" in setting:
                self.add_session_config_entry("session.intra_op.allow_spinning", setting["spin"])
    runtime_module.ort.SessionOptions = Options
    try:
        yield
    finally:
        runtime_module.ort.SessionOptions = base


async def engine_tokens_per_s(bundle: Path, setting: dict[str, str], concurrency: list[int],
                             rounds: int = 1) -> dict[int, float]:
    """Steady-state tokens/s of the continuous engine under `setting`, per concurrency (bench/engine.py)."""
    import bench.engine as bench_engine

    ns = bench_engine.bench_args(bundle, concurrency=concurrency, modes=["continuous"], requests_per_client=4,
                                 rounds=rounds, slots=32, provider="cpu", threads=int(setting.get("threads", 1)))
    with session_options(setting):
        doc = await bench_engine.bench(ns)
    return {r["concurrency"]: r["busy_tokens_per_s"] for r in doc["summary"]}


def run(bundles: list[Path], settings: list[str], concurrency: list[int], rounds: int) -> dict[str, Any]:
    best: dict[tuple[str, str, int], float] = {}
    for rnd in range(rounds):
        for bundle in bundles:
            order = settings if rnd % 2 == 0 else list(reversed(settings))
            for s in order:
                got = asyncio.run(engine_tokens_per_s(bundle, parse(s), concurrency))
                for c, tps in got.items():
                    key = (bundle.name, s, c)
                    best[key] = max(best.get(key, 0.0), tps)
                print(f"round {rnd} {bundle.name} {s}: " + ", ".join(f"{c} clients {t:.0f} tok/s" for c, t in got.items()),
                      file=sys.stderr, flush=True)
    return {"settings": settings, "concurrency": concurrency, "rounds": rounds,
            "best": [{"bundle": b, "setting": s, "concurrency": c, "tokens_per_s": round(t)} for (b, s, c), t in best.items()]}


def markdown(result: dict[str, Any]) -> str:
    cs = result["concurrency"]
    lines = ["| model | setting | " + " | ".join(f"{c} clients tok/s" for c in cs) + " |",
             "| --- | --- | " + " | ".join("---:" for _ in cs) + " |"]
    rows: dict[tuple[str, str], dict[int, int]] = {}
    for r in result["best"]:
        rows.setdefault((r["bundle"], r["setting"]), {})[r["concurrency"]] = r["tokens_per_s"]
    for (b, s), by in rows.items():
        lines.append(f"| {b} | `{s}` | " + " | ".join(f"{by.get(c, 0):,}" for c in cs) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ort_settings", description=__doc__.split("\n\n")[0])
    p.add_argument("bundles", nargs="+", type=Path)
    p.add_argument("--settings", nargs="+", default=list(DEFAULT_SETTINGS))
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    for s in args.settings:
        parse(s)
    print(markdown(run(args.bundles, args.settings, args.concurrency, args.rounds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
