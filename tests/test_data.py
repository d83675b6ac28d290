"""Data preparation: parsing each source (model/data_sources.py), cleaning, deterministic splits, users' own
data (model/data.py)."""
import gzip
import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from model import data, data_sources

B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def b64(n: int) -> str:
    s = ""
    while True:
        s = B64[n % 64] + s
        n //= 64
        if not n:
            return s


def write_dictd(tmp_path, entries):
    body, index, off = b"", [], 0
    for e in entries:
        raw = e.encode("utf-8")
        index.append(f"{e.split(chr(10))[0].lower()}\t{b64(off)}\t{b64(len(raw))}")
        body, off = body + raw, off + len(raw)
    dz = tmp_path / "freedict-deu-eng.dict.dz"
    dz.write_bytes(gzip.compress(body))
    (tmp_path / "freedict-deu-eng.index").write_text("\n".join(index) + "\n", encoding="utf-8")
    return dz


def write_mo(path, messages: dict[str, str], charset: str = "UTF-8"):
    """A gettext .mo file (the format msgfmt writes, little-endian, no hash table)."""
    msgs = {"": f"Content-Type: text/plain; charset={charset}\n", **messages}
    keys = sorted(msgs, key=lambda k: k.encode(charset))
    ids, strs = [k.encode(charset) for k in keys], [msgs[k].encode(charset) for k in keys]
    n = len(keys)
    at = 28 + 16 * n
    tables = [[], []]
    blob = b""
    for which, items in enumerate((ids, strs)):
        for b in items:
            tables[which].append((len(b), at + len(blob)))
            blob += b + b"\0"
    head = struct.pack("<7I", 0x950412DE, 0, n, 28, 28 + 8 * n, 0, 0)
    body = b"".join(struct.pack("<2I", *e) for t in tables for e in t)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(head + body + blob)
    return path


def test_dictionary_sentences_are_extracted_and_words_skipped(tmp_path):
    dz = write_dictd(tmp_path, [
        "Das steht noch dahin. /das ʃtˈeːt/\nThat remains to be seen., That's not decided yet.\n see: {x}\n\n",
        "Fleischeslust /flˈaɪʃ/ <fem, n, sg>\nlust of the flesh\n\n",
        "Gib Pfote! /ɡˈiːp/\nShake hands!\n\n",
        "Kleider machen Leute. /klˈaɪdɜ/\n [Sprw.] Clothes make the man., fine feathers make fine birds [prov.]\n\n",
        "Schönen Tag noch! /ʃˈøːnən/\nHave a nice day!HAND, /hˈant/\n\n",
    ])
    pairs = list(data_sources.dictionary_sentence_pairs(dz))
    assert pairs == [
        ("That remains to be seen.", "Das steht noch dahin."),
        ("That's not decided yet.", "Das steht noch dahin."),
        ("Shake hands!", "Gib Pfote!"),
        ("Clothes make the man.", "Kleider machen Leute."),  # usage labels go, the case and stop are mended
        ("Fine feathers make fine birds.", "Kleider machen Leute."),
        ("Have a nice day!", "Schönen Tag noch!"),  # an acronym with its pronunciation goes
    ]


def test_ding_sentences_are_extracted_with_alternatives_crossed(tmp_path):
    ding = tmp_path / "de-en"
    ding.write_text("\n".join([
        "# Version :: devel",  # a header line: skipped
        "Abgemacht!; Ist geritzt! [ugs.] :: Done!; It’s a deal! [coll.]; That’s settled!",
        "Abstand {m} | Abstand halten! | Ich folgte ihm mit einigem Abstand. :: "
        "distance | Keep your distance! | I followed him at a distance.",
        "Haus {n} | Das ist mein Haus. :: house",  # parts do not line up: skipped
        "Na ja. :: Well.",  # one-word English: not a sentence pair
    ]) + "\n", encoding="utf-8")
    assert list(data_sources.ding_sentence_pairs(ding)) == [
        ("It's a deal!", "Ist geritzt!"),  # apostrophes become ASCII (as in freedict); one-word sides go
        ("That's settled!", "Ist geritzt!"),  # every English alternative with every German one
        ("Keep your distance!", "Abstand halten!"),
        ("I followed him at a distance.", "Ich folgte ihm mit einigem Abstand."),
    ]


