"""The subword tokenizer round-trips what users send and keeps its special ids."""
import pytest

from model.tokenizer import IncrementalDecoder, Tokenizer

TEXTS = ["Der schnelle braune Fuchs springt über den faulen Hund.", "Grüße aus Köln!",
         "The quick brown fox jumps over the lazy dog.", "Wie geht's? Mir geht's gut."] * 20


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    t = Tokenizer.train(TEXTS, 400)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    t.save(path)
    return Tokenizer.load(path)


@pytest.mark.parametrize("text", ["Äpfel, Öl und Übermut: süß!", "ẞ ß ä ö ü", "emoji 😀🚀 ok", "", " ",
                                  "tab\tand\nnewline", "¿Qué? «quotes» — dash…", "日本語"])
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_special_ids(tok):
    assert tok.special_ids == {"pad": 0, "bos": 1, "eos": 2, "unk": 3}
    assert tok.decode([tok.bos_id] + tok.encode("Hund") + [tok.eos_id, tok.pad_id]) == "Hund"


def test_incremental_decoder_never_splits_a_character(tok):
    text = "süß 😀 Köln"
    dec = IncrementalDecoder(tok)
    pieces = [dec.push(i) for i in tok.encode(text)]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.json"):
        Tokenizer.load(tmp_path / "nope.json")
