"""Bundle integrity: a tampered, missing, unlisted or inconsistent file is refused with its name."""
import json

import pytest

from export.bundle import BundleError, check_graph_io, load_bundle
from export.contract import FORMAT_VERSION
from tests.helpers_tiny import copy_bundle, tiny_bundle


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return tiny_bundle(tmp_path_factory.mktemp("bundle"), "generate")


@pytest.fixture
def bundle(pristine, tmp_path):
    return copy_bundle(pristine, tmp_path / "b")


def test_pristine_bundle_loads(bundle):
    b = load_bundle(bundle)
    assert b.task == "generate" and b.variant.value == "fp32" and not b.is_encoder_decoder
    assert b.special_ids["eos"] == 2 and b.tokenizer_path.is_file()
    assert b.read_graph("decoder") == (bundle / "decoder.onnx").read_bytes()


@pytest.mark.parametrize("name", ["decoder.onnx", "tokenizer.json"])
def test_tampered_file_is_refused_naming_it(bundle, name):
    data = bytearray((bundle / name).read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit
    (bundle / name).write_bytes(bytes(data))
    with pytest.raises(BundleError, match=rf"{name} was changed"):
        load_bundle(bundle)


@pytest.mark.parametrize("name", ["decoder.onnx", "tokenizer.json"])
def test_missing_file_is_refused_naming_it(bundle, name):
    (bundle / name).unlink()
    with pytest.raises(BundleError, match=rf"missing file {name}"):
        load_bundle(bundle)


def test_missing_manifest_is_refused(bundle):
    (bundle / "manifest.json").unlink()
    with pytest.raises(BundleError, match="missing file .*manifest.json"):
        load_bundle(bundle)


def test_unlisted_file_is_refused(bundle):
    (bundle / "decoder.onnx.data").write_bytes(b"weights an attacker slipped in")
    with pytest.raises(BundleError, match=r"does not list: \['decoder.onnx.data'\]"):
        load_bundle(bundle)


def test_graph_changed_after_loading_is_refused_at_read(bundle):
    b = load_bundle(bundle)
    (bundle / "decoder.onnx").write_bytes(b"not the graph that was verified")
    with pytest.raises(BundleError, match="decoder.onnx changed after the bundle was loaded"):
        b.read_graph("decoder")


def _edit_manifest(bundle, edit):
    m = json.loads((bundle / "manifest.json").read_text())
    edit(m)
    (bundle / "manifest.json").write_text(json.dumps(m))


def test_other_format_version_is_refused(bundle):
    _edit_manifest(bundle, lambda m: m.update(format_version=FORMAT_VERSION + 1))
    with pytest.raises(BundleError, match=f"format_version {FORMAT_VERSION + 1}.*re-export"):
        load_bundle(bundle)


def test_manifest_contract_drift_is_refused(bundle):
    def rename(m):
        m["graphs"]["decoder"]["inputs"][0]["name"] = "tokens"
    _edit_manifest(bundle, rename)
    with pytest.raises(BundleError, match="graph contracts differ"):
        load_bundle(bundle)


def test_manifest_config_inconsistent_with_contracts_is_refused(bundle):
    _edit_manifest(bundle, lambda m: m["model_config"].update(max_len=128))
    with pytest.raises(BundleError, match="graph contracts differ"):
        load_bundle(bundle)


def test_nonexistent_bundle_directory(tmp_path):
    with pytest.raises(BundleError, match="does not exist.*kvserve export"):
        load_bundle(tmp_path / "nope")


CONTRACT = {"inputs": [{"name": "input_ids", "dtype": "int64", "shape": ["batch", "new_tokens"]}],
            "outputs": [{"name": "logits", "dtype": "float32", "shape": ["batch", 50]}]}


def test_check_graph_io_accepts_renamed_symbolic_dims():
    check_graph_io(CONTRACT, [("input_ids", "int64", ["b", None])], [("logits", "float32", ["b", 50])], "g")


@pytest.mark.parametrize("inputs,outputs,msg", [
    ([("ids", "int64", ["b", "t"])], [("logits", "float32", ["b", 50])], "inputs are"),
    ([("input_ids", "int32", ["b", "t"])], [("logits", "float32", ["b", 50])], "input_ids is int32"),
    ([("input_ids", "int64", [3, "t"])], [("logits", "float32", ["b", 50])], r"input_ids is int64\[3, 't'\]"),
    ([("input_ids", "int64", ["b", "t"])], [("logits", "float32", ["b", 49])], "logits is float32"),
])
def test_check_graph_io_rejects_contract_violations(inputs, outputs, msg):
    with pytest.raises(BundleError, match=msg):
        check_graph_io(CONTRACT, inputs, outputs, "g")
