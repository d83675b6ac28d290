"""Test helper: a small Hugging Face Marian checkpoint built locally, as `save_pretrained` writes one.

transformers' `MarianConfig` + `MarianMTModel` with random weights (seeded), two SentencePiece models (source
and target) trained on a few hundred lines of Shakespeare (tests/data/shakespeare_lines.txt), and a shared
vocab.json over the pieces of both, laid out as OPUS-MT's are: `</s>` 0, `<unk>` 1, the pieces, `<pad>` last
(the decoder start token). Nothing is downloaded. Needs `transformers` and `sentencepiece` (the `import`
extra).

The weights are random, drawn wider than transformers' init (init_std 0.4, not 0.02) so that outputs depend on
the source, and `final_logits_bias` is random with a push towards `</s>` so that outputs end at varied lengths
(an untouched random model repeats one token to the length limit).
"""
from __future__ import annotations

import io
import json
from pathlib import Path

LINES_FILE = Path(__file__).parent / "data" / "shakespeare_lines.txt"


def corpus() -> list[str]:
    return [line for line in LINES_FILE.read_text(encoding="utf-8").splitlines() if line.strip()]


def _train_spm(lines: list[str], vocab_size: int) -> bytes:
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=buf, vocab_size=vocab_size,
                                   model_type="unigram", character_coverage=1.0, byte_fallback=False,
                                   minloglevel=2, num_threads=1)
    return buf.getvalue()


def _pieces(model: bytes) -> list[str]:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=model)
    return [sp.id_to_piece(i) for i in range(sp.get_piece_size())
            if not (sp.is_control(i) or sp.is_unknown(i))]


def write_tokenizer(out: Path, spm_vocab: tuple[int, int] = (200, 220), max_positions: int = 128) -> int:
    """source.spm, target.spm, vocab.json and tokenizer_config.json in `out`; returns the pad id (the last)."""
    out.mkdir(parents=True, exist_ok=True)
    lines = corpus()
    src_model = _train_spm(lines[::2], spm_vocab[0])
    tgt_model = _train_spm(lines[1::2], spm_vocab[1])
    (out / "source.spm").write_bytes(src_model)
    (out / "target.spm").write_bytes(tgt_model)
    pieces = list(dict.fromkeys([*_pieces(src_model), *_pieces(tgt_model)]))
    vocab = {"</s>": 0, "<unk>": 1, **{p: i + 2 for i, p in enumerate(pieces)}}
    pad = len(vocab)
    vocab["<pad>"] = pad
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"source_lang": "en", "target_lang": "de", "separate_vocabs": False, "model_max_length": max_positions,
         "unk_token": "<unk>", "eos_token": "</s>", "pad_token": "<pad>", "tokenizer_class": "MarianTokenizer"}))
    return pad


def build_marian_checkpoint(out: Path, *, seed: int = 0, d_model: int = 32, layers: int = 2, heads: int = 4,
                            ffn: int = 64, activation: str = "swish", spm_vocab: tuple[int, int] = (200, 220),
                            scale_embedding: bool = True, max_positions: int = 128,
                            init_std: float = 0.4, bias_std: float = 0.5, eos_push: float = 7.0,
                            **config_overrides) -> Path:
    """Write a Marian checkpoint folder at `out` (config.json, model.safetensors, generation_config.json,
    source.spm, target.spm, vocab.json, tokenizer_config.json); returns `out`."""
    import torch
    from transformers import MarianConfig, MarianMTModel

    pad = write_tokenizer(out, spm_vocab, max_positions)
    config = MarianConfig(
        vocab_size=pad + 1, decoder_vocab_size=pad + 1, d_model=d_model, encoder_layers=layers,
        decoder_layers=layers, encoder_attention_heads=heads, decoder_attention_heads=heads,
        encoder_ffn_dim=ffn, decoder_ffn_dim=ffn, activation_function=activation,
        max_position_embeddings=max_positions, scale_embedding=scale_embedding, pad_token_id=pad,
        decoder_start_token_id=pad, eos_token_id=0, forced_eos_token_id=0,
        init_std=init_std, dropout=0.1, architectures=["MarianMTModel"], **config_overrides)
    torch.manual_seed(seed)
    model = MarianMTModel(config)
    g = torch.Generator().manual_seed(seed + 1)
    bias = torch.randn(1, pad + 1, generator=g) * bias_std
    bias[0, 0] += eos_push
    model.final_logits_bias.copy_(bias)
    model.eval().save_pretrained(out, safe_serialization=True)
    for name in ("config.json", "generation_config.json"):  # as OPUS-MT's files say it (transformers 5 drops it)
        doc = json.loads((out / name).read_text())
        (out / name).write_text(json.dumps({**doc, "bad_words_ids": [[pad]]}, indent=2))
    return out


def load_reference(folder: Path):
    """(MarianMTModel, MarianTokenizer) of a checkpoint folder, through transformers itself."""
    from transformers import MarianMTModel, MarianTokenizer

    return MarianMTModel.from_pretrained(folder).eval(), MarianTokenizer.from_pretrained(folder)
