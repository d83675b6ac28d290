"""Convert a kvserve checkpoint to CTranslate2 through its Python model-spec API (same weights).

`kvserve export CHECKPOINT --out DIR --format ctranslate2` writes a CTranslate2 model directory (model.bin,
config.json, vocabularies) so benchmarks compare ONNX Runtime and CTranslate2 on identical weights.

Mapping: TransformerSpec (translation) or TransformerDecoderModelSpec (LM) with pre_norm as configured,
ReLU, the embedding scaled by sqrt(d_model), our sinusoidal table given explicitly as the position
encodings (CTranslate2's built-in table orders sin/cos differently), shared embeddings (source, target and
output projection are one matrix when tie_embeddings), self-attention q/k/v fused into one linear, cross
attention k/v fused, LayerNorm epsilon 1e-5 (torch's default). The vocabulary is the tokenizer's token
strings in id order, so CTranslate2's ids are ours.

Owns: the spec mapping, the conversion command, a greedy check against PyTorch on a few synthetic inputs,
and the full-size check on the test split:

    python -m export.ctranslate2_convert CT2_DIR CHECKPOINT --sentences 200     # prints JSON

Does not own: benchmarks (bench/decode_step.py, loadtest/).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from export.torch_model import kvserve_model, layers
from model.transformer import DecoderLayer, DecoderOnlyLM, EncoderDecoder, EncoderLayer, MultiHeadAttention

LAYER_NORM_EPS = 1e-5


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().cpu().numpy().copy()


def _linear(spec: Any, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    spec.weight = _np(weight)
    if bias is not None:
        spec.bias = _np(bias)


def _fused(spec: Any, linears: list[torch.nn.Linear]) -> None:
    _linear(spec, torch.cat([m.weight for m in linears]), torch.cat([m.bias for m in linears]))


def _norm(spec: Any, norm: torch.nn.Module) -> None:
    assert isinstance(norm, torch.nn.LayerNorm), f"a pre-norm model's final norm is a LayerNorm, got {norm}"
    spec.gamma, spec.beta = _np(norm.weight), _np(norm.bias)


def _self_attention(spec: Any, mha: MultiHeadAttention, norm: torch.nn.LayerNorm) -> None:
    _fused(spec.linear[0], [mha.q_proj, mha.k_proj, mha.v_proj])
    _linear(spec.linear[1], mha.out_proj.weight, mha.out_proj.bias)
    _norm(spec.layer_norm, norm)


def _ffn(spec: Any, layer: Any, norm: torch.nn.LayerNorm) -> None:
    _linear(spec.linear_0, layer.ffn.fc1.weight, layer.ffn.fc1.bias)
    _linear(spec.linear_1, layer.ffn.fc2.weight, layer.ffn.fc2.bias)
    _norm(spec.layer_norm, norm)


def _decoder(spec: Any, model: EncoderDecoder | DecoderOnlyLM, cross: bool) -> None:
    dec = model.decoder
    spec.embeddings.weight = _np(model.embed.tok.weight)
    spec.position_encodings.encodings = _np(model.embed.get_buffer("pe"))
    if model.cfg.pre_norm:
        _norm(spec.layer_norm, dec.norm)
    spec.projection.weight = _np(dec.lm_head.weight)
    for ls, layer in zip(spec.layer, layers(dec.layers, DecoderLayer), strict=True):
        _self_attention(ls.self_attention, layer.self_attn, layer.res_self.norm)
        if cross:
            ca, res = layer.cross_attn, layer.res_cross
            assert ca is not None and res is not None, "a translation model's decoder layers attend to the source"
            _linear(ls.attention.linear[0], ca.q_proj.weight, ca.q_proj.bias)
            _fused(ls.attention.linear[1], [ca.k_proj, ca.v_proj])
            _linear(ls.attention.linear[2], ca.out_proj.weight, ca.out_proj.bias)
            _norm(ls.attention.layer_norm, res.norm)
        _ffn(ls.ffn, layer, layer.res_ffn.norm)


def build_spec(model: EncoderDecoder | DecoderOnlyLM, vocabulary: list[str]) -> Any:
    """The CTranslate2 model spec holding `model`'s weights."""
    import ctranslate2
    from ctranslate2.specs import common_spec, transformer_spec

    cfg = model.cfg
    options = {"activation": "relu", "positions": "interleaved", "scale_embedding": True, "logits_bias": False}
    other = {k: getattr(cfg, k) for k, v in options.items() if getattr(cfg, k) != v}
    # an imported model's options: CTranslate2 converts Marian checkpoints itself (ct2-transformers-converter)
    if other:
        raise ValueError(f"this converter maps kvserve's own models only; model options {other} are not mapped")
    relu = common_spec.Activation.RELU
    if isinstance(model, EncoderDecoder):
        spec = transformer_spec.TransformerSpec.from_config(
            (cfg.n_encoder_layers, cfg.n_decoder_layers), cfg.n_heads, pre_norm=cfg.pre_norm, activation=relu
        )
        enc = spec.encoder
        enc.embeddings[0].weight = _np(model.embed.tok.weight)
        enc.position_encodings.encodings = _np(model.embed.get_buffer("pe"))
        if cfg.pre_norm:
            _norm(enc.layer_norm, model.enc_norm)
        for ls, layer in zip(enc.layer, layers(model.enc_layers, EncoderLayer), strict=True):
            _self_attention(ls.self_attention, layer.self_attn, layer.res1.norm)
            _ffn(ls.ffn, layer, layer.res2.norm)
        _decoder(spec.decoder, model, cross=True)
        spec.register_source_vocabulary(vocabulary)
        spec.register_target_vocabulary(vocabulary)
    else:
        spec = transformer_spec.TransformerDecoderModelSpec.from_config(
            cfg.n_decoder_layers, cfg.n_heads, pre_norm=cfg.pre_norm, activation=relu
        )
        _decoder(spec.decoder, model, cross=False)
        spec.register_vocabulary(vocabulary)
    spec.config.layer_norm_epsilon = LAYER_NORM_EPS
    assert ctranslate2 is not None
    return spec


