"""serving/engine/scheduler.py alone (no ONNX Runtime): slots, compaction, token budget, modes, admission."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.engine.config import BatchingKnobs
from serving.engine.scheduler import Phase, Scheduler, Sequence
from serving.engine.types import AdmissionRejected, BatchingMode, FinishReason

M = 64


def sched(n_slots=8, **kw) -> Scheduler:
    return Scheduler(n_slots, M, BatchingKnobs(**kw))


def seq(name, prompt=4, width=1, src=0, new=8, deadline=None) -> Sequence:
    return Sequence(request_id=name, prefill_len=prompt, width=width, src_len=src, max_new_tokens=new,
                    deadline=deadline)


def run(s: Scheduler, now=0.0):
    """schedule + pretend the step ran (prefill progress recorded)."""
    plan = s.schedule(now)
    s.after_step(plan)
    return plan


def check_layout(s: Scheduler) -> None:
    """Decoding (and held) slots are exactly [0, D); a chunked-prefill row, if any, sits at D."""
    d = s.decode_slots
    live = {slot for q in s.running for slot in q.slots}
    dec = {slot for q in s.running if q.phase in (Phase.DECODE, Phase.HELD) for slot in q.slots}
    assert dec == set(range(d))
    partial = [q for q in s.running if q.phase == Phase.PREFILL]
    assert len(partial) <= 1
    if partial:
        assert partial[0].slots == [d]
    assert live == {i for i, o in enumerate(s.owner) if o is not None}
    assert s.slots_used == len(live)
    for q in s.running:
        assert all(s.owner[i] is q for i in q.slots)


def test_joiners_take_the_slots_after_the_decoding_rows():
    s = sched()
    a, b = seq("a"), seq("b", width=3, src=5, prompt=1)
    s.add([a, b], 0.0)
    plan = run(s)
    assert plan.decode_rows == 0 and plan.prefill_start == 0
    assert [c.seq for c in plan.prefill] == [a, b]
    assert a.slots == [0] and b.slots == [1, 2, 3]
    c = seq("c")
    s.add([c], 0.0)
    plan = run(s)
    assert plan.decode_rows == 4 and plan.prefill_start == 4 and c.slots == [4]
    check_layout(s)


def test_a_finished_request_frees_its_slot_and_the_last_live_slot_moves_into_the_hole():
    s = sched()
    seqs = [seq(str(i)) for i in range(5)]
    s.add(seqs, 0.0)
    run(s)
    s.finish(seqs[1], 1.0)
    plan = run(s)
    assert plan.moves == [[(4, 1)]]  # one KV row copy, not a shift of everything after the hole
    assert seqs[4].slots == [1] and plan.decode_rows == 4
    check_layout(s)


def test_beam_slots_move_one_by_one_and_need_not_be_adjacent():
    s = sched()
    a, b, c = seq("a"), seq("b", width=3, prompt=1, src=2), seq("c")
    s.add([a, b, c], 0.0)
    run(s)
    s.finish(a, 1.0)
    plan = run(s)
    assert plan.moves == [[(4, 0)]]
    assert sorted(b.slots) == [1, 2, 3] and c.slots == [0]
    s.finish(b, 2.0)
    run(s)
    assert c.slots == [0] and s.slots_used == 1
    check_layout(s)


def test_long_prompt_is_chunked_under_the_budget_and_continues_first():
    s = sched(max_tokens_per_step=10)
    long, short = seq("long", prompt=25), seq("short", prompt=3)
    s.add([long, short], 0.0)
    plan = run(s)
    assert [(c.seq.request_id, c.start, c.length) for c in plan.prefill] == [("long", 0, 10)]
    plan = run(s)
    assert [(c.seq.request_id, c.start, c.length) for c in plan.prefill] == [("long", 10, 10)]
    assert long.phase == Phase.PREFILL and short.phase == Phase.WAITING
    plan = run(s)  # the last 5 tokens; the short prompt joins behind it (2 rows x 5 padded = 10)
    assert [(c.seq.request_id, c.start, c.length) for c in plan.prefill] == [("long", 20, 5), ("short", 0, 3)]
    assert long.phase == short.phase == Phase.DECODE
    check_layout(s)


def test_decode_rows_come_first_and_prefill_gets_what_is_left_of_the_budget():
    s = sched(max_tokens_per_step=12)
    s.add([seq(str(i), prompt=2) for i in range(4)], 0.0)
    run(s)  # 4 rows x 2 tokens = 8 <= 12
    s.add([seq("x", prompt=20)], 0.0)
    plan = run(s)
    assert plan.decode_rows == 4
    assert [(c.start, c.length) for c in plan.prefill] == [(0, 8)]  # 12 - 4 decode tokens
    check_layout(s)


def test_padded_cost_counts_rows_times_the_longest_chunk():
    s = sched(max_tokens_per_step=20)
    a, b, c = seq("a", prompt=8), seq("b", prompt=2), seq("c", prompt=2)
    s.add([a, b, c], 0.0)
    plan = run(s)
    # a alone costs 8; +b costs 2 x 8 = 16; +c would cost 3 x 8 = 24 > 20
    assert [q.seq.request_id for q in plan.prefill] == ["a", "b"]


def test_an_idle_engine_admits_a_joiner_even_beyond_the_budget():
    s = sched(max_tokens_per_step=2)
    beam = seq("beam", width=4, prompt=1, src=30)
    s.add([beam], 0.0)
    plan = run(s)
    assert [c.seq for c in plan.prefill] == [beam]


def test_prefill_group_keeps_max_write_pos_plus_padded_length_within_the_cache():
    s = sched(max_tokens_per_step=1000)
    long = seq("long", prompt=60)
    s.add([long], 0.0)
    s.knobs = s.knobs.model_copy(update={"max_tokens_per_step": 40})
    run(s)  # chunk [0, 40)
    s.knobs = s.knobs.model_copy(update={"max_tokens_per_step": 1000})
    s.add([seq("b", prompt=30)], 0.0)
    plan = run(s)
    starts = [c.start for c in plan.prefill]
    t = max(c.length for c in plan.prefill)
    assert max(starts) + t <= M
    assert plan.prefill[0].seq is long and plan.prefill[1].length <= M - 40


def test_queue_bound_rejects_with_reason_and_retry_after():
    s = sched(n_slots=2, max_waiting=3)
    s.add([seq(str(i)) for i in range(5)], 0.0)  # 2 free slots + 3 waiting places
    with pytest.raises(AdmissionRejected, match="queue_full") as e:
        s.add([seq("x")], 0.0)
    assert e.value.reason == "queue_full" and 0 < e.value.retry_after_s <= 60
    with pytest.raises(AdmissionRejected):
        s.add([seq("y"), seq("z")], 0.0)
    assert len(s.waiting) == 5  # all or nothing


def test_queued_token_bound():
    s = sched(n_slots=1, max_waiting=100, max_waiting_tokens=50)
    s.add([seq("a", prompt=20, new=20)], 0.0)
    with pytest.raises(AdmissionRejected, match="queue_tokens"):
        s.add([seq("b", prompt=10, new=10)], 0.0)


def test_retry_after_follows_the_completion_rate():
    s = sched(n_slots=1, max_waiting=0)
    seqs = [seq(str(i)) for i in range(11)]
    for i, q in enumerate(seqs[:10]):
        s.add([q], float(i))
        run(s, float(i))
        s.finish(q, i + 0.5)  # one completion per second
    s.add([seqs[10]], 10.0)
    with pytest.raises(AdmissionRejected) as e:
        s.add([seq("late")], 10.0)
    assert e.value.retry_after_s == pytest.approx(1.0, rel=0.2)


def test_cancel_and_deadline_are_reaped_at_the_next_schedule():
    s = sched()
    a, b, c = seq("a"), seq("b", deadline=5.0), seq("c")
    s.add([a, b, c], 0.0)
    run(s)
    w = seq("w")
    s.add([w], 0.0)
    a.cancelled = w.cancelled = True
    plan = s.schedule(6.0)
    assert {(q.request_id, r) for q, r in plan.finished} == {("a", FinishReason.CANCELLED),
                                                             ("b", FinishReason.DEADLINE),
                                                             ("w", FinishReason.CANCELLED)}
    assert s.slots_used == 1 and c.slots == [0] and plan.decode_rows == 1 and not s.waiting


def test_request_mode_gathers_then_runs_a_static_batch_to_its_end():
    s = sched(batching=BatchingMode.REQUEST, max_batch_size=3, batch_wait_timeout_s=1.0)
    a, b = seq("a"), seq("b")
    s.add([a, b], 0.0)
    plan = run(s, 0.1)
    assert plan.empty and plan.wake_in == pytest.approx(0.9)
    c, d = seq("c"), seq("d")
    s.add([c, d], 0.2)
    plan = run(s, 0.2)  # 3 are waiting: a batch starts
    assert [q.seq.request_id for q in plan.prefill] == ["a", "b", "c"]
    s.finish(a, 0.3)
    plan = run(s, 0.3)
    assert a.phase == Phase.HELD and plan.decode_rows == 3 and not plan.prefill  # d does not join
    s.finish(b, 0.4)
    s.finish(c, 0.5)
    assert s.slots_used == 0
    plan = run(s, 0.6)  # d alone, before the 1 s timeout? no: it waited since 0.2, timeout is 1.0
    assert plan.empty
    plan = run(s, 1.3)
    assert [q.seq.request_id for q in plan.prefill] == ["d"]


def test_request_mode_admits_a_full_batch_at_once_and_holds_cancelled_rows():
    s = sched(batching=BatchingMode.REQUEST, max_batch_size=3, batch_wait_timeout_s=10.0)
    g = [seq(str(i)) for i in range(4)]
    s.add(g, 0.0)
    plan = run(s, 0.0)  # max_batch_size waiting: no need to wait for the timeout; the fourth waits
    assert s.waiting[0] is g[3]
    g = g[:3]
    assert [q.seq for q in plan.prefill] == g
    g[0].cancelled = True
    plan = run(s, 0.1)
    assert [q for q, _ in plan.finished] == [g[0]] and g[0].phase == Phase.HELD and plan.decode_rows == 3


def test_none_mode_runs_one_request_at_a_time():
    s = sched(batching=BatchingMode.NONE)
    a, b = seq("a"), seq("b")
    s.add([a, b], 0.0)
    assert [q.seq for q in run(s).prefill] == [a]
    assert not run(s).prefill
    s.finish(a, 1.0)
    assert [q.seq for q in run(s).prefill] == [b]


def test_switching_from_request_to_continuous_releases_held_rows():
    s = sched(batching=BatchingMode.REQUEST, max_batch_size=2)
    a, b = seq("a"), seq("b")
    s.add([a, b], 0.0)
    run(s)
    s.finish(a, 1.0)
    s.knobs = s.knobs.model_copy(update={"batching": BatchingMode.CONTINUOUS})
    plan = run(s)
    assert s.slots_used == 1 and b.slots == [0] and plan.moves == [[(1, 0)]]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 40), st.integers(1, 3), st.booleans()),
                min_size=1, max_size=40),
       st.integers(1, 12), st.integers(4, 60), st.randoms(use_true_random=False))
def test_layout_invariants_hold_under_random_traffic(arrivals, n_slots, budget, rnd):
    """Random arrivals, finishes and cancellations: the layout stays contiguous, every request finishes,
    no prefill call exceeds the cache, and the budget holds except for an idle engine's first joiner."""
    s = sched(n_slots=n_slots, max_waiting=1000, max_tokens_per_step=budget)
    made = []
    for step, (count, prompt, width, cancel) in enumerate(arrivals * 3):
        if step < len(arrivals):
            batch = [seq(f"{step}.{i}", prompt=prompt, width=min(width, n_slots)) for i in range(count)]
            s.add(batch, float(step))
            made += batch
        plan = s.schedule(float(step))
        if plan.prefill:
            t = max(c.length for c in plan.prefill)
            assert max(c.start for c in plan.prefill) + t <= M
            rows = sum(c.seq.width for c in plan.prefill)
            assert plan.decode_rows + rows * t <= budget or plan.decode_rows == 0
        s.after_step(plan)
        check_layout(s)
        for q in list(s.running):
            if q.phase == Phase.DECODE and rnd.random() < 0.3:
                s.finish(q, float(step))
            elif cancel and rnd.random() < 0.1:
                q.cancelled = True
    for _ in range(500):
        if not s.running and not s.waiting:
            break
        plan = run(s, 1e4)
        for q in list(s.running):
            if q.phase == Phase.DECODE:
                s.finish(q, 1e4)
    assert not s.running and not s.waiting and s.slots_used == 0
    assert all(q.phase == Phase.DONE for q in made)


