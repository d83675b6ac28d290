"""Importing Marian checkpoints, fast: refusals naming the field, the weight mapping, Marian's tokenizer.

The end-to-end parity (import, HTTP, `kvserve translate` against MarianMTModel.generate) is the slow
tests/test_marian_parity.py. Here: model/marian.py's config checks and weight mapping on synthetic state dicts
(no transformers needed), the `kvserve import marian` command refusing a config, the sinusoid layout Marian uses,
and model/spm_tokenizer.py against transformers' MarianTokenizer (when transformers is installed).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from kvserve.cli import main
from model.marian import MarianImportError, _layer_map, load_weights, map_state_dict, model_config
from model.transformer import EncoderDecoder, sinusoidal_table

MARIAN = {"model_type": "marian", "vocab_size": 300, "decoder_vocab_size": 300, "d_model": 32,
          "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
          "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "activation_function": "swish",
          "max_position_embeddings": 64, "scale_embedding": True, "pad_token_id": 299, "eos_token_id": 0,
          "decoder_start_token_id": 299, "share_encoder_decoder_embeddings": True, "tie_word_embeddings": True}


@pytest.mark.parametrize("change, field", [
    ({"normalize_before": True}, "normalize_before"),
    ({"add_final_layer_norm": True}, "add_final_layer_norm"),
    ({"activation_function": "quick_gelu"}, "activation_function='quick_gelu'"),
    ({"model_type": "mbart"}, "model_type='mbart'"),
    ({"decoder_vocab_size": 310}, "decoder_vocab_size=310"),
    ({"share_encoder_decoder_embeddings": False}, "share_encoder_decoder_embeddings"),
    ({"decoder_ffn_dim": 128}, "encoder_ffn_dim=64 and decoder_ffn_dim=128"),
    ({"static_position_embeddings": False}, "static_position_embeddings"),
])
def test_unsupported_configs_are_refused_naming_the_field(change, field):
    with pytest.raises(MarianImportError, match=field.replace("(", r"\(").replace(")", r"\)")):
        model_config({**MARIAN, **change})


def test_a_supported_config_becomes_the_options_marian_needs():
    cfg = model_config({**MARIAN, "activation_function": "gelu_new"}, max_len=32)
    assert (cfg.activation, cfg.positions, cfg.logits_bias, cfg.pre_norm) == ("gelu_tanh", "halves", True, False)
    assert (cfg.max_len, cfg.pad_id, cfg.vocab_size, cfg.d_ff) == (32, 299, 300, 64)
    with pytest.raises(MarianImportError, match="max_len=65"):
        model_config(MARIAN, max_len=65)


def test_the_import_command_refuses_a_pre_norm_config(tmp_path, capsys):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**MARIAN, "normalize_before": True}))
    assert main(["import", "marian", str(tmp_path / "hf"), "--out", str(tmp_path / "bundle")]) == 2
    assert "normalize_before=True" in capsys.readouterr().err
    assert not (tmp_path / "bundle").exists()


def test_halves_positions_are_marians_table():
    n, d = 20, 16  # MarianSinusoidalPositionalEmbedding.create_weight, written out
    enc = np.array([[p / np.power(10000, 2 * (j // 2) / d) for j in range(d)] for p in range(n)])
    want = np.concatenate([np.sin(enc[:, 0::2]), np.cos(enc[:, 1::2])], axis=1)
    np.testing.assert_allclose(sinusoidal_table(n, d, "halves").numpy(), want, atol=1e-6)
    assert not np.allclose(sinusoidal_table(n, d).numpy(), want, atol=1e-3)  # not the interleaved table


def hf_state_of(model: EncoderDecoder) -> dict[str, torch.Tensor]:
    """Our model's weights under MarianMTModel's names (the inverse of model/marian.py's mapping)."""
    cfg, ours = model.cfg, model.state_dict()
    names = {}
    for i in range(cfg.n_encoder_layers):
        names.update(_layer_map(f"encoder.layers.{i}", f"enc_layers.{i}", cross=False))
    for i in range(cfg.n_decoder_layers):
        names.update(_layer_map(f"decoder.layers.{i}", f"decoder.layers.{i}", cross=True))
    hf = {f"model.{h}.{p}": ours[f"{o}.{p}"].clone() for h, o in names.items() for p in ("weight", "bias")}
    hf["model.shared.weight"] = ours["embed.tok.weight"].clone()
    hf["final_logits_bias"] = ours["decoder.lm_head.bias"][None].clone()
    return hf


@pytest.fixture(scope="module")
def marian_like():
    torch.manual_seed(0)
    cfg = model_config(MARIAN)
    model = EncoderDecoder(cfg).eval()
    torch.nn.init.normal_(model.decoder.lm_head.bias)
    return model


def test_the_mapping_carries_every_weight(marian_like):
    cfg = marian_like.cfg
    fresh = EncoderDecoder(cfg).eval()
    fresh.load_state_dict(map_state_dict(hf_state_of(marian_like), cfg), strict=False)
    src, tgt = torch.randint(2, 299, (2, 7)), torch.randint(2, 299, (2, 5))
    with torch.no_grad():
        assert torch.equal(fresh(src, torch.tensor([7, 4]), tgt), marian_like(src, torch.tensor([7, 4]), tgt))


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.update({"model.encoder.layer_norm.weight": torch.ones(32)}), "encoder.layer_norm.weight"),
    (lambda s: s.pop("model.decoder.layers.1.encoder_attn.k_proj.bias"), "lacks the weight "
                                                                           "model.decoder.layers.1.encoder_attn"),
    (lambda s: s.update({"lm_head.weight": torch.zeros(300, 32)}), "lm_head.weight differs"),
    (lambda s: s.update({"model.encoder.embed_positions.weight": torch.zeros(64, 32)}), "embed_positions"),
])
def test_weights_the_mapping_does_not_know_are_refused(marian_like, edit, message):
    state = hf_state_of(marian_like)
    edit(state)
    with pytest.raises(MarianImportError, match=message):
        map_state_dict(state, marian_like.cfg)


