"""serving/engine/runtime.py on tiny bundles: in-place KV update, slot copies, argument checks, provider choice."""
import subprocess
import sys

import numpy as np
import onnxruntime as ort
import pytest
import torch

from export.bundle import load_bundle
from export.contract import past_key, past_value, present_key, present_value
from export.parity import TorchRuntime
from model.checkpoint import load_checkpoint
from serving.engine.runtime import CPU_EP, CROSS_WIDTH_STEP, ModelRuntime, choose_provider, gpu_visible
from tests.helpers_tiny import checkpoint_of, tiny_bundle


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    base = tmp_path_factory.mktemp("runtime")
    return {task: tiny_bundle(base, task) for task in ("translate", "generate")}


def test_present_is_past_buffer_updated_in_place_at_write_pos(bundles):
    """Graph level: present bound to the past OrtValue comes back as the same buffer (same data pointer),
    holding PyTorch's new keys/values at each row's write_pos and the old contents everywhere else."""
    b = load_bundle(bundles["generate"])
    cfg, ck = b.config, load_checkpoint(checkpoint_of(bundles["generate"]))
    sess = ort.InferenceSession(b.read_graph("decoder"), providers=[CPU_EP])
    n, t = 3, 2
    g = np.random.default_rng(0)
    past = {name: g.standard_normal((n, cfg.n_heads, cfg.max_len, cfg.head_dim)).astype(np.float32)
            for i in range(cfg.n_decoder_layers) for name in (past_key(i), past_value(i))}
    before = {k: v.copy() for k, v in past.items()}
    values = {k: ort.OrtValue.ortvalue_from_numpy(v) for k, v in past.items()}
    ids = g.integers(4, cfg.vocab_size, (n, t)).astype(np.int64)
    write_pos, input_len = np.array([0, 5, 11]), np.array([2, 1, 2])
    io = sess.io_binding()
    io.bind_output("logits")
    for i in range(cfg.n_decoder_layers):
        for p, q in ((past_key(i), present_key(i)), (past_value(i), present_value(i))):
            io.bind_ortvalue_input(p, values[p])
            io.bind_ortvalue_output(q, values[p])
    io.bind_cpu_input("input_ids", ids)
    io.bind_cpu_input("input_len", input_len)
    io.bind_cpu_input("write_pos", write_pos)
    sess.run_with_iobinding(io)
    outs = io.get_outputs()
    names = [past_key(i) if j == 0 else past_value(i) for i in range(cfg.n_decoder_layers) for j in (0, 1)]
    assert [o.data_ptr() for o in outs[1:]] == [values[k].data_ptr() for k in names]
    caches = [(torch.from_numpy(before[past_key(i)]), torch.from_numpy(before[past_value(i)]))
              for i in range(cfg.n_decoder_layers)]
    with torch.no_grad():
        logits, new = ck.model.step(torch.from_numpy(ids), torch.from_numpy(input_len),
                                    torch.from_numpy(write_pos), caches)
    np.testing.assert_allclose(outs[0].numpy(), logits.numpy(), atol=1e-4, rtol=0)
    for i, (k, v) in enumerate(new):
        for name, want in ((past_key(i), k.numpy()), (past_value(i), v.numpy())):
            got = past[name]  # the numpy array the OrtValue wraps: changed in place
            for r in range(n):
                rows = slice(write_pos[r], write_pos[r] + t)
                np.testing.assert_allclose(got[r, :, rows], want[r, :, rows], atol=1e-5, rtol=0)
                assert not np.allclose(got[r, :, rows], before[name][r, :, rows])
                keep = np.ones(cfg.max_len, bool)
                keep[rows] = False
                np.testing.assert_array_equal(got[r][:, keep], before[name][r][:, keep])


def test_runtime_step_keeps_cache_addresses_and_writes_rows(bundles):
    rt = ModelRuntime(load_bundle(bundles["generate"]), n_slots=4, provider="cpu")
    ptrs = [rt.cache_ptr(i, s) for i in range(2) for s in range(4)]
    k_before = rt.read_cache(0)[0].copy()
    rt.step(1, np.array([[1, 40, 41], [1, 50, 0]]), np.array([3, 2]), np.array([0, 0]))
    rt.step(1, np.array([[60], [61]]), np.array([1, 1]), np.array([3, 2]))
    assert [rt.cache_ptr(i, s) for i in range(2) for s in range(4)] == ptrs
    k = rt.read_cache(0)[0]
    np.testing.assert_array_equal(k[[0, 3]], k_before[[0, 3]])  # rows outside [1, 3) untouched
    assert np.abs(k[1, :, :4]).min() > 0 and np.abs(k[2, :, :3]).min() > 0