def vocabulary_of(tok: Any, vocab_size: int) -> list[str]:
    """Token strings in id order (ids beyond the tokenizer's, if the model has any, get placeholders)."""
    return [tok.hf.id_to_token(i) or f"<unused_{i}>" for i in range(vocab_size)]


def ct2_greedy(model_dir: Path, task: str, tokens: list[list[str]], max_new_tokens: int) -> list[list[str]]:
    """Greedy decoding with CTranslate2: translations of sources, or continuations of prompts (with bos)."""
    import ctranslate2

    if task == "translate":
        tr = ctranslate2.Translator(str(model_dir), device="cpu", intra_threads=1)
        res = tr.translate_batch(tokens, beam_size=1, max_decoding_length=max_new_tokens)
        return [r.hypotheses[0] for r in res]
    gen = ctranslate2.Generator(str(model_dir), device="cpu", intra_threads=1)
    # With include_prompt_in_result=False CTranslate2 still returns the part of each prompt beyond the
    # batch's shortest one; with True every result is prompt[1:] + generated, and max_length counts both.
    longest = max(len(t) for t in tokens) - 1
    res = gen.generate_batch(
        tokens, max_length=longest + max_new_tokens, sampling_topk=1, include_prompt_in_result=True
    )
    return [r.sequences[0][len(t) - 1 :][:max_new_tokens] for t, r in zip(tokens, res, strict=True)]