def test_a_more_urgent_request_is_admitted_before_the_waiting_bulk_ones():
    """All slots busy, bulk requests (priority 5) waiting: an interactive one (priority -1) that comes later is the
    next admitted; requests of equal priority keep their arrival order."""
    s = sched(n_slots=2, max_waiting=8)
    s.add([seq("busy1"), seq("busy2")], 0.0)
    run(s)
    bulk = [seq(f"bulk{i}") for i in range(3)]
    for b in bulk:
        b.priority = 5
    s.add(bulk, 1.0)
    urgent, plain = seq("urgent"), seq("plain")
    urgent.priority = -1
    s.add([plain], 2.0)
    s.add([urgent], 3.0)
    assert [q.request_id for q in s.waiting] == ["urgent", "plain", "bulk0", "bulk1", "bulk2"]
    s.finish(s.owner[0], 4.0)  # one slot frees
    run(s, 4.0)
    assert {q.request_id for q in s.running} == {"busy2", "urgent"}
    assert [q.request_id for q in s.waiting] == ["plain", "bulk0", "bulk1", "bulk2"]


def test_under_overload_the_refusals_fall_on_bulk_requests_first():
    """Bulk requests (priority above 0) may fill half of the waiting places; the other half stays for the rest."""
    s = sched(n_slots=1, max_waiting=4)
    s.add([seq("busy")], 0.0)
    run(s)
    admitted = []
    for i in range(6):
        b = seq(f"bulk{i}")
        b.priority = 1
        try:
            s.add([b], 1.0)
            admitted.append(b.request_id)
        except AdmissionRejected as e:
            assert e.reason == "queue_full"
    assert admitted == ["bulk0", "bulk1"]  # half of max_waiting
    for i in range(2):
        s.add([seq(f"user{i}")], 2.0)  # the rest of the queue is still open to priority 0
    with pytest.raises(AdmissionRejected, match="queue_full"):
        s.add([seq("user2")], 2.0)
