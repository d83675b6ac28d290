"""serving/engine/sources.py: which encoder calls encode a step's sources (pure logic, no model)."""
import numpy as np
import pytest

from serving.engine.sources import MOST_PER_CALL, encoder_calls


def _slots_and_sources(calls, n):
    """slot -> the source it receives, over every call; each slot filled exactly once."""
    got: dict[int, list[int]] = {}
    for call, slots, take in calls:
        slots = np.arange(len(call) if take is None else len(take)) if slots is None else slots
        take = np.arange(len(call)) if take is None else take
        assert len(call) <= MOST_PER_CALL
        for s, t in zip(slots.tolist(), take.tolist(), strict=True):
            assert s not in got
            got[s] = call[t]
    assert sorted(got) == list(range(n))
    return got


@pytest.mark.parametrize("n", [1, 5, 8, 9, 23, 40])
def test_every_slot_gets_its_own_source_and_each_distinct_source_is_encoded_once(n):
    g = np.random.default_rng(n)
    pool = [g.integers(4, 99, int(k)).tolist() for k in g.integers(1, 40, max(1, n // 2 + 1))]
    sources = [pool[int(i)] for i in g.integers(0, len(pool), n)]
    calls = encoder_calls(sources)
    assert _slots_and_sources(calls, n) == dict(enumerate(sources))
    encoded = [tuple(s) for call, _, _ in calls for s in call]
    assert len(encoded) == len(set(encoded)) == len({tuple(s) for s in sources})
    assert len(calls) == -(-len(encoded) // MOST_PER_CALL)


def test_a_few_sources_are_one_call_in_order_and_many_are_grouped_shortest_first():
    few = [[5, 6, 7], [8], [9, 9]]
    assert encoder_calls(few) == [(few, None, None)]
    many = [[7] * k for k in (12, 3, 30, 1, 7, 22, 5, 9, 2, 15)]
    calls = encoder_calls(many)
    lengths = [[len(s) for s in call] for call, _, _ in calls]
    assert lengths == [[1, 2, 3, 5, 7, 9, 12, 15], [22, 30]]
