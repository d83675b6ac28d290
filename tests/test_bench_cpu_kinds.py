"""The per-CPU-kind ledger of `kvserve bench` (bench/cpu_kinds.py) on tests/test_bench.py's fixture results: a
run updates its own kind with what it measured and nothing else; the report shows one row per kind."""

from __future__ import annotations

from test_bench import MACHINE
from test_bench import _sections as _bench_sections

from bench import cpu_kinds
from bench.report import render

EPYC = {**MACHINE, "cpu": "AMD EPYC", "cpu_flags": ["avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16"]}
XEON = {**MACHINE, "cpu": "Intel Xeon", "cpu_flags": ["avx2", "avx512f", "avx512_vnni", "amx_tile"]}


def _stamped(sections: dict, date: str, git: str) -> dict:
    return {k: {**v, "date_utc": date, "git": git} for k, v in sections.items()}


def test_a_cpu_kind_is_its_model_and_the_instruction_set_that_picks_its_kernels():
    from model.provenance import CPU_FLAGS

    assert set(cpu_kinds.FLAG_NAMES) == set(CPU_FLAGS) - {"fma"}  # every flag a machine records, named
    assert cpu_kinds.kind(MACHINE) == "Test CPU, AVX2"
    assert cpu_kinds.kind(EPYC) == "AMD EPYC, AVX-512 VNNI BF16"
    assert cpu_kinds.kind(XEON) == "Intel Xeon, AMX"
    assert cpu_kinds.kind({**EPYC, "cpu_flags": ["avx2", "avx512f"]}) == "AMD EPYC, AVX-512"


def test_the_figures_are_the_reports_own():
    s = _stamped(_bench_sections(), "2026-01-01 10:00 UTC", "abc123")
    f = cpu_kinds.figures(s)
    assert f["translate"]["fp32"]["ratio"]["8"] == 0.5 and f["translate"]["int8"]["ratio"]["8"] == 1.25
    assert f["translate"]["fp32"]["identical"] == 0.95 and f["translate"]["git"] == "abc123"
    assert f["http"]["wrk"] == {"streaming": 0.55, "non-streaming": 0.75}  # the glance's "0.55 (streaming) / 0.75"
    assert 0 < f["matmul_peak"]["one_core"] < 1
    failed = {**s, "translate": {"ok": False, "error": "boom"}, "http": {"ok": False}}
    assert set(cpu_kinds.figures(failed)) == {"matmul_peak"}  # a failed section gives no figure


def test_a_run_updates_its_own_kind_and_only_what_it_measured():
    old = _stamped(_bench_sections(), "2026-01-01 10:00 UTC", "old111")
    ledger = cpu_kinds.update({}, XEON, cpu_kinds.figures(old))
    ledger = cpu_kinds.update(ledger, EPYC, cpu_kinds.figures(old))
    new = _stamped({"translate": _bench_sections()["translate"]}, "2026-02-02 10:00 UTC", "new222")
    new["translate"]["rows"] = [{**r, "throughput_ratio": 2.0} for r in new["translate"]["rows"]]
    after = cpu_kinds.update(ledger, EPYC, cpu_kinds.figures(new))
    epyc = after["AMD EPYC, AVX-512 VNNI BF16"]
    assert epyc["translate"]["git"] == "new222" and set(epyc["translate"]["fp32"]["ratio"].values()) == {2.0}
    assert epyc["http"] == ledger["AMD EPYC, AVX-512 VNNI BF16"]["http"]  # not measured now: kept
    assert after["Intel Xeon, AMX"] == ledger["Intel Xeon, AMX"]  # another kind: untouched
    assert cpu_kinds.update(after, EPYC, {}) is after


def test_the_report_shows_one_row_per_kind_with_its_dates_and_commits(tmp_path):
    old = _stamped(_bench_sections(), "2026-01-01 10:00 UTC", "old111")
    ledger = cpu_kinds.update(cpu_kinds.update({}, XEON, cpu_kinds.figures(old)), EPYC,
                              cpu_kinds.figures({"translate": old["translate"]}))
    path = tmp_path / cpu_kinds.LEDGER
    cpu_kinds.save(path, ledger)
    assert cpu_kinds.load(path) == ledger and cpu_kinds.load(tmp_path / "none.json") == {}
    section = cpu_kinds.record(path, EPYC, {})  # a run that measured nothing: the ledger as it was
    assert cpu_kinds.load(path) == ledger and section == cpu_kinds.render(ledger)
    doc = render(_bench_sections(), MACHINE, {"threads": 1}, "kvserve bench", 60.0, section)
    rows = [line for line in doc.splitlines() if line.startswith("| AMD EPYC") or line.startswith("| Intel Xeon")]
    assert len(rows) == 2
    epyc, xeon = sorted(rows)
    assert epyc.startswith("| AMD EPYC, AVX-512 VNNI BF16 (2; AVX2, AVX-512, VNNI, BF16) |")
    assert "0.50x" in epyc and "1.25x" in epyc and "| - | - |" in epyc  # no HTTP, no peak measured there
    assert epyc.endswith("| 2026-01-01, old111 |")  # one date and commit for every part measured
    assert "| 0.55 / 0.75 |" in xeon and "AMX" in xeon and xeon.endswith("| 2026-01-01, old111 |")
    key = "Intel Xeon, AMX"
    mixed = {**ledger, key: {**ledger[key], "matmul_peak": {**ledger[key]["matmul_peak"], "git": "new222"}}}
    row = next(line for line in cpu_kinds.render(mixed) if line.startswith("| Intel Xeon"))
    assert row.endswith("| translation 2026-01-01, old111; HTTP 2026-01-01, old111; peak 2026-01-01, new222 |")
    assert "## CPU kinds" not in render(_bench_sections(), MACHINE, {}, "kvserve bench", 60.0)
