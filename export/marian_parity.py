"""Parity of an imported Marian model against transformers' own `MarianMTModel`, step by step.

Owns `HFMarianRuntime`: transformers' model behind the StepRuntime interface of export/evaluate.py (encode once,
then decoder steps with its own KV cache), so that export/parity.py's `lockstep` compares it with the imported
PyTorch model or with a bundle's ONNX Runtime runtime: logits max-abs at every step, identical greedy tokens.
Needs `transformers` (the `import` extra); serving never does.

Does not own: the mapping (model/marian.py), the lockstep itself (export/parity.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch


class HFMarianRuntime:
    """transformers' MarianMTModel stepping all its rows together (as `lockstep` and `greedy_decode` do)."""

    provider = "transformers"
    is_encoder_decoder = True

    def __init__(self, folder: str | Path, n_slots: int, special_ids: dict[str, int], max_len: int) -> None:
        import inspect

        from transformers import MarianMTModel
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.model = MarianMTModel.from_pretrained(str(folder)).eval()
        # transformers >= 5 names the cache argument `cache`, earlier versions `past_key_values`
        self._cache_arg = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        self.n_slots, self.max_len, self.max_src_len = n_slots, max_len, max_len
        self.bos_id, self.eos_id, self.pad_id = special_ids["bos"], special_ids["eos"], special_ids["pad"]
        self._enc: Any = None
        self._mask: torch.Tensor | None = None
        self._cache: Any = None

    @torch.no_grad()
    def encode(self, start: int, sources: list[list[int]]) -> None:
        t = max(len(s) for s in sources)
        ids = torch.full((len(sources), t), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(sources), t), dtype=torch.long)
        for i, s in enumerate(sources):
            ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
        self._enc = self.model.get_encoder()(input_ids=ids, attention_mask=mask)
        self._mask, self._cache = mask, None

    @torch.no_grad()
    def step(self, start: int, input_ids: np.ndarray, input_len: np.ndarray, write_pos: np.ndarray) -> np.ndarray:
        if not (np.all(input_len == 1) and np.all(write_pos == write_pos[0])):
            raise ValueError("HFMarianRuntime steps all rows together, one token each")
        if write_pos[0] == 0:
            self._cache = None
        out = self.model(
            encoder_outputs=self._enc,
            attention_mask=self._mask,
            decoder_input_ids=torch.from_numpy(np.asarray(input_ids, np.int64)),
            use_cache=True,
            **{self._cache_arg: self._cache},
        )
        self._cache = getattr(out, "cache", None) or out.past_key_values
        return out.logits[:, -1].float().numpy()


def reference_parity(folder: Path, model: Any, special_ids: dict[str, int], steps: int = 12) -> dict[str, Any]:
    """Lockstep of the imported PyTorch model against transformers' MarianMTModel on random sources (batch 5,
    right-padded, lengths 1-12): {"logits_max_abs", "rows", "rows_greedy_identical", ...}."""
    from export.parity import TorchRuntime, lockstep, synthetic_inputs

    n = 5
    ref = HFMarianRuntime(folder, n, special_ids, model.cfg.max_len)
    ours = TorchRuntime(model, n, special_ids)
    inputs = synthetic_inputs(model.cfg.vocab_size, (7, 1, 12, 3, 8), seed=0, bos=None)
    inputs = [[i if i != special_ids["pad"] else special_ids["unk"] for i in row] for row in inputs]
    return lockstep(ref, ours, inputs, steps=min(steps, model.cfg.max_len - 1))