def convert_checkpoint(
    checkpoint: Path, out: Path, force: bool = False, quantization: str | None = None, check_inputs: int = 8
) -> dict[str, Any]:
    """Checkpoint -> CTranslate2 model directory; greedy-checks `check_inputs` synthetic inputs vs PyTorch."""
    from export.evaluate import greedy_decode
    from export.parity import TorchRuntime, synthetic_inputs
    from model.checkpoint import load_checkpoint

    if out.exists() and any(out.iterdir()) and not force:
        raise ValueError(f"--out {out} already exists and is not empty; pass --force to overwrite it")
    ck = load_checkpoint(checkpoint)
    vocab = vocabulary_of(ck.tokenizer, ck.config.vocab_size)
    spec = build_spec(kvserve_model(ck.model), vocab)
    spec.validate()
    spec.optimize(quantization=quantization)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    spec.save(str(out))
    bos = None if ck.task == "translate" else ck.tokenizer.bos_id
    inputs = synthetic_inputs(ck.config.vocab_size, [3 + 2 * i for i in range(check_inputs)], seed=7, bos=bos)
    ref = greedy_decode(TorchRuntime(kvserve_model(ck.model), len(inputs), ck.tokenizer.special_ids), inputs, 20)
    got = ct2_greedy(out, ck.task, [[vocab[i] for i in x] for x in inputs], 20)
    same = sum([vocab[i] for i in r] == g for r, g in zip(ref, got, strict=True))
    return {
        "out": str(out),
        "task": ck.task,
        "quantization": quantization or "float32",
        "greedy_identical": f"{same}/{len(inputs)} synthetic inputs, 20 tokens",
    }


def split_agreement(ct2_dir: Path, checkpoint: Path, n: int, data_dir: str, batch_size: int = 32) -> dict[str, Any]:
    """Greedy outputs of CTranslate2 vs PyTorch on the first n test sentences (LM: n prompts, 64 tokens)."""
    from export.evaluate import greedy_decode, prompt_ids, scores, source_ids
    from export.parity import TorchRuntime
    from model import data
    from model.checkpoint import load_checkpoint

    ck = load_checkpoint(checkpoint)
    tok, vocab = ck.tokenizer, vocabulary_of(ck.tokenizer, ck.config.vocab_size)
    index = {t: i for i, t in enumerate(vocab)}
    if ck.task == "translate":
        pairs = data.load_pairs(data_dir, "test")[:n]
        inputs, budget = [source_ids(tok, s, ck.config.max_len) for s, _ in pairs], ck.config.max_len - 1
    else:
        inputs, budget = [prompt_ids(tok, p) for p in data.lm_prompts(data.load_text(data_dir, "test"), n)], 64
    ref = greedy_decode(TorchRuntime(kvserve_model(ck.model), batch_size, tok.special_ids), inputs, budget, batch_size)
    got = []
    for i in range(0, len(inputs), batch_size):
        chunk = [[vocab[t] for t in x] for x in inputs[i : i + batch_size]]
        got += [[index[t] for t in out] for out in ct2_greedy(ct2_dir, ck.task, chunk, budget)]
    same = sum(a == b for a, b in zip(ref, got, strict=True))
    out: dict[str, Any] = {
        "ct2": str(ct2_dir),
        "checkpoint": str(checkpoint),
        "task": ck.task,
        "inputs": len(inputs),
        "greedy_identical": same,
        "identical_fraction": round(same / max(len(inputs), 1), 4),
    }
    if ck.task == "translate":
        refs = [t for _, t in pairs]
        a, b = scores([tok.decode(x) for x in ref], refs), scores([tok.decode(x) for x in got], refs)
        out |= {"chrf_torch": a["chrf"], "chrf_ct2": b["chrf"], "chrf_delta": round(b["chrf"] - a["chrf"], 3)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m export.ctranslate2_convert",
        description="Greedy agreement of a converted CTranslate2 model with its PyTorch "
        "checkpoint on the test split; prints JSON.",
    )
    p.add_argument("ct2_dir", type=Path, help="kvserve export --format ctranslate2 --out DIR")
    p.add_argument("checkpoint", type=Path)
    p.add_argument("--sentences", type=int, default=200)
    p.add_argument("--data-dir", default="artifacts/data")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    print(json.dumps(split_agreement(a.ct2_dir, a.checkpoint, a.sentences, a.data_dir), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
