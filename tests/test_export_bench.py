"""bench/decode_step.py on tiny bundles: it runs every backend and reports medians and ratios."""
from bench.decode_step import markdown, measure, run
from tests.helpers_tiny import checkpoint_of, tiny_bundle


def test_measure_alternates_and_takes_medians():
    calls = []
    med = measure({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, iters=4, warmup=0)
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"] and set(med) == {"a", "b"}


def test_bench_reports_all_backends_at_each_batch(tmp_path_factory):
    base = tmp_path_factory.mktemp("bench")
    fp32, int8 = tiny_bundle(base, "translate"), tiny_bundle(base, "translate", "int8")
    assert checkpoint_of(fp32) == checkpoint_of(int8)
    r = run(checkpoint_of(fp32), fp32, int8, [1, 3], context=8, iters=5, threads=1)
    assert [row["batch"] for row in r["rows"]] == [1, 3]
    for row in r["rows"]:
        assert set(row["median_ms"]) == {"pytorch", "ort_fp32", "ort_int8"}
        assert all(v > 0 for v in row["median_ms"].values()) and row["int8_vs_fp32"] > 0
    table = markdown(r)
    assert table.count("\n| ") == 4 and "int8 vs fp32" in table
