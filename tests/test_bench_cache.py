"""bench/cache.py's figures from the server's counters and its table (the runs themselves: `kvserve bench`)."""
from bench.cache import STEP_SECONDS, engine_rates, markdown
from bench.http import GENERATED, STEPS
from loadtest.promscrape import Snapshot

LABELS = (("model", "translate"),)


def snapshot(steps: float, tokens: float, spent: float = 0.0) -> Snapshot:
    return Snapshot({(STEPS, LABELS): steps, (GENERATED, LABELS): tokens, (STEP_SECONDS, LABELS): spent,
                     (STEPS, (("model", "generate"),)): 1e6})  # another model's steps are not the translator's


def test_engine_rates_come_from_the_translators_exact_counters():
    assert engine_rates(snapshot(100, 1000, 0.5), snapshot(2100, 31000, 8.5), 20.0) == {
        "steps_per_s": 100.0, "tokens_per_step": 15.0, "step_ms": 4.0}
    assert engine_rates(snapshot(5, 5), snapshot(5, 5), 20.0) is None  # no step: nothing to say
    assert engine_rates(Snapshot(error="down"), snapshot(5, 5), 20.0) is None


def test_the_table_shows_the_engines_steps_beside_the_gain():
    run = {"bypassed": [200.0], "cached": [320.0], "gain": 1.6, "all_hits": 1800.0, "wrapped": False,
           "engine": {"bypassed": {"steps_per_s": 130.0, "tokens_per_step": 14.7, "step_ms": 6.1},
                      "cached": {"steps_per_s": 106.0, "tokens_per_step": 14.8, "step_ms": 7.25}}}
    lines = markdown({"decodes": {"greedy": run, "beam 4": {**run, "engine": None}}, "inputs": "x"})
    assert "| greedy | 200.0 | 320.0 | 1.60x | 1800.0 | 130 / 106 | 6.10 / 7.25 | 14.7 / 14.8 |" in lines
    assert "| beam 4 | 200.0 | 320.0 | 1.60x | 1800.0 | n/a | n/a | n/a |" in lines
