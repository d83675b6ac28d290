"""Marian (Hugging Face `MarianMTModel`, OPUS-MT) checkpoints -> kvserve's encoder-decoder.

Owns: reading a downloaded checkpoint folder (config.json, generation_config.json, model.safetensors or
pytorch_model.bin, tokenizer_config.json), the checks that refuse what this mapping was not written for (each
error names the field or weight and says what is supported), the ModelConfig a Marian config becomes, and the
weight mapping. Loads weights without unpickling arbitrary objects (safetensors, or `torch.load(weights_only=True)`).

A Marian model is the reference notes' Transformer with these options (model/config.py): sinusoidal positions
laid out in halves (`positions="halves"`), its activation (`swish` -> silu, `gelu`, `gelu_new` -> gelu_tanh,
`relu`), embeddings scaled by sqrt(d_model) only if `scale_embedding`, a bias on the logits
(`final_logits_bias` -> `logits_bias`), post-norm, one vocabulary shared by source and target, tied embeddings.
Its decoder starts from `decoder_start_token_id` (the pad token in OPUS-MT): the bundle's "bos".

Does not own: the tokenizer (model/spm_tokenizer.py), export (kvserve/importer.py drives export/).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from model.config import Arch, ModelConfig
from model.transformer import EncoderDecoder

ACTIVATIONS = {"swish": "silu", "silu": "silu", "gelu": "gelu", "gelu_new": "gelu_tanh",
               "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}
# Options of Marian-like configs (mBART, BART, FSMT) that change the network; this mapping was written for none.
UNSUPPORTED_TRUE = ("normalize_before", "add_final_layer_norm", "normalize_embedding", "layernorm_embedding",
                    "add_bias_logits")
TOKENIZER_FILES = ("source.spm", "target.spm", "vocab.json")


class MarianImportError(ValueError):
    """The checkpoint cannot be imported as it is; the message names the field or file and what is supported."""


@dataclass(frozen=True)
class MarianCheckpoint:
    """What the import needs of a checkpoint folder, checked."""
    folder: Path
    config: ModelConfig
    special_ids: dict[str, int]  # pad, bos (= the decoder start token), eos, unk
    banned_ids: tuple[int, ...]  # single-token bad_words_ids: never generated (OPUS-MT: the pad token)
    hf_config: dict[str, Any]


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise MarianImportError(f"missing file {path}: a Marian checkpoint folder holds config.json, "
                                f"model.safetensors (or pytorch_model.bin), {', '.join(TOKENIZER_FILES)} and "
                                f"tokenizer_config.json")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MarianImportError(f"{path} is not valid JSON: {e}") from e


def _field(cfg: dict[str, Any], name: str, default: Any = None) -> Any:
    value = cfg.get(name, default)
    if value is None:
        raise MarianImportError(f"config.json lacks {name!r}, which a Marian model needs")
    return value


def _check_structure(hf: dict[str, Any]) -> None:
    kind = hf.get("model_type")
    if kind != "marian":
        raise MarianImportError(f"config.json model_type={kind!r}: only 'marian' checkpoints (MarianMTModel, "
                                f"OPUS-MT) can be imported")
    for name in UNSUPPORTED_TRUE:
        if hf.get(name):
            raise MarianImportError(f"config.json {name}={hf[name]!r}: this importer maps post-norm Marian models "
                                    f"only (Add & Norm after each sublayer, no extra layer norms); {name} must be "
                                    f"false or absent")
    if hf.get("static_position_embeddings") is False:
        raise MarianImportError("config.json static_position_embeddings=false: learned positions are not "
                                "supported; Marian's are sinusoidal (true or absent)")
    if not hf.get("share_encoder_decoder_embeddings", True):
        raise MarianImportError("config.json share_encoder_decoder_embeddings=false: separate source and target "
                                "vocabularies are not supported; kvserve's model shares one vocabulary")
    vocab, dec_vocab = _field(hf, "vocab_size"), hf.get("decoder_vocab_size") or hf.get("vocab_size")
    if dec_vocab != vocab:
        raise MarianImportError(f"config.json decoder_vocab_size={dec_vocab} differs from vocab_size={vocab}: "
                                f"separate vocabularies are not supported")
    for enc, dec in (("encoder_attention_heads", "decoder_attention_heads"), ("encoder_ffn_dim", "decoder_ffn_dim")):
        if _field(hf, enc) != _field(hf, dec):
            raise MarianImportError(f"config.json {enc}={hf[enc]} and {dec}={hf[dec]} differ: kvserve's model has "
                                    f"one value for both")


def model_config(hf: dict[str, Any], max_len: int | None = None) -> ModelConfig:
    """The ModelConfig of a Marian config.json (checked; raises MarianImportError naming the field)."""
    _check_structure(hf)
    act = hf.get("activation_function", "gelu")
    if act not in ACTIVATIONS:
        raise MarianImportError(f"config.json activation_function={act!r} is not supported; supported: "
                                f"{sorted(ACTIVATIONS)}")
    positions = _field(hf, "max_position_embeddings")
    max_len = positions if max_len is None else max_len
    if not 2 <= max_len <= positions:
        raise MarianImportError(f"max_len={max_len} must be in [2, max_position_embeddings={positions}]")
    d_model, heads = _field(hf, "d_model"), _field(hf, "encoder_attention_heads")
    if d_model % heads or d_model % 2:
        raise MarianImportError(f"config.json d_model={d_model} must be even and divisible by "
                                f"encoder_attention_heads={heads}")
    return ModelConfig(
        arch=Arch.ENCODER_DECODER, vocab_size=_field(hf, "vocab_size"), d_model=d_model, n_heads=heads,
        n_encoder_layers=_field(hf, "encoder_layers"), n_decoder_layers=_field(hf, "decoder_layers"),
        d_ff=_field(hf, "encoder_ffn_dim"), dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        max_len=max_len, pre_norm=False, tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        pad_id=_field(hf, "pad_token_id"), activation=ACTIVATIONS[act], positions="halves",
        scale_embedding=bool(hf.get("scale_embedding", False)), logits_bias=True)


def _special_ids(hf: dict[str, Any], gen: dict[str, Any], vocab: dict[str, int], folder: Path) -> dict[str, int]:
    merged = {**hf, **{k: v for k, v in gen.items() if v is not None}}
    ids = {"pad": _field(merged, "pad_token_id"), "bos": _field(merged, "decoder_start_token_id"),
           "eos": _field(merged, "eos_token_id"), "unk": vocab.get("<unk>")}
    if isinstance(ids["eos"], list):
        if len(ids["eos"]) != 1:
            raise MarianImportError(f"eos_token_id={ids['eos']}: one end-of-sequence token is supported")
        ids["eos"] = ids["eos"][0]
    if ids["unk"] is None:
        raise MarianImportError(f"{folder / 'vocab.json'} has no '<unk>' token")
    for name, value in ids.items():
        if not 0 <= value < hf["vocab_size"]:
            raise MarianImportError(f"{name} token id {value} is outside the vocabulary [0, {hf['vocab_size']})")
    return ids


def _banned(hf: dict[str, Any], gen: dict[str, Any]) -> tuple[int, ...]:
    words = gen.get("bad_words_ids") or hf.get("bad_words_ids") or []
    if any(len(w) != 1 for w in words):
        raise MarianImportError(f"bad_words_ids={words}: only single-token entries are supported (OPUS-MT bans "
                                f"the pad token: [[pad_token_id]])")
    return tuple(sorted({int(w[0]) for w in words}))


def read_checkpoint(folder: str | Path, max_len: int | None = None) -> MarianCheckpoint:
    """Read and check a Marian checkpoint folder (everything but the weights)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise MarianImportError(f"{folder} is not a directory; point at a downloaded Marian checkpoint folder")
    hf = _read_json(folder / "config.json")
    cfg = model_config(hf, max_len)
    gen = _read_json(folder / "generation_config.json") if (folder / "generation_config.json").is_file() else {}
    tok_cfg = _read_json(folder / "tokenizer_config.json")
    if tok_cfg.get("separate_vocabs"):
        raise MarianImportError("tokenizer_config.json separate_vocabs=true: separate source and target "
                                "vocabularies are not supported")
    for name in TOKENIZER_FILES:
        if not (folder / name).is_file():
            raise MarianImportError(f"missing file {folder / name}: the tokenizer needs {', '.join(TOKENIZER_FILES)}")
    vocab = _read_json(folder / "vocab.json")
    if len(vocab) > cfg.vocab_size:
        raise MarianImportError(f"vocab.json has {len(vocab)} entries, more than vocab_size={cfg.vocab_size}")
    return MarianCheckpoint(folder, cfg, _special_ids(hf, gen, vocab, folder), _banned(hf, gen), hf)


