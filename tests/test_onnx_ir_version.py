"""Every ONNX model kvserve writes loads in the oldest onnxruntime it supports.

pyproject.toml allows onnxruntime >= 1.31 and the GPU image pins onnxruntime-gpu 1.31.1, whose newest IR version
is 13; onnx.helper writes the newest IR the installed onnx knows (14 with onnx 1.23) unless told otherwise, and
1.31 then refuses the model ("Unsupported model IR version: 14"). The bundles' graphs (torch.onnx, the quantizer,
the fp16 conversion) and the engine's own helper graphs (serving/engine/slots.py) are checked here.
"""
import onnx
import pytest
from onnx import TensorProto

from serving.engine.slots import slot_copy_graph, slot_place_graph
from tests.helpers_tiny import tiny_bundle

MAX_IR_OF_OLDEST_ORT = 13  # onnxruntime 1.31


def test_the_engines_helper_graphs_load_in_the_oldest_onnxruntime():
    for model in (slot_copy_graph(["k", "v"], TensorProto.FLOAT), slot_place_graph(["k"], TensorProto.FLOAT16)):
        assert onnx.load_from_string(model).ir_version <= MAX_IR_OF_OLDEST_ORT


# the bundles other tests of the suite build too (tiny_bundle builds each once per session): no export of its own
@pytest.mark.parametrize(("task", "variant"), [("translate", "fp32"), ("translate", "int8"), ("generate", "fp16")])
def test_every_bundle_graph_loads_in_the_oldest_onnxruntime(tmp_path_factory, task, variant):
    bundle = tiny_bundle(tmp_path_factory.mktemp("ir"), task, variant)
    graphs = sorted(bundle.glob("*.onnx"))
    assert graphs
    for path in graphs:
        ir = onnx.load(str(path), load_external_data=False).ir_version
        assert ir <= MAX_IR_OF_OLDEST_ORT, f"{path.name}: IR version {ir}"
