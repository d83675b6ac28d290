"""bench/int8_fidelity.py on the tiny bundles: the variants it builds are what their names say, and the comparison
runs through serving's ONNX Runtime."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from bench.int8_fidelity import _bf16_weights, _products, build_variant, measure, variants
from export.bundle import load_bundle
from export.variants import count_ops
from tests.helpers_tiny import tiny_bundle


@pytest.fixture(scope="module")
def generate_bundle(tmp_path_factory):
    return tiny_bundle(tmp_path_factory.mktemp("fidelity"), "generate")


def test_bf16_rounding_is_torchs_round_to_nearest_even():
    w = np.random.default_rng(0).standard_normal((64, 48)).astype(np.float32) * 3
    w[0, :4] = [1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 0.0]  # ties: to even, both ways
    want = torch.from_numpy(w).to(torch.bfloat16).to(torch.float32).numpy()
    assert np.array_equal(_bf16_weights(w), want)


def test_variants_hold_the_products_their_names_say(generate_bundle, tmp_path):
    vocab = load_bundle(generate_bundle).config.vocab_size
    built = {name: build_variant(generate_bundle, tmp_path / str(i), served_as, transform)
             for i, (name, (served_as, transform)) in enumerate(variants(vocab).items())}
    graph = "decoder_cpu.onnx"
    ops = {name: count_ops(path / graph) for name, path in built.items()}
    assert ops["int8"]["MatMulIntegerToFloat"] > 0
    assert ops["int8, output projection in float"]["MatMulIntegerToFloat"] == ops["int8"]["MatMulIntegerToFloat"] - 1
    for name in ("weights rounded to int8", "weights rounded to bf16"):
        assert ops[name]["MatMulIntegerToFloat"] == 0 and load_bundle(built[name]).variant.value == "fp32"
    rounded = [w for _, w in _products(onnx.load(str(built["weights rounded to bf16"] / graph)))]
    original = [w for _, w in _products(onnx.load(str(generate_bundle / graph)))]
    assert len(rounded) == len(original) > 0
    assert all(np.array_equal(w, _bf16_weights(w)) for w in rounded)  # bf16 values, stored as float32
    assert all(np.abs(r - o).max() <= np.abs(o).max() * 2**-8 for r, o in zip(rounded, original, strict=True))
    assert any(not np.array_equal(r, o) for r, o in zip(rounded, original, strict=True))


def test_measure_compares_every_variant_with_fp32(generate_bundle, tmp_path):
    d = tmp_path / "data" / "generate"
    d.mkdir(parents=True)
    d.joinpath("test.txt").write_text("Good morning.\nThank you.\nWe go.\nWhere is my book?\n")
    r = measure(generate_bundle, 4, tmp_path / "data")
    assert r["inputs"] == 4 and r["max_new_tokens"] == 64
    assert set(r["variants"]) == {"fp32", *variants(1)}
    for name, row in r["variants"].items():
        assert 0 < row["hamlet_bits_per_char"] < 10
        if name != "fp32":
            shares = row["identical_by_tokens"]
            assert list(shares) == ["8", "16", "32", "64"] and all(0 <= v <= 1 for v in shares.values())
            assert list(shares.values()) == sorted(shares.values(), reverse=True)  # a longer prefix never gains