@pytest.mark.parametrize("graph", ["decoder", "decoder_cpu"])
def test_multi_token_steps_on_rows_with_and_without_a_cache_match_pytorch(bundles, graph):
    """Chunked prefill beside joiners: one call with rows that continue their cache (several new tokens,
    right-padded) and rows that start fresh, then decode steps. decoder_cpu's kernel cannot take such a
    batch in one run, so the runtime splits it; either way the logits are PyTorch's."""
    ck = load_checkpoint(checkpoint_of(bundles["generate"]))
    rt = ModelRuntime(load_bundle(bundles["generate"]), n_slots=6, provider="cpu", decoder_graph=graph)
    ref = TorchRuntime(ck.model, 6, ck.tokenizer.special_ids)
    g = np.random.default_rng(3)
    ids = lambda n, t: g.integers(4, ck.config.vocab_size, (n, t)).astype(np.int64)
    calls = [  # (start, ids, input_len, write_pos)
        (1, ids(3, 5), np.array([5, 3, 4]), np.zeros(3, np.int64)),  # first chunks, right-padded
        (1, ids(5, 4), np.array([4, 2, 3, 4, 1]), np.array([5, 3, 0, 0, 4])),  # continue, fresh, continue
        (1, ids(5, 1), np.ones(5, np.int64), np.array([9, 5, 3, 4, 5])),  # decode
        (1, ids(5, 1), np.ones(5, np.int64), np.array([10, 6, 4, 5, 6])),
    ]
    for start, x, lens, wpos in calls:
        np.testing.assert_allclose(rt.step(start, x, lens, wpos), ref.step(start, x, lens, wpos), atol=1e-4, rtol=0)


def test_a_translators_cpu_graph_steps_one_token_per_row_and_leaves_its_cross_buffers_in_place(bundles):
    """decoder_cpu.onnx of a translator does cross-attention with GroupQueryAttention over each row's own source:
    one token per row (a multi-token call runs token by token), its present cross buffers bound to the inputs'
    memory and left as they were; the logits are PyTorch's for sources of different lengths (so different cross
    widths per row) and multi-token rows of mixed lengths."""
    ck = load_checkpoint(checkpoint_of(bundles["translate"]))
    b = load_bundle(bundles["translate"])
    assert [t["shape"] for t in b.contracts["decoder_cpu"]["inputs"] if t["name"] == "input_ids"] == [["batch", 1]]
    rt = ModelRuntime(b, n_slots=6, provider="cpu", decoder_graph="decoder_cpu")
    ref = TorchRuntime(ck.model, 6, ck.tokenizer.special_ids)
    g = np.random.default_rng(5)
    sources = [list(g.integers(4, ck.config.vocab_size, n)) for n in (3, 17, 1, 9, 12)]
    rt.encode(1, sources)
    ref.encode(1, sources)
    cross = {name: buf.host_array() for name, buf in rt._cross_kv.items()}
    before = {name: (a.copy(), a.ctypes.data) for name, a in cross.items()}
    ids = lambda n, t: g.integers(4, ck.config.vocab_size, (n, t)).astype(np.int64)
    calls = [  # (start, ids, input_len, write_pos)
        (1, ids(5, 3), np.array([1, 3, 2, 3, 1]), np.zeros(5, np.int64)),  # by token: runs of rows with a token t
        (1, ids(5, 1), np.ones(5, np.int64), np.array([1, 3, 2, 3, 1])),
        (2, ids(3, 2), np.array([2, 1, 2]), np.array([4, 3, 4])),
        (1, ids(5, 1), np.ones(5, np.int64), np.array([2, 6, 4, 6, 2])),
    ]
    for start, x, lens, wpos in calls:
        np.testing.assert_allclose(rt.step(start, x, lens, wpos), ref.step(start, x, lens, wpos), atol=1e-4, rtol=0)
    for name, a in cross.items():
        assert a.ctypes.data == before[name][1]
        np.testing.assert_array_equal(a, before[name][0])


# a beam reorder with overlap (0 -> 1, 1 -> 2, 2 -> 0 and a duplicate 0 -> 4), and compaction moves (disjoint
# sources and destinations, which the CPU copies row by row in place)
MOVES = {"overlapping": ([0, 1, 2, 0], [1, 2, 0, 4]), "disjoint": ([4, 3], [0, 2])}


