"""serving/engine/outbox.py: the step thread's hand-over to the event loop keeps its order, survives a failing
consumer and goes nowhere once closed."""

from __future__ import annotations

import asyncio
import threading

from serving.engine.outbox import Outbox


async def _settle(loop_turns: int = 50) -> None:
    for _ in range(loop_turns):
        await asyncio.sleep(0.002)


def test_events_arrive_in_order_from_several_threads_on_the_event_loop() -> None:
    async def main() -> tuple[list[object], set[int]]:
        lock, got, threads = threading.Lock(), [], set()
        box = Outbox(lock)
        box.start(asyncio.get_running_loop())

        def record(x: object) -> None:
            got.append(x)
            threads.add(threading.get_ident())

        def step_thread() -> None:
            for i in range(200):
                with lock:
                    box.emit(record, i)
                if i % 7 == 0:
                    box.hand_over()
            box.hand_over()
            box.call_soon(record, "done")  # after every event handed over before it

        t = threading.Thread(target=step_thread)
        t.start()
        t.join()
        await _settle()
        box.close()
        return got, threads

    got, threads = asyncio.run(main())
    assert got == [*range(200), "done"]
    assert threads == {threading.main_thread().ident}  # consumers run on the event loop's thread


def test_a_failing_consumer_does_not_drop_the_calls_after_it(caplog) -> None:
    async def main() -> list[int]:
        got: list[int] = []
        box = Outbox(threading.Lock())
        box.start(asyncio.get_running_loop())

        def boom(_: object) -> None:
            raise RuntimeError("consumer bug")

        box.emit(got.append, 1)
        box.emit(boom, None)
        box.emit(got.append, 2)
        box.hand_over()
        box.call_soon(boom, None)
        box.call_soon(got.append, 3)
        await _settle()
        box.close()
        return got

    assert asyncio.run(main()) == [1, 2, 3]
    assert sum("consumer bug" in (r.exc_text or "") or "failed" in r.getMessage() for r in caplog.records) >= 2


def test_after_close_calls_go_nowhere_and_the_poster_thread_ends() -> None:
    async def main() -> tuple[list[int], bool]:
        got: list[int] = []
        box = Outbox(threading.Lock())
        box.start(asyncio.get_running_loop())
        box.call_soon(got.append, 1)
        box.close()  # what was queued is still delivered
        box.call_soon(got.append, 2)  # a late step of an abandoned thread: dropped
        await _settle()
        assert box._poster is not None
        return got, box._poster.thread.is_alive()

    got, alive = asyncio.run(main())
    assert got == [1]
    assert not alive