def test_catalog_sentences_are_paired_in_order_and_the_rest_skipped(tmp_path):
    mo = write_mo(tmp_path / "de" / "LC_MESSAGES" / "game.mo", {
        "We must hurry. The orcs are coming!": "Wir müssen uns beeilen. Die Orks kommen!",
        "menu\x04Open the gate now.": "Öffne jetzt das Tor.",  # its context goes
        "You have %d gold left.": "Du hast noch %d Gold.",  # placeholders: skipped
        "Speak to <b>Delfador</b> first.": "Sprich zuerst mit <b>Delfador</b>.",  # markup: skipped
        "Hello there. Come in.": "Hallo, komm rein.",  # two sentences against one: skipped
        "One orc died.\x00Many orcs died.": "Ein Ork starb.\x00Viele Orks starben.",  # plural forms: skipped
        "Attack": "Angriff",  # not a sentence
        "Konrad smiled.": "Konrad smiled.",  # untranslated
    })
    assert list(data_sources.catalog_sentence_pairs([mo])) == [  # in the catalog's order (msgfmt sorts)
        ("We must hurry.", "Wir müssen uns beeilen."),
        ("The orcs are coming!", "Die Orks kommen!"),
        ("Open the gate now.", "Öffne jetzt das Tor."),
    ]
    latin1 = write_mo(tmp_path / "old.mo", {"The bridge is out.": "Die Brücke ist weg."}, charset="ISO-8859-1")
    assert data_sources.read_catalog(latin1) == {"The bridge is out.": "Die Brücke ist weg."}
    (tmp_path / "bad.mo").write_bytes(b"not a catalog")
    with pytest.raises(data_sources.DataError, match="not a gettext .mo file"):
        data_sources.read_catalog(tmp_path / "bad.mo")


@pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="needs dpkg-deb")
def test_catalogs_are_taken_out_of_a_package_once(tmp_path, monkeypatch):
    root = tmp_path / "pkg"
    write_mo(root / "usr/share/locale/de/LC_MESSAGES/game.mo", {"We won.": "Wir haben gewonnen."})
    write_mo(root / "usr/share/locale/fr/LC_MESSAGES/game.mo", {"We won.": "Nous avons gagné."})
    (root / "DEBIAN").mkdir()
    (root / "DEBIAN/control").write_text("Package: game-data\nVersion: 1.0\nArchitecture: all\n"
                                         "Maintainer: t <t@example.org>\nDescription: test\n")
    downloads = []

    def download(package, where):
        downloads.append(package)
        where.mkdir(parents=True, exist_ok=True)
        deb = where / f"{package}_1.0_all.deb"
        subprocess.run(["dpkg-deb", "--build", "--root-owner-group", str(root), str(deb)], check=True,
                       capture_output=True)
        return deb

    monkeypatch.setattr(data_sources, "_download_deb", download)
    for _ in range(2):
        found = data_sources.fetch_catalogs(tmp_path / "cache", packages=["game-data"])
        assert [p.relative_to(tmp_path / "cache") for p in found] == [
            Path("catalogs/game-data/usr/share/locale/de/LC_MESSAGES/game.mo")]
        assert list(data_sources.catalog_sentence_pairs(found)) == [("We won.", "Wir haben gewonnen.")]
    assert downloads == ["game-data"]  # cached: downloaded once, the .deb itself not kept
    assert not list((tmp_path / "cache" / "catalogs").glob("*.deb"))


def write_help_page(root, rel, paragraphs: dict[str, str]):
    page = root / rel
    page.parent.mkdir(parents=True, exist_ok=True)
    body = "\n".join(f'<p id="{pid}" class="paragraph">{inner}</p>' for pid, inner in paragraphs.items())
    page.write_text(f"<html><body><h1 id=\"hd_id1\">Title</h1>\n{body}</body></html>", encoding="utf-8")


