"""serving/engine/int8_fit.py: int8 weights within +-64 where ONNX Runtime's u8 x s8 sums would saturate."""
import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from serving.engine.int8_fit import SAFE, cpu_has_vnni, fit_int8_weights

K, N = 256, 24


def _mmitf_model(w: np.ndarray, scale: np.ndarray, twice: bool = False) -> bytes:
    """y = (a - 128) @ w * scale [+ the same product again, reading the same weight]."""
    nodes = [helper.make_node("MatMulIntegerToFloat", ["a", "w", "a_scale", "w_scale", "zp"], ["y0"],
                              domain="com.microsoft")]
    out = "y0"
    if twice:
        nodes += [helper.make_node("MatMulIntegerToFloat", ["a", "w", "a_scale", "w_scale", "zp"], ["y1"],
                                   domain="com.microsoft"), helper.make_node("Add", ["y0", "y1"], ["y"])]
        out = "y"
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("a", TensorProto.UINT8, ["rows", K])],
                              [helper.make_tensor_value_info(out, TensorProto.FLOAT, ["rows", N])],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(scale, "w_scale"),
                               numpy_helper.from_array(np.ones(1, np.float32), "a_scale"),
                               numpy_helper.from_array(np.array(128, np.uint8), "zp")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
                             ).SerializeToString()


def _weights(model: bytes) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in onnx.load_from_string(model).graph.initializer}


def test_full_range_weights_are_halved_once_with_their_scales_doubled():
    rng = np.random.default_rng(0)
    w = rng.integers(-127, 128, (K, N)).astype(np.int8)
    w[0, 0], w[1, 0] = 127, -127
    scale = rng.uniform(0.01, 0.02, N).astype(np.float32)
    fitted = _weights(fit_int8_weights(_mmitf_model(w, scale, twice=True)))
    half = fitted["w"].astype(np.int16)
    assert np.abs(half).max() == SAFE and np.abs(half - w / 2).max() <= 0.5  # rounded to the nearest
    np.testing.assert_array_equal(fitted["w_scale"], scale * 2)  # once, though two nodes read it


def test_weights_within_range_and_other_graphs_come_back_unchanged():
    w = np.random.default_rng(1).integers(-SAFE, SAFE + 1, (K, N)).astype(np.int8)
    model = _mmitf_model(w, np.ones(N, np.float32))
    assert fit_int8_weights(model) is model


def test_fitted_products_are_exact_on_this_cpu():
    """Whatever this CPU (VNNI or not), ONNX Runtime multiplies the fitted weights exactly: every int32 sum
    equals numpy's."""
    rng = np.random.default_rng(2)
    w = rng.integers(-127, 128, (K, N)).astype(np.int8)
    a = rng.integers(0, 256, (8, K)).astype(np.uint8)
    fitted = fit_int8_weights(_mmitf_model(w, np.ones(N, np.float32)))
    y = ort.InferenceSession(fitted, providers=["CPUExecutionProvider"]).run(None, {"a": a})[0]
    half = _weights(fitted)["w"].astype(np.int64)
    np.testing.assert_array_equal(y, ((a.astype(np.int64) - 128) @ half * 2).astype(np.float32))


def test_vnni_is_read_from_the_cpu_flags(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 fma\n")
    assert not cpu_has_vnni(info)
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_vnni\n")
    assert cpu_has_vnni(info)
    assert not cpu_has_vnni(tmp_path / "missing")
