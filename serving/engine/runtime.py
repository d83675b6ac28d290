"""The model runtime: ONNX Runtime sessions of one bundle and the KV-cache slots they run on.

Owns: the sessions of one bundle (opened by serving/engine/sessions.py: options, providers), the slot buffers
(serving/engine/slots.py; per decoder layer, self-attention keys/values `[n_slots, H, M, Dh]` and, for translation,
cross-attention keys/values `[n_slots, H, W, Dh]` plus each slot's source length; W = max_src_len, or on the CPU the
longest source held), and three operations on slots: `encode` (encoder run, cross keys/values written into
slots), `step` (one decoder step on contiguous slots, KV updated in place through IOBinding: past and present bound
to the same rows) and `copy_slots` (beam reordering, compaction); a freed slot needs no reset, its rows are
overwritten by the next prefill. One-token steps run through bindings made once per row range.

Decoder graph: on the CPU EP, a bundle's `decoder_cpu.onnx` where it has one (GroupQueryAttention: per-row
cache lengths, no prefix copies; a translator's cross-attention over each row's own source; export/contract.py),
else the portable `decoder.onnx`. `step` splits a multi-token call into the calls that graph accepts
(serving/engine/step_calls.py); a translator's cross buffers are bound as its outputs too, in place.

Slot data never leaves the device: rows [start, start+n) are bound by pointer (a view, no copy). On the CUDA EP
(serving/engine/providers.py chooses it), fp32 bundles run with TF32 off (ORT's default is on): fp32 is the
reference variant, held to PyTorch's logits within 1e-4; fp16 bundles are the fast one. A CUDA session that
came up without the CUDA EP (ORT falls back to the CPU EP when the CUDA or cuDNN libraries cannot be loaded)
is an error, not a silent CPU fallback (serving/engine/sessions.py).

TORCH-FREE (numpy + onnxruntime + onnx.helper). Does not own: scheduling, sampling, tokenization
(the rest of serving/engine/), bundle verification (export/bundle.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnxruntime as ort
from onnx import helper

from export.bundle import Bundle
from export.contract import (
    cross_key,
    cross_value,
    past_key,
    past_value,
    present_cross_key,
    present_cross_value,
    present_key,
    present_value,
)
from serving.engine.providers import CPU_EP, CUDA_EP, choose_provider, gpu_visible  # noqa: F401 (re-exported)
from serving.engine.runtime_checks import check_copy, check_rows, check_source_lengths, check_step
from serving.engine.sessions import check_session_io, execution_providers, open_session
from serving.engine.slots import SlotBuffer, copy_host_rows, slot_copy_graph, slot_place_graph
from serving.engine.sources import encoder_calls, encoder_inputs, source_binding
from serving.engine.step_calls import by_gqa_run, by_token

CROSS_WIDTH_STEP = 16  # the cross buffers' source axis grows and shrinks in steps of this many positions
CROSS_IN_OUT = ((cross_key, present_cross_key), (cross_value, present_cross_value))


class ModelRuntime:
    """Sessions + KV slots of one bundle. The engine owns which slot holds which request."""

    def __init__(
        self,
        bundle: Bundle,
        n_slots: int,
        provider: str = "auto",
        intra_op_threads: int | None = None,
        max_src_len: int | None = None,
        decoder_graph: str | None = None,
        profile_prefix: str | None = None,
    ) -> None:
        """`profile_prefix`: when given, every session writes ONNX Runtime's profile (JSON trace) to files
        starting with it; `end_profiling()` returns their paths (bench/gpu_check reads them)."""
        cfg = bundle.config
        if n_slots < 1:
            raise ValueError(f"n_slots={n_slots} must be >= 1")
        self.bundle, self._n_slots = bundle, n_slots
        self._provider = choose_provider(provider)
        self._device = "cuda" if self._provider == CUDA_EP else "cpu"
        self._threads = 1 if intra_op_threads is None else intra_op_threads
        if self._threads < 1:
            raise ValueError(f"intra_op_threads={intra_op_threads} must be >= 1 (or None for 1)")
        self._n_layers, self._max_len, self._vocab = cfg.n_decoder_layers, cfg.max_len, cfg.vocab_size
        self._max_src_len = cfg.max_len if max_src_len is None else max_src_len
        if not 1 <= self._max_src_len <= cfg.max_len:
            raise ValueError(f"max_src_len={max_src_len} must be in [1, {cfg.max_len}] (the model's max_len)")
        self._dtype = np.dtype(bundle.variant.float_dtype)
        self._profile_prefix = profile_prefix
        self._sessions: list[ort.InferenceSession] = []
        elem = helper.np_dtype_to_tensor_dtype(self._dtype)

        if decoder_graph is None:
            decoder_graph = "decoder_cpu" if self._provider == CPU_EP and "decoder_cpu" in bundle.paths else "decoder"
        if decoder_graph not in ("decoder", "decoder_cpu") or decoder_graph not in bundle.paths:
            raise ValueError(
                f"decoder_graph={decoder_graph!r}: the bundle's decoder graphs are "
                f"{sorted(k for k in bundle.paths if k.startswith('decoder'))}"
            )
        self.decoder_graph = decoder_graph
        self._decoder = self._session(bundle.read_graph(decoder_graph), decoder_graph)
        contract = bundle.contracts[decoder_graph]
        self._one_token = next(t["shape"][1] == 1 for t in contract["inputs"] if t["name"] == "input_ids")
        outputs = {t["name"] for t in contract["outputs"]}
        pairs = [(f(i), g(i)) for i in range(cfg.n_decoder_layers) for f, g in CROSS_IN_OUT]
        self._cross_out = {name: out for name, out in pairs if out in outputs}  # bound to the inputs' memory
        self._encoder = self._session(bundle.read_graph("encoder"), "encoder") if bundle.is_encoder_decoder else None
        self._allocate_slots(elem)

    # ---- properties the engine reads (read-only) --------------------------------------------------------
    is_encoder_decoder = property(lambda self: self._encoder is not None)
    n_slots = property(lambda self: self._n_slots)
    max_len = property(lambda self: self._max_len)  # KV cache length M: write_pos + new tokens stay within it
    max_src_len = property(lambda self: self._max_src_len)
    # The cross buffers' source positions per row on the CPU: the longest source held, rounded up to
    # CROSS_WIDTH_STEP (see _allocate_slots); max_src_len elsewhere.
    cross_width = property(lambda self: self._cross_width)
    vocab_size = property(lambda self: self._vocab)
    bos_id = property(lambda self: self.bundle.special_ids["bos"])
    eos_id = property(lambda self: self.bundle.special_ids["eos"])
    pad_id = property(lambda self: self.bundle.special_ids["pad"])
    banned_ids = property(lambda self: self.bundle.banned_ids)  # never generated (the engine applies them)
    provider = property(lambda self: self._provider)

    # ---- operations ------------------------------------------------------------------------------------
    def encode(self, start: int, sources: list[list[int]]) -> None:
        """Run the encoder on `sources` and store each one's cross keys/values and source length in slots
        start, start+1, ... . On the CPU a source given several times (a beam's rows, identical requests) is encoded
        once and copied to each of its slots, and more than 8 distinct sources run as calls of 8, shortest first."""
        encoder = self._encoder
        if encoder is None:
            raise ValueError("encode() needs an encoder-decoder bundle; this one is a decoder-only LM")
        n = len(sources)
        check_rows(start, n, self._n_slots)
        lens = np.array([len(s) for s in sources], np.int64)
        check_source_lengths(lens, self._max_src_len)
        if self._adaptive_width:
            self._src_len[start : start + n] = 0  # these rows are about to be overwritten: nothing to keep
            self._fit_cross_width(max(int(lens.max()), int(self._src_len.max())))
        if self._device == "cpu":  # into host arrays, then numpy copies into the slot rows: no placement graph
            for call, slots, take in encoder_calls(sources):
                self._encode_on_host(encoder, call, start, slots, take)
        else:
            io, held = source_binding(encoder, sources, self.pad_id)
            self._encode_on_device(encoder, io, start, n)
            del held
        self._src_len[start : start + n] = lens

    def _encode_on_host(
        self,
        encoder: ort.InferenceSession,
        sources: list[list[int]],
        start: int,
        slots: np.ndarray | None,
        take: np.ndarray | None,
    ) -> None:
        """(A batch-1 encode spent a quarter of its time binding and running the placement graph; binding the
        outputs to host arrays by pointer costs more than `run` with ORT's own output buffers.) `slots`: the slots
        (from `start`) this call fills, None: start, start+1, ...; `take`: the row of `sources` each of them gets,
        None: one row each, in order (serving/engine/sources.py `encoder_calls`)."""
        ids, lens = encoder_inputs(sources, self.pad_id)
        out = encoder.run(list(self._cross_kv), {"src_ids": ids, "src_len": lens})
        n, width = ids.shape
        rows = n if take is None else len(take)
        dst = slice(start, start + rows) if slots is None else start + slots
        for buf, arr in zip(self._cross_kv.values(), out, strict=True):
            buf.host_array()[dst, :, :width] = arr if take is None else arr[take]

    def _encode_on_device(self, encoder: ort.InferenceSession, io: ort.IOBinding, start: int, n: int) -> None:
        for name in self._cross_kv:
            io.bind_output(name, self._device)
        encoder.run_with_iobinding(io)
        place = self._place.io_binding()
        for name, out in zip(self._cross_kv, io.get_outputs(), strict=True):
            buf = self._cross_kv[name]
            buf.bind(place, name, start, n)
            buf.bind(place, f"out_{name}", start, n, output=True)
            place.bind_ortvalue_input(f"upd_{name}", out)
        place.bind_cpu_input("pos", np.zeros(n, np.int64))
        self._place.run_with_iobinding(place)

    def keep_sources(self, n: int) -> None:
        """Only slots [0, n) hold sources that later steps read (the engine's live rows); the others are
        forgotten, and on the CPU the cross buffers narrow to the longest kept source once that halves them."""
        self._src_len[n:] = 0
        if self._adaptive_width:
            self._fit_cross_width(int(self._src_len.max()))

    def step(
        self, start: int, input_ids: np.ndarray, input_len: np.ndarray, write_pos: np.ndarray, copy: bool = True
    ) -> np.ndarray:
        """One decoder step on slots [start, start+n): returns float32 logits (n, V) of each row's last real
        token; writes the new keys/values at write_pos[b] + i, in place.

        `copy=False` (the engine's step runner): a one-token step may return a view of the runtime's own logits
        rows [start, start+n), valid until the next step over those rows; read it before stepping again."""
        input_ids = np.ascontiguousarray(input_ids, np.int64)
        input_len = np.ascontiguousarray(input_len, np.int64)
        write_pos = np.ascontiguousarray(write_pos, np.int64)
        check_step(
            start,
            input_ids,
            input_len,
            write_pos,
            self._n_slots,
            self._max_len,
            self._src_len if self._cross_kv else None,
        )
        one = input_ids.shape[1] == 1
        if not one and self._one_token:
            return by_token(self._run_decoder, start, input_ids, input_len, write_pos, self._vocab)
        if not one and self.decoder_graph == "decoder_cpu" and write_pos.any():
            return by_gqa_run(self._call, start, input_ids, input_len, write_pos)
        logits = self._call(start, input_ids, input_len, write_pos)
        return logits.copy() if copy and one else logits  # only a one-token call hands out the runtime's rows

    def _call(self, start: int, input_ids: np.ndarray, input_len: np.ndarray, write_pos: np.ndarray) -> np.ndarray:
        """One decoder call on rows [start, start+n): the bound-once path for one token per row, else a fresh
        binding."""
        if input_ids.shape[1] == 1:
            return self._decode_one(start, input_ids, input_len, write_pos)
        return self._run_decoder(start, input_ids, input_len, write_pos)

    def _decode_one(
        self, start: int, input_ids: np.ndarray, input_len: np.ndarray, write_pos: np.ndarray
    ) -> np.ndarray:
        """A one-token step (every decode step, and a translation joiner's bos) through the IOBinding of rows
        [start, start+n), bound once: its cache rows by pointer, its inputs and logits to rows of the runtime's
        own arrays. A step copies n ids, lengths and positions in and runs: no binding calls, no allocation."""
        n = input_ids.shape[0]
        rows = slice(start, start + n)
        io = self._bound.get((start, n))
        if io is None:
            io = self._bound[(start, n)] = self._bind_rows(start, n)
        self._in_ids[rows, 0] = input_ids[:, 0]
        self._in_len[rows] = input_len
        self._in_pos[rows] = write_pos
        if self._device != "cpu":
            # IOBinding copies a host input to the device when it is bound, not when the graph runs: off the
            # CPU, the rows' new ids, lengths and positions must be bound again for each step
            self._bind_step_inputs(io, start, n)
        self._decoder.run_with_iobinding(io)
        return self._logits[rows].astype(np.float32, copy=False)  # a view for fp32 bundles

    def _bind_step_inputs(self, io: ort.IOBinding, start: int, n: int) -> None:
        """Rows [start, start+n) of the one-token steps' host inputs, bound by address."""
        for name, arr in (
            ("input_ids", self._in_ids),
            ("input_len", self._in_len),
            ("write_pos", self._in_pos),
            *((("src_len", self._src_len),) if self._cross_kv else ()),
        ):
            row = arr.strides[0]
            io.bind_input(name, "cpu", 0, arr.dtype, [n, *arr.shape[1:]], arr.ctypes.data + start * row)

    def _bind_rows(self, start: int, n: int) -> ort.IOBinding:
        io = self._decoder.io_binding()
        self._bind_step_inputs(io, start, n)
        io.bind_output(
            "logits",
            "cpu",
            0,
            self._logits.dtype,
            [n, self._vocab],
            self._logits.ctypes.data + start * self._logits.strides[0],
        )
        self._bind_caches(io, start, n)
        return io

    def _bind_caches(self, io: ort.IOBinding, start: int, n: int) -> None:
        """Rows [start, start+n) of every cache: self-attention past and present (the same memory), cross."""
        for i in range(self._n_layers):
            for past, present in ((past_key(i), present_key(i)), (past_value(i), present_value(i))):
                self._self_kv[past].bind(io, past, start, n)
                self._self_kv[past].bind(io, present, start, n, output=True)
        for name, buf in self._cross_kv.items():
            buf.bind(io, name, start, n)
            if name in self._cross_out:  # the same memory: the kernel writes back what is there
                buf.bind(io, self._cross_out[name], start, n, output=True)

    def _run_decoder(
        self, start: int, input_ids: np.ndarray, input_len: np.ndarray, write_pos: np.ndarray
    ) -> np.ndarray:
        n = input_ids.shape[0]
        io = self._decoder.io_binding()
        io.bind_output("logits")  # on the host (ORT copies it off the device); first of get_outputs()
        io.bind_cpu_input("input_ids", input_ids)
        io.bind_cpu_input("input_len", input_len)
        io.bind_cpu_input("write_pos", write_pos)
        self._bind_caches(io, start, n)
        if self._cross_kv:
            io.bind_cpu_input("src_len", self._src_len[start : start + n].copy())
        self._decoder.run_with_iobinding(io)
        outs = io.get_outputs()
        if outs[1].data_ptr() != self._self_kv[past_key(0)].ptr(start):
            raise RuntimeError(
                "onnxruntime did not write the KV cache into the bound buffer; the cache "
                "update was lost (is the decoder graph's KV update in place?)"
            )
        return outs[0].numpy().astype(np.float32, copy=False)

    def copy_slots(self, src: Sequence[int], dst: Sequence[int], length: int | None = None) -> None:
        """dst[i] <- src[i] for every KV row (and cross KV and source length); overlap-safe.

        `length`: only the first `length` cache positions are live in the source slots (the caller's cached
        lengths); on the CPU the copy then moves those only (numpy on the host buffers; a compaction move at
        ~50 live of 256 positions is ~5x less memory traffic), elsewhere whole rows (the copy graph)."""
        src_a, dst_a = np.asarray(src, np.int64).reshape(-1), np.asarray(dst, np.int64).reshape(-1)
        check_copy(src_a, dst_a, self._n_slots)
        if src_a.size == 0:
            return
        if length is not None and self._device == "cpu":
            live = max(0, min(int(length), self.max_len))
            copy_host_rows([buf.host_array() for buf in self._self_kv.values()], src_a, dst_a, live)
            src_max = int(self._src_len[src_a].max())
            copy_host_rows([buf.host_array() for buf in self._cross_kv.values()], src_a, dst_a, src_max)
            self._src_len[dst_a] = self._src_len[src_a]
            return
        io = self._copy.io_binding()
        for name, buf in (*self._self_kv.items(), *self._cross_kv.items()):
            buf.bind(io, name, 0, self._n_slots)
            buf.bind(io, f"out_{name}", 0, self._n_slots, output=True)
        io.bind_cpu_input("src", src_a)
        io.bind_cpu_input("dst", dst_a)
        self._copy.run_with_iobinding(io)
        self._src_len[dst_a] = self._src_len[src_a]

    def read_cache(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Self-attention keys and values of one layer, all slots (debugging, tests)."""
        return self._self_kv[past_key(layer)].numpy(), self._self_kv[past_value(layer)].numpy()

    def cache_ptr(self, layer: int, slot: int = 0) -> int:
        """Device address of a slot's key row in one layer (tests check that steps never move it)."""
        return self._self_kv[past_key(layer)].ptr(slot)

    def end_profiling(self) -> list[str]:
        """Stop profiling every session (constructed with `profile_prefix`); the profile files written."""
        if self._profile_prefix is None:
            raise ValueError("end_profiling() needs a runtime built with profile_prefix=...")
        return [s.end_profiling() for s in self._sessions]

    # ---- internals ---------------------------------------------------------------------------------------
    def _allocate_slots(self, elem: int) -> None:
        """The KV-cache slot buffers, the one-token steps' input and logits rows, and the slot-copy session."""
        cfg, n_slots = self.bundle.config, self._n_slots
        kv = (n_slots, cfg.n_heads, cfg.max_len, cfg.head_dim)
        self._self_kv = {
            n: SlotBuffer(kv, self._dtype, self._device)
            for i in range(self._n_layers)
            for n in (past_key(i), past_value(i))
        }
        self._cross_kv: dict[str, SlotBuffer] = {}
        if self._encoder is not None:
            ckv = (n_slots, cfg.n_heads, self._max_src_len, cfg.head_dim)
            self._cross_kv = {
                n: SlotBuffer(ckv, self._dtype, self._device)
                for i in range(self._n_layers)
                for n in (cross_key(i), cross_value(i))
            }
            if self._device != "cpu":  # on the host, numpy places the encoder's outputs (encode)
                self._place = self._session(slot_place_graph(list(self._cross_kv), elem), None)
        self._src_len = np.zeros(n_slots, np.int64)  # 0 = no source encoded in this slot
        # One-token steps: inputs and logits live in these rows (slot i's in row i), bound once per (start, n).
        self._in_ids = np.zeros((n_slots, 1), np.int64)
        self._in_len, self._in_pos = np.ones(n_slots, np.int64), np.zeros(n_slots, np.int64)
        self._logits = np.zeros((n_slots, self._vocab), self._dtype)
        self._bound: dict[tuple[int, int], ort.IOBinding] = {}
        # ONNX Attention reads every position of the cross buffers' source axis: on the CPU that axis follows the
        # longest source held (a multiple of CROSS_WIDTH_STEP), not max_src_len (3.8 of a 9.8 ms step at batch 32
        # went to cross-attention at 160). A per-row cross-attention graph (`_cross_out`) only keeps its rows
        # close together that way: its buffers narrow only when no source is held, not under load.
        self._adaptive_width = self._device == "cpu" and bool(self._cross_kv)
        self._cross_width = self._max_src_len
        if self._adaptive_width:
            self._set_cross_width(min(self._max_src_len, CROSS_WIDTH_STEP), keep_rows=0)
        self._copy = self._session(slot_copy_graph([*self._self_kv, *self._cross_kv], elem), None)

    def _fit_cross_width(self, need: int) -> None:
        """Widen the cross buffers' source axis at once when a source needs it; narrow it when the longest source
        held needs half of it or less (hysteresis), for a per-row cross-attention graph only once nothing is held."""
        width = min(self._max_src_len, -(-max(need, 1) // CROSS_WIDTH_STEP) * CROSS_WIDTH_STEP)
        narrow = 2 * width <= self._cross_width and (not self._cross_out or not self._src_len.any())
        if width > self._cross_width or narrow:
            held = np.flatnonzero(self._src_len)
            self._set_cross_width(width, keep_rows=int(held[-1]) + 1 if held.size else 0)

    def _set_cross_width(self, width: int, keep_rows: int) -> None:
        for buf in self._cross_kv.values():
            buf.set_width(width, keep_rows)
        self._cross_width = width
        self._bound.clear()  # their cross bindings have the old shape

    def _session(self, model: bytes, contract_name: str | None) -> ort.InferenceSession:
        """A session of a bundle graph (`contract_name`: its name in the bundle) or of a helper graph (None)."""
        profile = None if self._profile_prefix is None else f"{self._profile_prefix}{contract_name or 'helper'}"
        fit_int8 = self._provider == CPU_EP and contract_name is not None
        sess = open_session(model, self._provider, self._providers(), self._threads, profile, fit_int8)
        self._sessions.append(sess)
        if contract_name is not None:
            check_session_io(sess, self.bundle.contracts[contract_name], str(self.bundle.paths[contract_name]))
        return sess

    def _providers(self) -> list:
        return execution_providers(self._provider, self._dtype)
