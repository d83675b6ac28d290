"""bench/ort_settings.py: each setting reaches every session the runtime opens, and bad settings are refused."""
import asyncio

import onnxruntime as ort
import pytest

from bench import ort_settings
from serving.engine import runtime as runtime_module
from tests.helpers_tiny import tiny_bundle


def test_parse_refuses_what_it_does_not_know():
    assert ort_settings.parse("opt=basic,threads=2,spin=0") == {"opt": "basic", "threads": "2", "spin": "0"}
    for bad in ("opt=fast", "spin=2", "arena=1"):
        with pytest.raises(ValueError, match="give opt="):
            ort_settings.parse(bad)


def test_a_setting_reaches_the_runtimes_sessions_and_the_engine_runs(tmp_path, monkeypatch):
    bundle = tiny_bundle(tmp_path, "generate")
    seen = []
    real = runtime_module.ort.InferenceSession

    def spy(model, so, providers):
        seen.append((so.graph_optimization_level, so.get_session_config_entry("session.intra_op.allow_spinning")))
        return real(model, so, providers=providers)
    monkeypatch.setattr(runtime_module.ort, "InferenceSession", spy)
    got = asyncio.run(ort_settings.engine_tokens_per_s(bundle, ort_settings.parse("opt=basic,spin=0"), [1, 2]))
    assert set(got) == {1, 2} and all(v > 0 for v in got.values())
    assert seen and all(s == (ort.GraphOptimizationLevel.ORT_ENABLE_BASIC, "0") for s in seen)
    assert runtime_module.ort.SessionOptions is ort.SessionOptions  # restored