def load_weights(folder: Path) -> dict[str, Tensor]:
    """The checkpoint's tensors: model.safetensors, else pytorch_model.bin loaded with weights_only=True."""
    if (folder / "model.safetensors").is_file():
        from safetensors.torch import load_file

        return load_file(str(folder / "model.safetensors"))
    if (folder / "pytorch_model.bin").is_file():
        try:
            state = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
        except Exception as e:  # an unpickling refusal is an UnpicklingError; any failure means: cannot read
            raise MarianImportError(f"{folder / 'pytorch_model.bin'} cannot be read without unpickling arbitrary "
                                    f"objects ({e}); convert it to model.safetensors") from e
        return dict(state)
    raise MarianImportError(f"{folder} has neither model.safetensors nor pytorch_model.bin")


def _layer_map(prefix: str, ours: str, cross: bool) -> dict[str, str]:
    """HF names (without .weight/.bias) -> ours, for one encoder or decoder layer."""
    m = {f"{prefix}.self_attn.{p}_proj": f"{ours}.self_attn.{p}_proj" for p in ("q", "k", "v", "out")}
    m.update({f"{prefix}.fc1": f"{ours}.ffn.fc1", f"{prefix}.fc2": f"{ours}.ffn.fc2"})
    if not cross:
        m.update({f"{prefix}.self_attn_layer_norm": f"{ours}.res1.norm", f"{prefix}.final_layer_norm": f"{ours}.res2.norm"})
        return m
    m.update({f"{prefix}.encoder_attn.{p}_proj": f"{ours}.cross_attn.{p}_proj" for p in ("q", "k", "v", "out")})
    m.update({f"{prefix}.self_attn_layer_norm": f"{ours}.res_self.norm",
              f"{prefix}.encoder_attn_layer_norm": f"{ours}.res_cross.norm",
              f"{prefix}.final_layer_norm": f"{ours}.res_ffn.norm"})
    return m


