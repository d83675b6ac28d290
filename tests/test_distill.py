"""Sequence-level distillation data (`kvserve distill`, kvserve/distill.py): which teacher outputs join the train
split, what stays untouched, and a real run of a tiny teacher bundle's beam search through the serving engine."""
import hashlib
import json
from pathlib import Path

import pytest

from export.contract import FORMAT_VERSION
from kvserve import distill
from model.data import load_pairs

TRAIN = [("The street is long.", "Die Strasse ist lang."), ("I see the street.", "Ich sehe die Strasse."),
         ("The street is long.", "Die Straße ist lang."), ("Good morning.", "Guten Morgen.")]
VALID = [("Where is the station?", "Wo ist der Bahnhof?")]
TEST = [("The cat sleeps on the sofa.", "Die Katze schläft auf dem Sofa.")]


def write_data(root: Path, train=TRAIN, valid=VALID, test=TEST) -> Path:
    d = root / "translate"
    d.mkdir(parents=True)
    for name, pairs in (("train", train), ("valid", valid), ("test", test)):
        (d / f"{name}.tsv").write_text("".join(f"{en}\t{de}\n" for en, de in pairs), encoding="utf-8")
    (d / "meta.json").write_text(json.dumps({"task": "translate", "sources": {"dict": len(train) + 2},
                                             "counts": {"train": len(train), "valid": 1, "test": 1}}))
    return root


def test_each_train_source_once_in_file_order(tmp_path):
    data = write_data(tmp_path / "data")
    assert distill.train_sources(data) == ["The street is long.", "I see the street.", "Good morning."]


@pytest.mark.parametrize(("output", "kept"), [("Guten Morgen.", True), ("", False), ("   ", False),
                                              ("Guten\tMorgen.", False), ("Guten Morgen " * 5, True),
                                              ("Guten Morgen " * 6, False)])
def test_empty_tabbed_and_looping_outputs_are_not_kept(output, kept):
    assert distill.keep("Good morning.", output) is kept  # 2 words: up to 3 * 2 + 5 = 11 words


@pytest.mark.parametrize("real_pairs", [False, True])
def test_distilled_pairs_make_the_train_split_and_held_out_splits_stay(tmp_path, real_pairs):
    data = write_data(tmp_path / "data")
    sources = distill.train_sources(data)
    teacher = {"teacher_weights_sha256": "ab" * 32, "decoding": "beam", "beam_size": 4}
    meta = distill.write_distilled(data, sources, ["Die Strasse ist lang. ", "", "Guten Morgen!"], tmp_path / "kd",
                                   teacher, real_pairs)
    distilled = [("The street is long.", "Die Strasse ist lang."), ("Good morning.", "Guten Morgen!")]
    assert load_pairs(tmp_path / "kd", "train") == (TRAIN if real_pairs else []) + distilled
    for split in ("valid", "test"):  # the held-out splits are the same bytes
        assert (tmp_path / "kd" / "translate" / f"{split}.tsv").read_bytes() == \
            (data / "translate" / f"{split}.tsv").read_bytes()
    named = {"dict": len(TRAIN) + 2, distill.SOURCE_NAME: 2} if real_pairs else {distill.SOURCE_NAME: 2}
    assert meta["sources"] == named and meta["counts"]["train"] == (len(TRAIN) if real_pairs else 0) + 2
    assert meta["distillation"] == {"sentences": 3, "pairs_kept": 2, "real_pairs": real_pairs, **teacher,
                                    "data": {"sources": {"dict": len(TRAIN) + 2}, "train_pairs": len(TRAIN)}}
    assert json.loads((tmp_path / "kd" / "translate" / "meta.json").read_text()) == meta
    with pytest.raises(ValueError, match="3 sources but 1 teacher outputs"):
        distill.write_distilled(data, sources, ["x"], tmp_path / "kd2", teacher)


