"""serving/server/chunks.py: the first item at once, then at most one chunk per interval, nothing lost or reordered."""
import asyncio
import time

import pytest

from serving.server.chunks import coalesce


async def ticking(n: int, gap_s: float, final_at: int | None = None, fail_after: int | None = None,
                  closed: list | None = None):
    try:
        for i in range(n):
            if fail_after is not None and i == fail_after:
                raise ValueError("the source failed")
            yield ("final", i) if i == final_at else i
            await asyncio.sleep(gap_s)
    finally:
        if closed is not None:
            closed.append(True)


async def collect(source, interval_s, **kw) -> tuple[list[list], list[float]]:
    chunks, times, t0 = [], [], time.monotonic()
    async for chunk in coalesce(source, interval_s, **kw):
        chunks.append(chunk)
        times.append(time.monotonic() - t0)
    return chunks, times


async def test_first_item_alone_at_once_then_one_chunk_per_interval_in_order():
    chunks, times = await collect(ticking(40, 0.005), 0.05)
    assert chunks[0] == [0] and times[0] < 0.03
    assert [x for c in chunks for x in c] == list(range(40))  # nothing lost, nothing reordered
    assert len(chunks) <= 2 + times[-1] / 0.05  # ~5 chunks, not 40 items: one per interval of the real span
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert min(gaps) >= 0.045  # never two chunks within the interval


async def test_the_final_item_goes_out_without_waiting():
    chunks, times = await collect(ticking(2, 0.001, final_at=1), 5.0, is_final=lambda x: isinstance(x, tuple))
    assert [x for c in chunks for x in c] == [0, ("final", 1)]
    assert times[-1] < 1.0


async def test_zero_interval_sends_what_is_ready():
    async def burst():
        for i in range(5):
            yield i
        await asyncio.sleep(0.01)
        yield 5
    chunks, _ = await collect(burst(), 0.0)
    assert [x for c in chunks for x in c] == list(range(6)) and len(chunks) < 6


async def test_an_error_of_the_source_comes_after_the_items_before_it():
    seen = []
    with pytest.raises(ValueError, match="the source failed"):
        async for chunk in coalesce(ticking(10, 0.001, fail_after=3), 0.0):
            seen += chunk
    assert seen == [0, 1, 2]


async def test_an_empty_source_yields_nothing():
    async def empty():
        return
        yield  # pragma: no cover
    assert (await collect(empty(), 0.1))[0] == []


async def test_closing_the_consumer_closes_the_source():
    closed: list = []
    gen = coalesce(ticking(1000, 0.001, closed=closed), 0.01)
    assert await gen.__anext__() == [0]
    await gen.aclose()
    await asyncio.sleep(0)
    assert closed == [True]


async def test_in_one_process_pieces_go_on_one_by_one_and_closing_closes_the_source():
    """A colocated model's stream (serving/server/local_model.py): no queue, no task; the consumer going away
    closes the source (the engine request is cancelled there)."""
    from serving.server.local_model import _one_by_one

    closed = asyncio.Event()

    async def source():
        try:
            for i in range(100):
                yield i
                await asyncio.sleep(0)
        finally:
            closed.set()

    chunks = _one_by_one(source())
    assert [await chunks.__anext__() for _ in range(3)] == [[0], [1], [2]]
    await chunks.aclose()
    assert closed.is_set()
    assert [c async for c in _one_by_one(source())] == [[i] for i in range(100)]
