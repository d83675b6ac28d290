"""Test helpers shared by the engine tests: run requests through an engine and collect their events."""
from __future__ import annotations

import asyncio
import time

from serving.engine.engine import Engine
from serving.engine.types import FinishReason, GenerationRequest, TokenEvent


def slow_steps(engine: Engine, seconds: float) -> Engine:
    """Every step of this engine's runtime takes `seconds` longer (on the step thread, as a slow ONNX Runtime call
    would): a tiny model's steps take ~30 us on a fast machine, so a test that must act in the middle of a request
    holds them."""
    step = engine.runtime.step

    def slow_step(*a, **kw):
        time.sleep(seconds)
        return step(*a, **kw)
    engine.runtime.step = slow_step  # instance attribute: this engine's runtime only
    return engine


async def collect(handle) -> list[TokenEvent]:
    return [event async for event in handle]


async def run_all(engine: Engine, reqs: list[GenerationRequest]) -> list[list[TokenEvent]]:
    """Submit all at once (they run concurrently) and wait for every stream to end."""
    handles = [engine.submit(r) for r in reqs]
    return list(await asyncio.gather(*(collect(h) for h in handles)))


async def run_alone(engine: Engine, reqs: list[GenerationRequest]) -> list[list[TokenEvent]]:
    """Each request on its own, one after the other."""
    return [(await run_all(engine, [r]))[0] for r in reqs]


def tokens(events: list[TokenEvent]) -> list[int]:
    return [e.token_id for e in events if e.token_id is not None]


def outcome(events: list[TokenEvent]) -> tuple[list[int], FinishReason | None]:
    assert events and events[-1].finish_reason is not None
    assert all(e.finish_reason is None for e in events[:-1])
    return tokens(events), events[-1].finish_reason
