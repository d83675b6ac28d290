"""The gpu check's engine step: throughput by batching mode on the device, and batch invariance there.

Throughput is bench/engine.py's closed-loop benchmark as it is (continuous, request-level and no batching
alternated, at the plan's concurrencies, eos ignored) on the generate model, per variant; the step breakdown
(bench/breakdown.py) says where a continuous-batching step's time goes on the device, for the first variant.
Batch invariance: `invariance_requests` requests of mixed prompt and output lengths, greedy or seeded sampling,
submitted all at once, must produce exactly the tokens and finish reasons each produces alone, on each task's
fp32 bundle (the engine's promise: a request's text does not depend on what else runs).
"""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np

from bench.gpu_check.bundles import Bundles
from bench.gpu_check.plan import Plan, Step

INVARIANCE_VARIANT = "fp32"


def throughput(bundle: Path, device: str, plan: Plan) -> dict[str, Any]:
    from bench.engine import MODES, bench, bench_args, markdown

    args = bench_args(bundle, concurrency=list(plan.engine_concurrency), modes=[m.value for m in MODES],
                      requests_per_client=plan.engine_requests_per_client, rounds=1, min_new=plan.engine_min_new,
                      max_new=plan.engine_max_new, max_tokens_per_step=4096, provider=device)
    doc = asyncio.run(bench(args))
    return {"summary": doc["summary"], "provider": doc["provider"], "graph": doc["decoder_graph"],
            "slots": doc["slots"], "markdown": markdown(doc)}


def mixed_requests(n: int, vocab: int, max_len: int, lm: bool, sampled: bool, max_new: int, seed: int = 1) -> list:
    """n requests of 1-39 prompt tokens and 1-max_new output tokens; seeded sampling with varied knobs."""
    from serving.engine.types import GenerationRequest, SamplingParams

    rng, out = np.random.default_rng(seed), []
    for i in range(n):
        body = [int(x) for x in rng.integers(4, vocab, size=int(rng.integers(1, 40)))]
        prompt = [1, *body] if lm else body
        room = max_len - (len(prompt) if lm else 1) + 1
        p = SamplingParams(max_new_tokens=int(rng.integers(1, min(room, max_new) + 1)),
                           temperature=0.9 if sampled else 0.0, top_k=50 if sampled and i % 2 else 0,
                           top_p=0.9 if sampled and i % 3 == 0 else 1.0,
                           repetition_penalty=1.2 if sampled and i % 4 == 0 else 1.0,
                           seed=1000 + i if sampled else None)
        out.append(GenerationRequest(f"r{i}", prompt, p))
    return out


async def _outcomes(engine, reqs: list, together: bool) -> list[tuple[list[int], str | None]]:
    async def one(handle) -> tuple[list[int], str | None]:
        events = [e async for e in handle]
        return [e.token_id for e in events if e.token_id is not None], events[-1].finish_reason
    if together:
        return list(await asyncio.gather(*(one(engine.submit(r)) for r in reqs)))
    return [await one(engine.submit(r)) for r in reqs]


async def invariance(bundle: Path, device: str, plan: Plan, sampled: bool) -> dict[str, Any]:
    from serving.engine.config import EngineConfig
    from serving.engine.engine import Engine

    n = plan.invariance_requests
    engine = Engine.from_bundle(bundle, EngineConfig(max_slots=n, max_waiting=4 * n, max_tokens_per_step=4096,
                                                     provider=device))
    rt = engine.runtime
    reqs = mixed_requests(n, rt.vocab_size, rt.max_len, not rt.is_encoder_decoder, sampled, plan.invariance_max_new)
    await engine.start()
    try:
        together = await _outcomes(engine, reqs, together=True)
        alone = await _outcomes(engine, reqs, together=False)
    finally:
        await engine.stop()
    differ = [r.request_id for r, a, b in zip(reqs, together, alone) if a != b]
    return {"requests": n, "provider": rt.provider, "tokens": sum(len(t) for t, _ in together),
            "identical": n - len(differ), "differ": differ[:10], "passed": not differ}


def breakdown(bundle: Path, device: str, plan: Plan) -> dict[str, Any]:
    """Where a continuous-batching step's time goes on the device (bench/breakdown.py: inside ORT per graph,
    the runner's Python, the engine loop), at the plan's concurrencies, greedy."""
    from bench.breakdown import measure, table

    rows = measure([bundle], list(plan.engine_concurrency), requests_per_client=plan.engine_requests_per_client,
                   min_new=plan.engine_min_new, max_new=plan.engine_max_new, provider=device)[str(bundle)]
    return {"rows": rows, "markdown": table({"models": [{"bundle": str(bundle), "rows": rows}]})}


def run(step: Step, plan: Plan, bundles: Bundles, device: str) -> None:
    for variant in plan.engine_variants:
        path = bundles.get("generate", variant)
        if path is not None:
            step.data[f"throughput/generate/{variant}"] = throughput(path, device, plan)
    if (path := bundles.get("generate", plan.engine_variants[0])) is not None:
        step.data[f"breakdown/generate/{plan.engine_variants[0]}"] = breakdown(path, device, plan)
    for task in plan.tasks:
        path = bundles.get(task, INVARIANCE_VARIANT)
        if path is None:
            continue
        for kind in ("greedy", "seeded"):
            name = f"invariance/{task}/{kind}"
            step.data[name] = asyncio.run(invariance(path, device, plan, sampled=kind == "seeded"))
            step.check(name, step.data[name]["passed"])
    if not step.data:
        step.reason = "no bundle to run"