def test_help_sentences_are_paired_by_paragraph_id_and_the_rest_skipped(tmp_path):
    en, de = tmp_path / "en-US", tmp_path / "de"
    write_help_page(en, "text/swriter/guide/header.html", {
        "par_id1": "A header is an area in the top\n margin. You can add text there.",
        "par_id2": 'Choose <span class="menuitem">View - Normal</span> to switch\n this mode off.',
        "par_id3": "Only in English.",  # no German paragraph of that id
        "par_id4": "Use &lt;b&gt; for bold.",  # markup once unescaped: skipped
        "par_id5": "Click OK.",  # untranslated: skipped
        "par_id6": "One sentence. And another one.",  # two sentences against one: skipped
    })
    write_help_page(de, "text/swriter/guide/header.html", {
        "par_id6": "Ein Satz und noch einer.",
        "par_id5": "Click OK.",
        "par_id4": "Verwenden Sie &lt;b&gt; für Fettdruck.",
        "par_id2": 'Wählen Sie <span class="menuitem">Ansicht - Normal</span>, um diesen Modus zu beenden.',
        "par_id1": "Eine Kopfzeile ist ein Bereich am oberen Rand. Sie können dort Text einfügen.",
    })
    write_help_page(en, "text/shared/only_en.html", {"par_id1": "A page without a German twin."})
    assert list(data_sources.help_sentence_pairs(en, de)) == [
        ("A header is an area in the top margin.", "Eine Kopfzeile ist ein Bereich am oberen Rand."),
        ("You can add text there.", "Sie können dort Text einfügen."),
        ("Choose View - Normal to switch this mode off.", "Wählen Sie Ansicht - Normal, um diesen Modus zu beenden."),
    ]


def test_extra_ding_pairs_go_to_train_only_and_never_resemble_held_out_pairs(tmp_path, monkeypatch):
    entries = [f"Das ist Satz Nummer {i} hier.\nThis is sentence number {i} here.\n\n" for i in range(300)]
    dz = write_dictd(tmp_path, entries)
    monkeypatch.setattr(data, "fetch_dictionary", lambda cache: dz)
    base = data.prepare_translation(tmp_path / "base", cache=tmp_path, extra=False)
    held = data.load_pairs(tmp_path / "base", "test") + data.load_pairs(tmp_path / "base", "valid")
    en_held, de_held = held[0]
    ding = tmp_path / "de-en"
    ding.write_text("\n".join([
        "Wir gehen heute schwimmen. :: We are going swimming today.",  # new: goes to train
        f"Also {de_held[0].lower()}{de_held[1:]} :: A different English sentence here.",  # German ~ held out
        f"Ganz anderer deutscher Satz. :: {en_held.replace(' here', '')}",  # English side ~ held out
        "Das ist Satz Nummer 1 hier. :: This is sentence number 1 here.",  # already in the corpus
    ]) + "\n", encoding="utf-8")
    monkeypatch.setattr(data, "fetch_ding", lambda cache: ding)
    mo = write_mo(tmp_path / "game.mo", {
        "The orcs are coming!": "Die Orks kommen!",  # new: goes to train
        f"Well. {en_held}": f"Nun. {de_held}",  # its second sentence is a held-out pair
        "We are going swimming today.": "Wir gehen heute schwimmen.",  # already added from trans-de-en
    })
    monkeypatch.setattr(data, "fetch_catalogs", lambda cache: [mo])
    meta = data.prepare_translation(tmp_path / "plus", cache=tmp_path)
    for split in ("valid", "test"):
        assert data.load_pairs(tmp_path / "plus", split) == data.load_pairs(tmp_path / "base", split)
    added = set(data.load_pairs(tmp_path / "plus", "train")) - set(data.load_pairs(tmp_path / "base", "train"))
    assert added == {("We are going swimming today.", "Wir gehen heute schwimmen."),
                     ("The orcs are coming!", "Die Orks kommen!")}
    assert meta["sources"]["debian:trans-de-en (train only)"] == 1
    assert meta["sources"]["debian:German game catalogs (train only)"] == 1
    assert meta["counts"]["train"] == base["counts"]["train"] + 2
    no_games = data.prepare_translation(tmp_path / "no-games", cache=tmp_path, catalogs=False)
    assert no_games["counts"]["train"] == base["counts"]["train"] + 1
    write_help_page(tmp_path / "en-US", "a.html", {"par_1": "Click the button.", "par_2": en_held})
    write_help_page(tmp_path / "de", "a.html", {"par_1": "Klicken Sie auf die Schaltfläche.", "par_2": de_held})
    monkeypatch.setattr(data, "fetch_help", lambda cache: (tmp_path / "en-US", tmp_path / "de"))
    helped = data.prepare_translation(tmp_path / "help", cache=tmp_path, help_texts=True)
    assert helped["sources"]["debian:LibreOffice help (train only)"] == 1  # the held-out pair stays out
    assert ("Click the button.", "Klicken Sie auf die Schaltfläche.") in data.load_pairs(tmp_path / "help")
    assert "debian:LibreOffice help (train only)" not in meta["sources"]  # only when asked for


