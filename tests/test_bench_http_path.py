"""bench/http_path.py's own parts: the CPU sampler sees real CPU time, the table carries the ratio."""
import time

from bench.http_path import CpuShares, markdown


def test_cpu_shares_count_this_process_as_the_load_generator():
    shares = CpuShares()
    shares.start()
    t0 = time.process_time()
    while time.process_time() - t0 < 0.3:  # burn CPU in this process
        sum(range(1000))
    cpu = shares.stop()
    assert 0.3 <= cpu["load generator"] <= 1.5


def test_markdown_reports_the_ratio_to_the_engine_in_process():
    result = {"inprocess_tokens_per_s": 1000.0, "runs": [
        {"run": "streaming /v1/generate", "stream_interval_s": 0.05, "tokens_per_s": 500.0, "ttft_p99_s": 0.25,
         "cpu": {"proxy": 0.4, "ingress": 0.6, "replica": 0.9, "load generator": 0.1}}]}
    table = markdown(result)
    assert "**1000 tok/s**" in table
    row = next(line for line in table.splitlines() if line.startswith("| streaming"))
    assert "| 0.05 | 500 | 0.50 | 0.250 | 0.40 | 0.60 | 0.90 | 0.10 |" in row


def test_a_data_plane_is_set_for_ray_inside_the_block_and_restored_after(monkeypatch):
    import os

    from bench.http_path import data_plane
    from serving.server.ray_env import DATA_PLANE_ENV

    for key in DATA_PLANE_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "1")
    with data_plane("python"):
        assert all(os.environ[k] == "0" for k in DATA_PLANE_ENV)
    assert os.environ["RAY_SERVE_ENABLE_HA_PROXY"] == "1" and "RAY_SERVE_THROUGHPUT_OPTIMIZED" not in os.environ


def test_top_frames_leave_out_idle_threads(tmp_path):
    from bench.http_path import top_frames

    path = tmp_path / "p.txt"
    path.write_text("thread (1);main (a.py:1);run (engine.py:5);step (ort.py:9) 30\n"
                    "thread (1);main (a.py:1);run (engine.py:5);sample (s.py:3) 10\n"
                    "thread (2);loop (b.py:1);select (selectors.py:1) 60\n")
    top = dict(top_frames(path))
    assert top["run (engine.py:5)"] == 1.0 and top["step (ort.py:9)"] == 0.75 and "loop (b.py:1)" not in top
