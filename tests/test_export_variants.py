"""int8 and fp16 bundle variants: they build, pass their checks, load and decode."""
from collections import Counter

import numpy as np
import onnx
import pytest

from export.bundle import load_bundle
from export.evaluate import greedy_decode
from export.parity import TorchRuntime, lockstep, synthetic_inputs
from export.variants import check_fp16, count_ops, float_types
from model.checkpoint import load_checkpoint
from serving.engine.runtime import ModelRuntime
from tests.helpers_tiny import checkpoint_of, tiny_bundle


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tmp_path_factory.mktemp("variants")


@pytest.mark.parametrize("variant,op", [("int8", "MatMulIntegerToFloat"), ("int8-dynamic", "MatMulInteger")])
def test_int8_bundle_quantizes_matmuls_and_decodes_close_to_fp32(base, variant, op):
    path = tiny_bundle(base, "translate", variant)
    b = load_bundle(path)
    assert b.variant.value == variant and b.manifest["parity"]["synthetic_cpu"]["rows"] > 0
    for name, graph in b.paths.items():
        onnx.checker.check_model(str(graph), full_check=True)
        ops = count_ops(graph)
        assert ops[op] >= 4, (name, ops)
        assert ops["MatMul"] == 0, f"{name}: unquantized MatMul left: {ops}"
    ck = load_checkpoint(checkpoint_of(path))
    rt = ModelRuntime(b, n_slots=4, provider="cpu")
    ref = TorchRuntime(ck.model, 4, ck.tokenizer.special_ids)
    r = lockstep(ref, rt, synthetic_inputs(ck.config.vocab_size, (5, 2, 9), seed=3, bos=None), steps=10)
    assert 1e-5 < r["logits_max_abs"] < 0.5, r  # quantized (not identical), yet close
    out = greedy_decode(rt, [[5, 6, 7], [8, 9]], max_new_tokens=10)
    assert [len(o) for o in out] == [10, 10] or all(o for o in out)


def test_fp16_bundle_is_float16_throughout_and_runs_on_cpu(base):
    path = tiny_bundle(base, "generate", "fp16")
    b = load_bundle(path)
    assert b.variant.value == "fp16"
    assert b.contracts["decoder"]["inputs"][3]["dtype"] == "float16"
    check_fp16(b.paths["decoder"])
    assert float_types(b.paths["decoder"])["float16"] > 10
    ck = load_checkpoint(checkpoint_of(path))
    rt = ModelRuntime(b, n_slots=4, provider="cpu")  # ORT's CPU EP runs float16 graphs (slowly)
    assert rt.read_cache(0)[0].dtype == np.float16
    ref = TorchRuntime(ck.model, 4, ck.tokenizer.special_ids)
    inputs = synthetic_inputs(ck.config.vocab_size, (4, 7, 1), seed=4, bos=ck.tokenizer.bos_id)
    r = lockstep(ref, rt, inputs, steps=20)
    # float16 keeps ~3 significant digits; these logits reach ~20, so 1e-2..3e-2 is the expected error
    assert 1e-4 < r["logits_max_abs"] < 5e-2, r
    assert r["rows_greedy_identical"] == 3, r


def test_check_fp16_rejects_a_float32_graph(base):
    path = tiny_bundle(base, "generate", "fp32")
    with pytest.raises(ValueError, match="non-float16"):
        check_fp16(load_bundle(path).paths["decoder"])


def test_int8_rows_do_not_depend_on_their_batch(base):
    """A row's logits are the same alone and among other rows (per-row activation scales): the continuous engine's
    guarantee that a request's tokens do not depend on what else runs holds on int8 bundles too."""
    for task in ("translate", "generate"):
        rt = ModelRuntime(load_bundle(tiny_bundle(base, task, "int8")), n_slots=6, provider="cpu")
        rng = np.random.default_rng(5)
        rows = rng.integers(4, rt.vocab_size, (6, 5))
        if rt.is_encoder_decoder:
            rt.encode(0, [r.tolist() for r in rows])
            rows = np.full((6, 1), rt.bos_id)
        n = rows.shape[1]
        batched = rt.step(0, rows, np.full(6, n), np.zeros(6, np.int64))
        alone = rt.step(0, rows[:1], np.array([n]), np.zeros(1, np.int64))
        np.testing.assert_array_equal(alone[0], batched[0])
        decode = rt.step(0, rows[:, :1], np.ones(6, np.int64), np.full(6, n))  # one more token each, cached
        rt.step(0, rows[:1], np.array([n]), np.zeros(1, np.int64))  # row 0 alone again from the same state
        np.testing.assert_array_equal(rt.step(0, rows[:1, :1], np.ones(1, np.int64), np.array([n]))[0], decode[0])


def test_rows_int8_quantizes_matmul_and_gemm_per_row():
    """rows_int8 on a two-product graph (x @ W1, then Gemm with W2^T + bias): no float product is left, the
    result is close to float32's, a row's output is the same alone and in a batch, and a row of zeros (scale 0)
    comes out as the bias exactly."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from export.variants import rows_int8
    from serving.engine.int8_fit import fit_int8_weights, int8_sums_can_overflow

    rng = np.random.default_rng(0)
    w1, w2, b2 = (rng.standard_normal(s).astype(np.float32) * 0.1 for s in ((16, 24), (8, 24), (8,)))
    graph = helper.make_graph(  # w1 read twice (as tied weights are): one int8 copy
        [helper.make_node("MatMul", ["x", "w1"], ["h0"]), helper.make_node("MatMul", ["x", "w1"], ["h1"]),
         helper.make_node("Add", ["h0", "h1"], ["h2"]), helper.make_node("Mul", ["h2", "half"], ["h"]),
         helper.make_node("Gemm", ["h", "w2", "b2"], ["y"], transB=1)],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", 8])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2"), numpy_helper.from_array(b2, "b2"),
         numpy_helper.from_array(np.array(0.5, np.float32), "half")])
    model = rows_int8(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)]))
    ops = Counter(n.op_type for n in model.graph.node)
    assert ops["MatMulIntegerToFloat"] == 3 and ops["MatMul"] == ops["Gemm"] == 0 and ops["QuantizeLinear"] == 2, ops
    assert sorted(i.name for i in model.graph.initializer if i.name.endswith("/int8")) == ["w1/int8", "w2/int8"]
    raw = model.SerializeToString()  # 7-bit weights where this CPU's int8 sums would saturate, as the runtime does
    sess = ort.InferenceSession(fit_int8_weights(raw) if int8_sums_can_overflow() else raw,
                                providers=["CPUExecutionProvider"])
    x = rng.standard_normal((5, 16)).astype(np.float32)
    x[3] = 0
    y = sess.run(None, {"x": x})[0]
    ref = x @ w1 @ w2.T + b2
    assert 1e-6 < np.abs(y - ref).max() < 0.02 * np.abs(ref).max()
    np.testing.assert_array_equal(y[3], b2)
    for i in range(5):
        np.testing.assert_array_equal(sess.run(None, {"x": x[i:i + 1]})[0][0], y[i])
