"""serving/engine/runtime.py on the CUDA EP (marked `gpu`: skipped without onnxruntime-gpu and a visible GPU).

Run by `make gpu-check` (bench/gpu_check/gpu_tests.py) or `pytest -m gpu`. The CPU suites check the same
operations on the CPU EP (tests/test_runtime.py); these check what only a GPU shows: the sessions really run
on the CUDA EP, the KV cache lives in device memory and keeps its addresses, and the CUDA results (steps,
slot copies, encoder placement) equal the CPU EP's.
"""
import numpy as np
import pytest

from export.bundle import load_bundle
from serving.engine.runtime import CUDA_EP, ModelRuntime, gpu_visible
from tests.helpers_tiny import tiny_bundle

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not gpu_visible(), reason="needs onnxruntime-gpu and a visible CUDA GPU")]


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    base = tmp_path_factory.mktemp("runtime-cuda")
    return {(task, v): tiny_bundle(base, task, v) for task in ("translate", "generate") for v in ("fp32", "fp16")}


def run_both(bundle, fn):
    """fn(runtime) on the CUDA EP and on the CPU EP (portable decoder graph on both): both results."""
    b = load_bundle(bundle)
    return fn(ModelRuntime(b, 6, provider="cuda")), fn(ModelRuntime(b, 6, provider="cpu", decoder_graph="decoder"))


@pytest.mark.parametrize("variant", ["fp32", "fp16"])
def test_cuda_sessions_cache_on_device_and_addresses_kept(bundles, variant):
    rt = ModelRuntime(load_bundle(bundles[("generate", variant)]), 4, provider="cuda")
    assert rt.provider == CUDA_EP and rt.decoder_graph == "decoder"
    assert all(CUDA_EP in s.get_providers() for s in rt._sessions)
    buf = rt._self_kv[next(iter(rt._self_kv))]
    assert buf.value.device_name().lower() == "cuda" and buf.host is None
    ptrs = [rt.cache_ptr(i, s) for i in range(2) for s in range(4)]
    rt.step(0, np.array([[1, 40, 41], [1, 50, 0]]), np.array([3, 2]), np.array([0, 0]))
    rt.step(0, np.array([[60], [61]]), np.array([1, 1]), np.array([3, 2]))
    assert [rt.cache_ptr(i, s) for i in range(2) for s in range(4)] == ptrs
    k = rt.read_cache(0)[0]
    assert np.abs(k[0, :, :4]).min() > 0 and not k[2:].any()  # written rows only


@pytest.mark.parametrize("task", ["generate", "translate"])
def test_cuda_steps_and_slot_copies_equal_the_cpu_ep(bundles, task):
    g = np.random.default_rng(5)
    srcs = [g.integers(4, 200, n).tolist() for n in (3, 7, 2, 5, 4, 6)]
    prompt = np.concatenate([np.ones((6, 1), np.int64), g.integers(4, 200, (6, 4))], axis=1)
    lens = np.array([5, 3, 4, 5, 2, 1])

    def scenario(rt):
        if rt.is_encoder_decoder:
            rt.encode(0, srcs)
        out = [rt.step(0, prompt, lens, np.zeros(6, np.int64))]
        rt.copy_slots([0, 1, 2], [3, 4, 5], length=6)  # CUDA: whole rows through the copy graph
        pos = np.array([5, 3, 4, 5, 3, 4])
        out.append(rt.step(0, np.full((6, 1), 9, np.int64), np.ones(6, np.int64), pos))
        return np.stack(out)

    cuda, cpu = run_both(bundles[(task, "fp32")], scenario)
    np.testing.assert_allclose(cuda, cpu, atol=1e-3, rtol=0)


def test_cuda_fp16_logits_close_to_cpu_fp32(bundles):
    ids = np.array([[1, 40, 41, 42], [1, 50, 51, 0]])
    cuda = ModelRuntime(load_bundle(bundles[("generate", "fp16")]), 2, provider="cuda").step(
        0, ids, np.array([4, 3]), np.zeros(2, np.int64))
    cpu = ModelRuntime(load_bundle(bundles[("generate", "fp32")]), 2, provider="cpu").step(
        0, ids, np.array([4, 3]), np.zeros(2, np.int64))
    assert cuda.dtype == np.float32
    np.testing.assert_allclose(cuda, cpu, atol=0.1, rtol=0)
    assert (cuda.argmax(-1) == cpu.argmax(-1)).all()
