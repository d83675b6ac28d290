"""Back-translation: the German sentences taken from fortunes-de, the reversed and the extended training data
(model/back_translation.py), and the stages of `kvserve back-translate` with a real export and the serving engine
(kvserve/back_translate.py)."""
import json
import shutil
from pathlib import Path

import pytest

from model import back_translation as bt

TRAIN = [("The street is long.", "Die Strasse ist lang."), ("I see the street.", "Ich sehe die Strasse."),
         ("The street is wide.", "Die Strasse ist breit."), ("Good morning.", "Guten Morgen.")]
VALID = [("Where is the station?", "Wo ist der Bahnhof?")]
TEST = [("The cat sleeps on the sofa.", "Die Katze schläft auf dem Sofa.")]


def write_data(root: Path, train=TRAIN, valid=VALID, test=TEST) -> Path:
    d = root / "translate"
    d.mkdir(parents=True)
    for name, pairs in (("train", train), ("valid", valid), ("test", test)):
        (d / f"{name}.tsv").write_text("".join(f"{en}\t{de}\n" for en, de in pairs), encoding="utf-8")
    (d / "meta.json").write_text(json.dumps({"task": "translate", "sources": {"dict": 6},
                                             "counts": {"train": len(train), "valid": 1, "test": 1}}))
    return root


def write_fortunes(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "sprueche").write_text(
        "Wer rastet, der rostet. Ohne Fleiß kein Preis.\n%\n"
        "Die Straße ist nass,\nweil es regnet.\n        -- Wetterbericht\n%\n"
        "Wer rastet, der rostet.\n%\n"  # said before: once only
        "Die Katze schläft auf dem Sofa.\n%\n"  # a test sentence
        "kurz.\n%\n"  # no capital, one word
        "Siehe <http://example.org> für mehr.\n%\n"  # markup
        + "Dies ist ein sehr langer Satz " + "und noch einer " * 12 + "am Ende.\n", encoding="utf-8")
    (root / "vornamen").write_text("Anna Berta Clara Dora.\n", encoding="utf-8")  # a list of names: skipped
    (root / ".complete").write_text("")
    return root


def test_german_sentences_are_whole_prose_sentences_none_resembling_a_held_out_one(tmp_path):
    data = write_data(tmp_path / "data")
    got = bt.german_sentences(data, write_fortunes(tmp_path / "fortunes"))
    # "Straße" takes the training pairs' "Strasse"; "Fleiß" stays (train never spells it with ss)
    assert got == ["Wer rastet, der rostet.", "Ohne Fleiß kein Preis.", "Die Strasse ist nass, weil es regnet."]


def test_reversed_data_swaps_the_sides_of_every_split(tmp_path):
    data = write_data(tmp_path / "data")
    bt.write_reversed(data, tmp_path / "rev")
    for split, pairs in (("train", TRAIN), ("valid", VALID), ("test", TEST)):
        assert bt.load_pairs(tmp_path / "rev", split) == [(de, en) for en, de in pairs]
    assert json.loads((tmp_path / "rev" / "translate" / "meta.json").read_text())["direction"] == "de-en"


def test_synthetic_pairs_extend_train_only_and_broken_ones_are_dropped(tmp_path):
    data = write_data(tmp_path / "data")
    german = ["Guten Abend.", "Es regnet.", "Der Hund bellt.", "Wo ist der Zug?", "Ja."]
    english = ["Good evening.", "", "The dog barks " * 5, "Where is the station?", "Yes.\tYes."]
    meta = bt.write_back_translated(data, german, english, tmp_path / "bt")
    assert bt.load_pairs(tmp_path / "bt", "train") == TRAIN + [("Good evening.", "Guten Abend.")]
    for split in ("valid", "test"):  # held-out splits unchanged: the same test split as the parallel data
        assert bt.load_pairs(tmp_path / "bt", split) == bt.load_pairs(data, split)
    assert meta["sources"][bt.SOURCE_NAME] == 1 and meta["counts"]["train"] == len(TRAIN) + 1
    with pytest.raises(ValueError, match="2 German sentences but 1 translations"):
        bt.write_back_translated(data, german[:2], english[:1], tmp_path / "bt2")


@pytest.mark.slow
def test_fortunes_are_fetched_from_debian(tmp_path):
    d = bt.fetch_fortunes(tmp_path)
    assert len([p for p in d.iterdir() if p.is_file() and not p.name.startswith(".")]) > 40


def test_the_stages_export_the_reverse_model_and_translate_through_the_engine(tmp_path, monkeypatch):
    """After the reverse model's training: `kvserve export` of it (the tiny translator's bundle stands in for the
    export's output), the German sentences through the serving engine, the data written. The synthetic English
    is the bundle's own greedy translation (export/evaluate's batch decoder, another code path than the engine)."""
    from helpers_tiny import PAIRS, checkpoint_of, tiny_bundle

    from export.bundle import load_bundle
    from export.evaluate import translate_texts
    from kvserve import back_translate, stages
    from kvserve.runtime import ort_runtime

    art = tmp_path / "art"
    write_data(art / "data", train=PAIRS[:6], valid=PAIRS[6:7], test=PAIRS[7:8])
    tiny = tiny_bundle(tmp_path / "tiny", "translate")
    reverse = art / "ckpt" / back_translate.REVERSE
    shutil.copytree(checkpoint_of(tiny), reverse)
    (reverse / "metrics.json").write_text(json.dumps({"steps": 80, "final": {"valid_chrf": 1.0}}))
    exports = []

    def export(cmd, what, check=True):
        exports.append(cmd[3:])
        shutil.copytree(tiny, cmd[cmd.index("--out") + 1])
        return 0
    monkeypatch.setattr(stages, "run_stage", export)
    german = ["Ich sehe den Hund.", "Das Haus ist gross.", "Der Baum ist hoch."]
    monkeypatch.setattr(back_translate, "german_sentences", lambda data, fortunes: german)
    monkeypatch.setattr(back_translate, "fetch_fortunes", lambda cache: cache)
    meta = back_translate.back_translate(art)
    bundle_dir = art / "bundles" / back_translate.REVERSE
    assert exports == [["export", str(reverse), "--out", str(bundle_dir), "--force", "--data-dir",
                        str(art / "data-reverse")]]
    assert meta["sources"][bt.SOURCE_NAME] >= 1 and meta["back_translation"]["reverse_model"]["steps"] == 80
    bundle = load_bundle(bundle_dir)
    want = [t.strip() for t in translate_texts(ort_runtime()(bundle, 4), bundle.load_tokenizer(), german)]
    added = bt.load_pairs(back_translate.data_dir(art), "train")[6:]
    assert added and all(pair in list(zip(want, german, strict=True)) for pair in added)
    assert back_translate.is_done(art) and back_translate.back_translate(art) == meta  # done: nothing runs again