def test_a_teacher_bundles_beam_search_through_the_engine_makes_the_pairs(tmp_path):
    """The tiny translator's bundle as the teacher: the train targets are its beam-4 translations as `kvserve
    translate --beam-size 4` gives them, and a second run with the same teacher is skipped."""
    from helpers_tiny import PAIRS, tiny_bundle

    from kvserve.translate import translate_texts
    from serving.engine.types import SamplingParams

    data = write_data(tmp_path / "data", train=PAIRS[:6], valid=PAIRS[6:7], test=PAIRS[7:8])
    teacher = tiny_bundle(tmp_path / "tiny", "translate")
    meta = distill.distill(teacher, data, tmp_path / "kd", beam_size=4, slots=16)
    sources = [en for en, _ in PAIRS[:6]]
    want = translate_texts(str(teacher), sources, SamplingParams(max_new_tokens=128, beam_size=4), slots=16)
    pairs = [(s, w.strip()) for s, w in zip(sources, want, strict=True) if w.strip()]
    assert load_pairs(tmp_path / "kd", "train") == pairs
    manifest = json.loads((teacher / "manifest.json").read_text())
    assert meta["distillation"]["teacher_weights_sha256"] == manifest["source"]["weights_sha256"]
    assert meta["distillation"]["beam_size"] == 4 and meta["distillation"]["sentences"] == 6
    train_sha = hashlib.sha256((data / "translate" / "train.tsv").read_bytes()).hexdigest()
    assert meta["distillation"]["train_sha256"] == train_sha
    shared = distill.distill(teacher, data, tmp_path / "kd2", beam_size=4, slots=16, workers=2)
    assert load_pairs(tmp_path / "kd2", "train") == load_pairs(tmp_path / "kd", "train")  # two engines, one order
    assert shared["distillation"] == meta["distillation"]
    (tmp_path / "kd" / "translate" / "train.tsv").write_text("untouched")
    assert distill.distill(teacher, data, tmp_path / "kd", beam_size=4) == meta  # done: not translated again
    assert (tmp_path / "kd" / "translate" / "train.tsv").read_text() == "untouched"


def test_kvserve_up_train_distills_the_recipes_translator_stage_by_stage_and_skips_what_is_done(tmp_path, monkeypatch):
    """After the recipes: the translator published as the teacher, exported, its beam search over the train sources,
    the fine-tune on that data with DISTILLATION's settings; the result is what gets published as `translate`."""
    from kvserve import up
    from model.train_config import DISTILLATION

    ran, trained = [], []

    def run(cmd, what, check=True):
        ran.append(cmd[3])
        if cmd[3] == "publish":
            out = Path(cmd[cmd.index("--out") + 1])
            out.mkdir(parents=True, exist_ok=True)
            (out / "manifest.json").write_text(json.dumps({"weights": {"sha256": "teacher"}}))
        if cmd[3] == "export":
            out = Path(cmd[cmd.index("--out") + 1])
            out.mkdir(parents=True, exist_ok=True)
            doc = {"format_version": FORMAT_VERSION, "source": {"weights_sha256": "teacher"}}
            (out / "manifest.json").write_text(json.dumps(doc))
        return 0

    def train_runs(runs, budget):
        trained.append((runs, budget))
        out = Path(runs[up.DISTILLED][runs[up.DISTILLED].index("--out") + 1])
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.json").write_text("{}")
    monkeypatch.setattr(up, "_run", run)
    monkeypatch.setattr(up, "train_runs", train_runs)
    (tmp_path / "ckpt" / "translate").mkdir(parents=True)
    (tmp_path / "ckpt" / "translate" / "metrics.json").write_text("{}")
    got = up.distill_translator(tmp_path, time_budget_s=60.0)
    assert got == tmp_path / "ckpt" / up.DISTILLED and ran == ["publish", "export", "distill"]
    [(runs, budget)] = trained
    args = runs[up.DISTILLED]
    flag = {a: args[args.index(a) + 1] for a in ("--init", "--data-dir", "--steps", "--lr", "--warmup", "--threads")}
    assert flag == {"--init": str(tmp_path / "published" / up.TEACHER), "--data-dir": str(tmp_path / "data-kd"),
                    "--steps": str(DISTILLATION["steps"]), "--lr": str(DISTILLATION["lr"]),
                    "--warmup": str(DISTILLATION["warmup"]), "--threads": "1"} and budget == 60.0
    ran.clear()
    assert up.distill_translator(tmp_path) == got and ran == []  # done: nothing runs again
    (got / "metrics.json").unlink()  # the fine-tune interrupted: teacher and bundle are current, distill skips itself
    up.distill_translator(tmp_path)
    assert ran == ["distill"]