@pytest.mark.parametrize("moves", sorted(MOVES))
@pytest.mark.parametrize("live", [False, True], ids=["whole-rows", "live-prefix"])
@pytest.mark.parametrize("task", ["translate", "generate"])
def test_copy_slots_moves_whole_rows(bundles, task, live, moves):
    """Whole rows (the copy graph) or, given the live length, only the live cache positions (numpy on CPU)."""
    b = load_bundle(bundles[task])
    ck = load_checkpoint(checkpoint_of(bundles[task]))
    rt = ModelRuntime(b, n_slots=5, provider="cpu")
    ref = TorchRuntime(ck.model, 5, ck.tokenizer.special_ids)
    g = np.random.default_rng(1)
    for r in (rt, ref):
        if task == "translate":
            r.encode(0, [g.integers(4, 200, n).tolist() for n in (3, 7, 2, 5, 4)])
            prefix = np.ones((5, 1), np.int64)
        else:
            prefix = np.concatenate([np.ones((5, 1), np.int64), g.integers(4, 200, (5, 2))], axis=1)
        r.step(0, prefix, np.full(5, prefix.shape[1]), np.zeros(5, np.int64))
        g = np.random.default_rng(1)
    before = [a.copy() for a in rt.read_cache(1)]
    src, dst = MOVES[moves]
    kept = [s for s in range(5) if s not in dst]
    n_live = prefix.shape[1]
    rt.copy_slots(src, dst, length=n_live if live else None)
    after = rt.read_cache(1)
    upto = n_live if live else None
    for a, bf in zip(after, before):
        np.testing.assert_array_equal(a[dst, :, :upto], bf[src, :, :upto])
        np.testing.assert_array_equal(a[kept], bf[kept])
    # stepping the copies gives the logits the source slots give in PyTorch (cross keys/values and source
    # lengths moved with the rows)
    pos = np.full(5, prefix.shape[1], np.int64)
    nxt = np.full((5, 1), 7, np.int64)
    want = ref.step(0, nxt, np.ones(5, np.int64), pos)
    got = rt.step(0, nxt, np.ones(5, np.int64), pos)
    np.testing.assert_allclose(got[dst + kept], want[src + kept], atol=1e-4, rtol=0)


def test_step_and_encode_reject_bad_arguments_with_clear_messages(bundles):
    rt = ModelRuntime(load_bundle(bundles["translate"]), n_slots=2, provider="cpu")
    one = np.ones(1, np.int64)
    with pytest.raises(ValueError, match="call encode"):
        rt.step(0, np.ones((1, 1)), one, np.zeros(1))
    rt.encode(0, [[5, 6, 7], [8]])
    with pytest.raises(ValueError, match=r"max_len=64"):
        rt.step(0, np.ones((1, 2)), one, np.array([63]))
    with pytest.raises(ValueError, match=r"slots \[1, 3\)"):
        rt.step(1, np.ones((2, 1)), np.ones(2), np.zeros(2))
    with pytest.raises(ValueError, match=r"input_len must be in \[1, T=1\]"):
        rt.step(0, np.ones((1, 1)), np.array([2]), np.zeros(1))
    with pytest.raises(ValueError, match="source lengths"):
        rt.encode(0, [[]])
    with pytest.raises(ValueError, match="dst slots must be distinct"):
        rt.copy_slots([0, 1], [1, 1])
    gen = ModelRuntime(load_bundle(bundles["generate"]), n_slots=1, provider="cpu")
    with pytest.raises(ValueError, match="decoder-only"):
        gen.encode(0, [[5]])


def test_runtime_properties(bundles):
    rt = ModelRuntime(load_bundle(bundles["translate"]), n_slots=3, provider="auto", intra_op_threads=1,
                      max_src_len=16)
    assert rt.is_encoder_decoder and rt.n_slots == 3 and rt.max_len == 64 and rt.max_src_len == 16
    assert (rt.bos_id, rt.eos_id, rt.pad_id) == (1, 2, 0) and rt.vocab_size == rt.bundle.config.vocab_size
    assert rt.provider == (choose_provider("auto"))
    with pytest.raises(ValueError, match="max_src_len=100"):
        ModelRuntime(rt.bundle, n_slots=1, max_src_len=100)


def test_provider_choice():
    assert choose_provider("cpu") == CPU_EP
    if not gpu_visible():
        assert choose_provider("auto") == CPU_EP
        with pytest.raises(ValueError, match="no GPU is visible"):
            choose_provider("cuda")
    with pytest.raises(ValueError, match="'tpu' is not supported"):
        choose_provider("tpu")