def test_data_is_torch_free_and_keeps_its_public_names():
    """Serving-side evaluation and the load tester import model.data without torch installed."""
    code = ("import sys; from model import data; "
            "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules)); "
            "print(all(hasattr(data, n) for n in data.__all__))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1]).stdout.split()
    assert out == ["[]", "True"]
    assert data.DataError is data_sources.DataError  # callers catch it as model.data's


def test_clean_normalises_and_strips_control_characters():
    assert data.clean("  Grüße\u0000 an\t\talle  ") == "Grüße an alle"
    assert data.clean("Gru\u0308ße") == "Grüße"  # NFC


def test_tsv_splits_are_deterministic_deduplicated_and_disjoint(tmp_path):
    tsv = tmp_path / "pairs.tsv"
    rows = [f"Sentence number {i}.\tSatz Nummer {i}." for i in range(600)]
    tsv.write_text("\n".join(rows + rows[:50]) + "\n", encoding="utf-8")  # 50 duplicates
    a = data.prepare_translation(tmp_path / "a", tsv=tsv)
    b = data.prepare_translation(tmp_path / "b", tsv=tsv)
    assert a["counts"] == b["counts"] and sum(a["counts"].values()) == 600
    splits = {s: data.load_pairs(tmp_path / "a", s) for s in data.SPLITS}
    assert splits == {s: data.load_pairs(tmp_path / "b", s) for s in data.SPLITS}
    assert min(len(v) for v in splits.values()) > 0
    train_src = {en for en, _ in splits["train"]}
    assert not train_src & {en for en, _ in splits["test"]}


def test_bad_tsv_line_is_named(tmp_path):
    tsv = tmp_path / "bad.tsv"
    tsv.write_text("ok\tgut\nno tab here\n", encoding="utf-8")
    with pytest.raises(data.DataError, match=r"bad.tsv:2: expected `source<TAB>target`"):
        data.prepare_translation(tmp_path / "o", tsv=tsv)


def test_own_text_corpus_and_missing_split_message(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("\n\n".join(f"Paragraph {i} of my own text." for i in range(400)), encoding="utf-8")
    meta = data.prepare_generation(tmp_path / "d", text_file=text)
    assert all(meta["chars"][s] > 0 for s in data.SPLITS)
    assert "Paragraph" in data.load_text(tmp_path / "d", "test")
    with pytest.raises(data.DataError, match="kvserve data --task translate"):
        data.load_pairs(tmp_path / "d", "test")
    assert json.loads((tmp_path / "d" / "generate" / "meta.json").read_text())["source"] == str(text)


@pytest.mark.slow
def test_real_sources_are_fetched(tmp_path):
    meta = data.prepare_translation(tmp_path)
    assert meta["counts"]["train"] > 20000 and meta["counts"]["test"] > 500
    assert meta["sources"]["debian:trans-de-en (train only)"] > 8000
    assert meta["sources"]["debian:German game catalogs (train only)"] > 15000
    helped = data.prepare_translation(tmp_path / "help", cache=tmp_path / "cache", help_texts=True)
    assert helped["sources"]["debian:LibreOffice help (train only)"] > 20000
    assert helped["counts"]["test"] == meta["counts"]["test"]
    gen = data.prepare_generation(tmp_path)
    assert gen["chars"]["train"] > 4_000_000 and "hamlet" in sum(gen["works"].values(), [])