def map_state_dict(hf_state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """HF MarianMTModel tensors -> EncoderDecoder's state dict. Refuses tensors it does not know (a variant this
    mapping was not written for, e.g. extra layer norms) and missing ones, naming them."""
    state = {k.removeprefix("model."): v for k, v in hf_state.items()}
    names: dict[str, str] = {}
    for i in range(cfg.n_encoder_layers):
        names.update(_layer_map(f"encoder.layers.{i}", f"enc_layers.{i}", cross=False))
    for i in range(cfg.n_decoder_layers):
        names.update(_layer_map(f"decoder.layers.{i}", f"decoder.layers.{i}", cross=True))
    out: dict[str, Tensor] = {}
    for hf_name, ours in names.items():
        for part in ("weight", "bias"):
            out[f"{ours}.{part}"] = _take(state, f"{hf_name}.{part}")
    shared = state.pop("shared.weight", None)
    for alias in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):
        t = state.pop(alias, None)
        if t is not None and shared is not None and not torch.equal(t, shared):
            raise MarianImportError(f"weight {alias} differs from shared.weight: untied embeddings are not supported")
        shared = t if shared is None else shared
    if shared is None:
        raise MarianImportError("the checkpoint has no token embeddings (model.shared.weight)")
    out["embed.tok.weight"] = shared
    out["decoder.lm_head.bias"] = _take(state, "final_logits_bias").reshape(-1)
    head = state.pop("lm_head.weight", None)
    if cfg.tie_embeddings:
        if head is not None and not torch.equal(head, shared):
            raise MarianImportError("lm_head.weight differs from the embeddings but tie_word_embeddings is true")
    else:
        if head is None:
            raise MarianImportError("tie_word_embeddings=false but the checkpoint has no lm_head.weight")
        out["decoder.lm_head.weight"] = head
    _check_positions(state, cfg)
    if state:
        raise MarianImportError(f"the checkpoint holds weights this importer does not map: {sorted(state)[:6]}"
                                f"{' ...' if len(state) > 6 else ''}; it maps post-norm Marian models only")
    return {k: v.float() for k, v in out.items()}


def _take(state: dict[str, Tensor], name: str) -> Tensor:
    if name not in state:
        raise MarianImportError(f"the checkpoint lacks the weight model.{name}")
    return state.pop(name)


def _check_positions(state: dict[str, Tensor], cfg: ModelConfig) -> None:
    """Older checkpoints store the sinusoid tables; they must be the ones the model computes."""
    from model.transformer import sinusoidal_table

    for name in ("encoder.embed_positions.weight", "decoder.embed_positions.weight"):
        table = state.pop(name, None)
        if table is None:
            continue
        want = sinusoidal_table(table.shape[0], cfg.d_model, "halves")
        if table.shape != want.shape or not torch.allclose(table.float(), want, atol=1e-5):
            raise MarianImportError(f"weight model.{name} is not Marian's sinusoidal table (learned positions?); "
                                    f"not supported")


def import_model(ckpt: MarianCheckpoint) -> EncoderDecoder:
    """The checkpoint's weights in kvserve's EncoderDecoder (eval mode)."""
    model = EncoderDecoder(ckpt.config)
    state = map_state_dict(load_weights(ckpt.folder), ckpt.config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    params = model.state_dict(keep_vars=True)
    loaded = {id(params[k]) for k in state if k in params}
    untied = [k for k in missing if id(params[k]) not in loaded]  # a tied alias (decoder.embed, lm_head) is loaded
    if unexpected or untied:
        raise MarianImportError(f"weight mapping incomplete: missing {untied}, unexpected {unexpected}")
    return model.eval()
