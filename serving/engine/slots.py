"""KV-cache slot storage of the model runtime (serving/engine/runtime.py): preallocated device tensors whose row
ranges are bound by pointer, and the two tiny ONNX graphs that move data between rows in place (slot copies for
beam reorders and compaction; the placement of encoder outputs into slot rows), so that the same code path serves
the CPU and CUDA EPs.

TORCH-FREE (numpy + onnxruntime + onnx.helper). Does not own: which slot holds what (the engine), sessions.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

_HELPER_OPSET = 24


def _model(graph: onnx.GraphProto) -> bytes:
    """The graph as a model of the lowest IR version its opset allows: onnx.helper's default is the newest IR
    the installed onnx writes (14 with onnx 1.23), which onnxruntime 1.31, still supported, refuses."""
    opsets = [helper.make_opsetid("", _HELPER_OPSET)]
    return helper.make_model(
        graph, opset_imports=opsets, ir_version=helper.find_min_ir_version_for(opsets)
    ).SerializeToString()


def slot_copy_graph(names: list[str], elem: int) -> bytes:
    """out_j = ScatterND(buf_j, dst[:, None], Gather(buf_j, src)): rows dst[i] <- src[i], overlap-safe
    because every Gather runs before its ScatterND writes."""
    nodes, inputs, outputs = [helper.make_node("Unsqueeze", ["dst", "axis0"], ["dst2"])], [], []
    for j, n in enumerate(names):
        nodes += [
            helper.make_node("Gather", [n, "src"], [f"rows_{j}"], axis=0),
            helper.make_node("ScatterND", [n, "dst2", f"rows_{j}"], [f"out_{n}"]),
        ]
        inputs.append(helper.make_tensor_value_info(n, elem, None))
        outputs.append(helper.make_tensor_value_info(f"out_{n}", elem, None))
    inputs += [helper.make_tensor_value_info(k, TensorProto.INT64, ["k"]) for k in ("src", "dst")]
    axis0 = helper.make_tensor("axis0", TensorProto.INT64, [1], [1])
    graph = helper.make_graph(nodes, "kvserve_slot_copy", inputs, outputs, initializer=[axis0])
    return _model(graph)


def slot_place_graph(names: list[str], elem: int) -> bytes:
    """out_j = TensorScatter(buf_j, upd_j, pos) on axis 2: the encoder's (n, H, S, Dh) outputs written
    at position 0 of (n, H, max_src_len, Dh) slot rows, in place."""
    nodes, inputs, outputs = [], [], []
    for n in names:
        nodes.append(helper.make_node("TensorScatter", [n, f"upd_{n}", "pos"], [f"out_{n}"], axis=2))
        inputs += [helper.make_tensor_value_info(n, elem, None), helper.make_tensor_value_info(f"upd_{n}", elem, None)]
        outputs.append(helper.make_tensor_value_info(f"out_{n}", elem, None))
    inputs.append(helper.make_tensor_value_info("pos", TensorProto.INT64, ["n"]))
    graph = helper.make_graph(nodes, "kvserve_slot_place", inputs, outputs)
    return _model(graph)


class SlotBuffer:
    """One preallocated [n_slots, ...] device tensor whose row ranges are bound by pointer. Its axis 2 (positions)
    may be narrowed below its capacity and widened again (`set_width`, host buffers): the rows then lie closer
    together in the same memory, so a kernel that reads every position of that axis reads fewer of them."""

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype, device: str) -> None:
        # Zeros, not uninitialized memory: a NaN bit pattern in a masked cache slot would poison softmax.
        self._flat: np.ndarray | None = np.zeros(int(np.prod(shape)), dtype)
        self.value = ort.OrtValue.ortvalue_from_numpy(self._flat, device, 0)  # CPU: a view of self._flat
        if device != "cpu":
            self._flat = None  # the device holds the data; do not keep a stale host copy
        self.dtype, self.device = dtype, device
        self._shape(shape)

    def _shape(self, shape: tuple[int, ...]) -> None:
        self.shape = shape
        self.row_bytes = int(np.prod(shape[1:])) * np.dtype(self.dtype).itemsize
        self.host: np.ndarray | None = None if self._flat is None else self._flat[: int(np.prod(shape))].reshape(shape)

    def host_array(self) -> np.ndarray:
        """`host`, where the caller runs on host buffers only (the CPU EP)."""
        if self.host is None:
            raise RuntimeError(f"this {self.device} buffer has no host array")
        return self.host

    def set_width(self, width: int, keep_rows: int) -> None:
        """Lay rows [0, keep_rows) out again with `width` positions on axis 2 (host buffers only); each row keeps
        its first min(old, new) positions, the rest of it is stale data that its length masks."""
        keep = min(width, self.shape[2])
        rows = self.host_array()[:keep_rows, :, :keep].copy()
        self._shape((self.shape[0], self.shape[1], width, *self.shape[3:]))
        self.host_array()[:keep_rows, :, :keep] = rows

    def ptr(self, start: int) -> int:
        return self.value.data_ptr() + start * self.row_bytes

    def bind(self, io: ort.IOBinding, name: str, start: int, n: int, output: bool = False) -> None:
        shape = [n, *self.shape[1:]]
        if output:
            io.bind_output(name, self.device, 0, self.dtype, shape, self.ptr(start))
        else:
            io.bind_input(name, self.device, 0, self.dtype, shape, self.ptr(start))

    def numpy(self) -> np.ndarray:
        """The whole buffer on the host (a view on CPU, a copy from the device otherwise)."""
        if self.host is not None:
            return self.host
        return self.value.numpy()[: int(np.prod(self.shape))].reshape(self.shape)


def copy_host_rows(hosts: list[np.ndarray], src: np.ndarray, dst: np.ndarray, width: int) -> None:
    """hosts[..][dst[i], :, :width] <- hosts[..][src[i], :, :width] (host buffers, axis 2 the positions). Disjoint
    sources and destinations (compaction moves) are copied row by row in place; otherwise (a beam reorder, a
    permutation) the fancy-indexed source is copied out first, so overlap is safe."""
    if set(src.tolist()).isdisjoint(dst.tolist()):
        pairs = list(zip(src.tolist(), dst.tolist(), strict=True))
        for host in hosts:
            for s, d in pairs:
                host[d, :, :width] = host[s, :, :width]
    else:
        for host in hosts:
            host[dst, :, :width] = host[src, :, :width]