def test_serving_side_modules_do_not_import_torch():
    code = ("import sys; import export.bundle, export.evaluate, export.contract, bench.decode_step, serving.engine.runtime, "
            "bench.report; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(__import__("pathlib").Path(__file__).parents[1]))


def test_cuda_requested_but_the_session_lacks_the_cuda_ep_is_an_error(bundles, monkeypatch):
    """ORT runs a session on the CPU EP when the CUDA libraries do not load; the runtime must not carry on as if
    it were on the GPU. (Here: onnxruntime's CPU build, with the GPU check faked to pass.)"""
    import serving.engine.providers as providers

    if gpu_visible():
        pytest.skip("a GPU is visible: the CUDA EP starts")
    monkeypatch.setattr(providers, "gpu_visible", lambda: True)
    with pytest.raises(RuntimeError, match="could not start its CUDA execution provider"):
        ModelRuntime(load_bundle(bundles["generate"]), n_slots=1, provider="cuda")


def test_cuda_options_turn_tf32_off_for_fp32_only_and_profiles_are_written(bundles, tmp_path):
    rt = ModelRuntime(load_bundle(bundles["generate"]), n_slots=2, provider="cpu", profile_prefix=str(tmp_path / "p-"))
    assert rt._providers() == [CPU_EP]
    rt._provider = "CUDAExecutionProvider"
    assert rt._providers()[0][1]["use_tf32"] == "0"
    rt._dtype = np.dtype(np.float16)
    assert rt._providers()[0][1]["use_tf32"] == "1"
    rt._provider = CPU_EP
    rt.step(0, np.array([[1, 5]]), np.array([2]), np.array([0]))
    files = rt.end_profiling()
    assert len(files) == 2 and all(__import__("pathlib").Path(f).is_file() for f in files)  # decoder, slot copy


def test_cross_width_follows_the_longest_source_held(bundles):
    """With decoder.onnx on the CPU (ONNX Attention reads every position of the cross buffers) their source axis
    widens when a long source joins and narrows once the engine keeps only shorter ones (keep_sources), moving
    the rows it keeps: logits stay PyTorch's throughout."""
    ck = load_checkpoint(checkpoint_of(bundles["translate"]))
    rt = ModelRuntime(load_bundle(bundles["translate"]), n_slots=4, provider="cpu", decoder_graph="decoder")
    ref = TorchRuntime(ck.model, 4, ck.tokenizer.special_ids)
    g = np.random.default_rng(5)
    long_len = min(rt.max_src_len, 3 * CROSS_WIDTH_STEP - 5)
    short, long = [g.integers(4, 200, n).tolist() for n in (3, 5)], [g.integers(4, 200, long_len).tolist()]
    pos = np.zeros(4, np.int64)

    def step(n: int) -> None:
        x = g.integers(4, 200, (n, 1)).astype(np.int64)
        np.testing.assert_allclose(rt.step(0, x, np.ones(n, np.int64), pos[:n]),
                                   ref.step(0, x, np.ones(n, np.int64), pos[:n]), atol=1e-4, rtol=0)
        pos[:n] += 1

    for r in (rt, ref):
        r.encode(0, short)
    assert rt.cross_width == CROSS_WIDTH_STEP
    step(2)
    for r in (rt, ref):
        r.encode(2, long)
    assert rt.cross_width == 3 * CROSS_WIDTH_STEP  # widened: rows 0 and 1 moved along
    step(3)
    step(3)
    rt.keep_sources(2)
    assert rt.cross_width == CROSS_WIDTH_STEP  # narrowed: the long source is gone
    step(2)
    with pytest.raises(ValueError, match="no encoded source"):
        rt.step(0, np.ones((3, 1), np.int64), np.ones(3, np.int64), pos[:3])


def test_a_per_row_cross_attention_graph_narrows_its_cross_buffers_only_when_no_source_is_held(bundles):
    """decoder_cpu.onnx of a translator reads only each row's own source positions: a long source leaving does not
    lay the kept rows out again (nor rebuild their bindings); the buffers narrow once nothing is held."""
    rt = ModelRuntime(load_bundle(bundles["translate"]), n_slots=4, provider="cpu")
    assert rt.decoder_graph == "decoder_cpu" and rt.cross_width == CROSS_WIDTH_STEP
    long_len = min(rt.max_src_len, 3 * CROSS_WIDTH_STEP - 5)
    rt.encode(0, [[5, 6, 7], list(range(4, 4 + long_len))])
    wide = rt.cross_width
    assert wide == -(-long_len // CROSS_WIDTH_STEP) * CROSS_WIDTH_STEP
    rt.step(0, np.ones((2, 1), np.int64), np.ones(2, np.int64), np.zeros(2, np.int64))
    bound = dict(rt._bound)
    rt.keep_sources(1)
    assert rt.cross_width == wide and rt._bound == bound
    rt.keep_sources(0)
    assert rt.cross_width == CROSS_WIDTH_STEP


def test_a_source_given_several_times_is_encoded_once_into_each_of_its_slots(bundles, monkeypatch):
    """A beam's rows (and identical requests joining together) share one encoder row: each slot gets the same
    cross keys/values as encoding the sources one by one, and the decoder's logits stay PyTorch's."""
    ck = load_checkpoint(checkpoint_of(bundles["translate"]))
    rt = ModelRuntime(load_bundle(bundles["translate"]), n_slots=6, provider="cpu")
    ref = TorchRuntime(ck.model, 6, ck.tokenizer.special_ids)
    g = np.random.default_rng(9)
    a, b = g.integers(4, 200, 7).tolist(), g.integers(4, 200, 4).tolist()
    sources = [a, a, a, b, list(a), b]
    encoded: list[int] = []
    run = ort.InferenceSession.run  # the CPU's encoder calls (serving/engine/runtime.py `_encode_on_host`)
    monkeypatch.setattr(ort.InferenceSession, "run",
                        lambda self, *a, **k: (encoded.append(len(self.get_inputs())), run(self, *a, **k))[1])
    rt.encode(0, sources)
    assert len(encoded) == 1
    alone = ModelRuntime(load_bundle(bundles["translate"]), n_slots=6, provider="cpu")
    for i, s in enumerate(sources):
        alone.encode(i, [s])
    for name, buf in rt._cross_kv.items():  # each row's own positions (a padded one is masked, whatever it holds)
        for i, s in enumerate(sources):
            np.testing.assert_allclose(buf.host_array()[i, :, : len(s)],
                                       alone._cross_kv[name].host_array()[i, :, : len(s)], atol=1e-5, rtol=0)
    ref.encode(0, sources)
    x = g.integers(4, 200, (6, 1)).astype(np.int64)
    ones, pos = np.ones(6, np.int64), np.zeros(6, np.int64)
    np.testing.assert_allclose(rt.step(0, x, ones, pos), ref.step(0, x, ones, pos), atol=1e-4, rtol=0)


def test_many_sources_are_encoded_in_calls_of_a_few_shortest_first(bundles, monkeypatch):
    """More distinct sources than `MOST_PER_CALL` (a list of texts in one request): calls of at most that many,
    shortest first, each slot with the cross keys/values of encoding its source alone, PyTorch's logits."""
    ck = load_checkpoint(checkpoint_of(bundles["translate"]))
    n = 20
    rt = ModelRuntime(load_bundle(bundles["translate"]), n_slots=n + 1, provider="cpu")
    ref = TorchRuntime(ck.model, n + 1, ck.tokenizer.special_ids)
    g = np.random.default_rng(11)
    distinct = [g.integers(4, 200, int(k)).tolist() for k in g.integers(1, 30, 17)]
    sources = distinct + [distinct[3], list(distinct[0]), distinct[16]]  # 17 distinct among 20
    calls: list[int] = []
    run = ort.InferenceSession.run  # the CPU's encoder calls
    monkeypatch.setattr(ort.InferenceSession, "run",
                        lambda self, *a, **k: (calls.append(len(self.get_inputs())), run(self, *a, **k))[1])
    rt.encode(1, sources)
    assert len(calls) == 3  # 8 + 8 + 1
    alone = ModelRuntime(load_bundle(bundles["translate"]), n_slots=n + 1, provider="cpu")
    for i, s in enumerate(sources):
        alone.encode(1 + i, [s])
    for name, buf in rt._cross_kv.items():
        for i, s in enumerate(sources):
            np.testing.assert_allclose(buf.host_array()[1 + i, :, : len(s)],
                                       alone._cross_kv[name].host_array()[1 + i, :, : len(s)], atol=1e-5, rtol=0)
    ref.encode(1, sources)
    x = g.integers(4, 200, (n, 1)).astype(np.int64)
    ones, pos = np.ones(n, np.int64), np.zeros(n, np.int64)
    np.testing.assert_allclose(rt.step(1, x, ones, pos), ref.step(1, x, ones, pos), atol=1e-4, rtol=0)
