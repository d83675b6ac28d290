"""bench/engine.py: a short run on the tiny exported LM gives a complete, consistent report."""
import json

import numpy as np
import pytest

from engine_bundle import cached_bundle
from bench.engine import main


def test_benchmark_runs_every_mode_on_the_same_workload_and_prints_a_table(tmp_path, capsys):
    bundle, _ = cached_bundle("generate")
    out = tmp_path / "bench.json"
    assert main([str(bundle), "--out", str(out), "--concurrency", "1", "4", "--rounds", "1",
                 "--requests-per-client", "2", "--min-new", "4", "--max-new", "12"]) == 0
    doc = json.loads(out.read_text())
    runs = doc["runs"]
    assert {(r["mode"], r["concurrency"]) for r in runs} == {(m, c) for m in ("continuous", "request", "none")
                                                            for c in (1, 4)}
    for c in (1, 4):
        tokens = {r["tokens"] for r in runs if r["concurrency"] == c}
        assert tokens == {int(np.linspace(4, 12, 2 * c).round().sum())}  # every request ran to its length
    none4 = next(r for r in runs if r["mode"] == "none" and r["concurrency"] == 4)
    assert none4["mean_rows_per_step"] == 1.0
    table = capsys.readouterr().out
    assert table.count("\n| 4 |") == 3 and "continuous speedup" in table
    assert main(["--table", str(out)]) == 0
    assert capsys.readouterr().out.strip() == table.strip()


def test_step_scaling_times_every_rows_and_context_pair(tmp_path, capsys):
    bundle, _ = cached_bundle("generate")
    out = tmp_path / "scaling.json"
    assert main([str(bundle), "--step-scaling", "--rows", "1", "3", "--contexts", "4", "20",
                 "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["step_scaling"]
    assert [(r["rows"], r["context"]) for r in rows] == [(1, 4), (3, 4), (1, 20), (3, 20)]
    assert all(r["step_ms"] > 0 for r in rows)
    assert [r["gain_per_row"] for r in rows if r["rows"] == 1] == [1.0, 1.0]
    assert capsys.readouterr().out.count("\n| 20 |") == 2


def test_step_scaling_rejects_contexts_beyond_the_cache(capsys):
    bundle, _ = cached_bundle("generate")
    with pytest.raises(SystemExit):
        main([str(bundle), "--step-scaling", "--rows", "1", "--contexts", "100000"])
    assert "contexts in [1," in capsys.readouterr().err


def test_sampled_run_on_the_http_loads_prompts_records_them_and_their_length(tmp_path):
    """--data-dir: the prompts the HTTP load sends (the built-in texts when the data is not prepared), tokenized
    by the bundle; --temperature: seeded sampling; both recorded, with the mean prompt length FLOPs count."""
    from bench.compute import engine_best
    from bench.engine import text_prompts
    from export.bundle import load_bundle
    from loadtest.workloads import Workload, load_inputs

    bundle, _ = cached_bundle("generate")
    prompts, source = text_prompts(bundle, tmp_path / "no-data")
    tok = load_bundle(bundle).load_tokenizer()
    texts = load_inputs(Workload.GENERATE, tmp_path / "no-data").texts
    assert prompts == [ids for ids in (tok.encode(t) for t in texts) if ids] and source
    out = tmp_path / "bench.json"
    assert main([str(bundle), "--out", str(out), "--concurrency", "2", "--rounds", "1", "--modes", "continuous",
                 "--requests-per-client", "2", "--min-new", "4", "--max-new", "8", "--temperature", "1",
                 "--data-dir", str(tmp_path / "no-data")]) == 0
    doc = json.loads(out.read_text())
    assert doc["temperature"] == 1.0 and doc["prompts"] == source
    assert doc["mean_prompt_tokens"] == pytest.approx(np.mean([len(p) for p in prompts]) + 1)
    assert doc["runs"][0]["tokens"] == int(np.linspace(4, 8, 4).round().sum())
    cfg = load_bundle(bundle).model_config
    longer = engine_best({**doc, "mean_prompt_tokens": doc["mean_prompt_tokens"] + 20}, cfg)
    assert longer["flops_per_token"] > engine_best(doc, cfg)["flops_per_token"]  # prefill and context count


def test_breakdown_reads_its_clocks_while_every_client_is_in_flight():
    """bench.breakdown: with several requests per client, the figures are those of the steps run before the last
    request was handed out (every client busy); with one each, no such step exists and the whole run counts."""
    from bench.breakdown import CATEGORIES, measure

    bundle = cached_bundle("generate")[0]
    steady = measure([bundle], [4], requests_per_client=6, min_new=4, max_new=12)[str(bundle)][0]
    whole = measure([bundle], [4], requests_per_client=1, min_new=4, max_new=12)[str(bundle)][0]
    # four clients in flight: four rows in nearly every step (a joiner's prefill shares the step); the one-request
    # run ends with a tail of fewer rows
    assert steady["rows_per_step"] >= 3.0 and whole["rows_per_step"] < steady["rows_per_step"]
    for row in (steady, whole):
        assert row["steps"] > 0 and row["tokens_per_s"] > 0
        assert abs(sum(row["share"][k] for k in CATEGORIES) - 1.0) < 0.02
    # the steady window ends before the last requests finish: fewer tokens than all 24 requests' (at least 4 each)
    assert steady["wall_s"] * steady["tokens_per_s"] < 24 * 12
