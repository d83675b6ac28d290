"""serving/engine/step_calls.py: how a multi-token step splits into the calls a CPU decoder graph accepts."""

import numpy as np

from serving.engine.step_calls import by_token, gqa_runs, token_runs


def test_token_runs_feed_each_row_its_tokens_in_order_in_runs_of_consecutive_rows():
    assert token_runs(np.array([1, 3, 2, 3, 1])) == [(0, 0, 5), (1, 1, 4), (2, 1, 2), (2, 3, 4)]
    assert token_runs(np.array([2, 2])) == [(0, 0, 2), (1, 0, 2)]
    assert token_runs(np.array([], np.int64)) == []


def test_by_token_calls_one_token_per_row_and_keeps_each_rows_last_real_tokens_logits():
    calls = []

    def call(start, ids, lens, wpos):
        calls.append((start, ids[:, 0].tolist(), lens.tolist(), wpos.tolist()))
        return np.stack([np.full(4, 100 * start + 10 * r + int(wpos[r]), np.float32) for r in range(len(ids))])

    ids = np.array([[11, 0, 0], [21, 22, 23], [31, 32, 0]])
    logits = by_token(call, 2, ids, np.array([1, 3, 2]), np.array([5, 0, 7]), vocab=4)
    assert calls == [(2, [11, 21, 31], [1, 1, 1], [5, 0, 7]), (3, [22, 32], [1, 1], [1, 8]), (3, [23], [1], [2])]
    assert logits[:, 0].tolist() == [205, 302, 318]  # row 0 at t=0, row 1 at t=2 (start 3, wpos 2), row 2 at t=1


def test_gqa_runs_keep_rows_without_a_cache_together_and_each_continued_row_alone():
    assert gqa_runs(np.array([4, 2, 3, 4, 1]), np.array([5, 3, 0, 0, 4])) == [(0, 1, 4), (1, 2, 2), (2, 4, 4), (4, 5, 1)]