def test_stored_sinusoid_tables_are_accepted(marian_like):
    state = hf_state_of(marian_like)
    state["model.decoder.embed_positions.weight"] = sinusoidal_table(64, 32, "halves")
    assert "embed.tok.weight" in map_state_dict(state, marian_like.cfg)


class NotATensor:
    def __reduce__(self):
        return (print, ("unpickled arbitrary code",))


def test_a_pickled_object_is_not_unpickled(tmp_path):
    torch.save({"model.shared.weight": torch.zeros(2), "x": NotATensor()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(MarianImportError, match="without unpickling arbitrary objects"):
        load_weights(tmp_path)
    torch.save({"model.shared.weight": torch.zeros(2)}, tmp_path / "pytorch_model.bin")
    assert set(load_weights(tmp_path)) == {"model.shared.weight"}


# ---------------------------------------------------------------------------------------------- the tokenizer

@pytest.fixture(scope="module")
def spm_folder(tmp_path_factory) -> Path:
    pytest.importorskip("sentencepiece")
    from marian_checkpoint import write_tokenizer

    folder = tmp_path_factory.mktemp("marian-tok")
    write_tokenizer(folder, (150, 180))
    return folder


def _ours(folder: Path):
    from model.spm_tokenizer import SentencePieceTokenizer

    vocab = json.loads((folder / "vocab.json").read_text())
    return SentencePieceTokenizer(folder, {"pad": vocab["<pad>"], "bos": vocab["<pad>"], "eos": 0, "unk": 1})


def test_source_ids_end_with_eos_and_unknown_pieces_are_unk(spm_folder):
    tok = _ours(spm_folder)
    ids = tok.encode("Where is the train station? ☃")
    assert ids[-1] == tok.eos_id and tok.unk_id in ids
    assert tok.encode("") == [tok.eos_id]
    assert tok.pieces_of(">>deu<< Good night")[0] == ">>deu<<"
    assert tok.decode([tok.pad_id, *tok.encode("the king")]) == "the king"  # specials dropped


def test_the_tokenizer_is_marians(spm_folder):
    """Encoding of 100 lines and decoding of random id sequences equal transformers' MarianTokenizer."""
    pytest.importorskip("transformers")
    from marian_checkpoint import corpus
    from transformers import MarianTokenizer

    ref, tok = MarianTokenizer.from_pretrained(str(spm_folder)), _ours(spm_folder)
    lines = corpus()[:100] + ["", ">>fra<< To be, or not", "  spaced   out  ", "Ünïcödé ☃ text"]
    assert [tok.encode(s) for s in lines] == [ref(s)["input_ids"] for s in lines]
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, tok.vocab_size, rng.integers(1, 12)).tolist() for _ in range(200)]
    assert [tok.decode(s) for s in seqs] == ref.batch_decode(seqs, skip_special_tokens=True)
    assert math.isclose(tok.vocab_size, ref.vocab_size)


def test_serving_a_sentencepiece_bundle_needs_neither_torch_nor_transformers(spm_folder):
    """The serving install (the `serve` extra) has sentencepiece, not transformers; the tokenizer loads without
    either, as the replica loads it (export.bundle.Bundle.load_tokenizer)."""
    import subprocess
    import sys
    import tomllib

    root = Path(__file__).resolve().parents[1]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(r.startswith("sentencepiece") for r in extras["serve"])
    assert not any(r.startswith(("transformers", "torch")) for r in extras["serve"])
    code = (f"import sys, serving.server.service, serving.engine.engine; from model.spm_tokenizer import "
            f"SentencePieceTokenizer as T; t = T({str(spm_folder)!r}, dict(pad=1, bos=1, eos=0, unk=1)); "
            f"assert t.encode('the king')[-1] == 0; "
            f"assert not {{'torch', 'transformers'}} & set(sys.modules), 'serving imported torch or transformers'")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]


def test_translate_cuts_a_source_longer_than_the_model_and_says_which_line():
    import io

    from kvserve.translate import source_ids

    class Tok:
        pad_id, eos_id = 9, 0

        def encode(self, text: str) -> list[int]:
            return [5] * len(text.split()) + [self.eos_id]

    warn = io.StringIO()
    assert source_ids(Tok(), "a b c", 8, 3, warn) == [5, 5, 5, 0] and warn.getvalue() == ""
    assert source_ids(Tok(), "a " * 10, 4, 7, warn) == [5, 5, 5, 0]  # cut, its </s> kept
    assert "line 7 has 11 tokens" in warn.getvalue()
