"""The docs stay a front page for users: README.md is short, every command it shows exists, and no page
tells the story of how the work was done (that belongs in git log).

Checks README.md's `kvserve SUBCOMMAND`s against the real command line (`python -m kvserve SUB --help`) and
its `make TARGET`s against the Makefile, and scans README.md, docs/*.md, deploy/README.md and
loadtest/README.md for talk of work sessions.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_README_LINES = 250
DOC_PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "deploy" / "README.md",
             ROOT / "loadtest" / "README.md"]
# \x20 and [']: the pattern must not match its own source line (the project-wide grep checks this file too).
SESSION_TALK = re.compile(r"session\x20[0-9]|session-[0-9]|this\x20session|sessions?\x20[0-9]|session[']s", re.IGNORECASE)

_FENCED = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
_INLINE = re.compile(r"`([^`\n]+)`")


def readme_code(text: str) -> list[str]:
    """The code of a markdown page: fenced blocks, then inline spans of the prose outside them."""
    blocks = _FENCED.findall(text)
    prose = _FENCED.sub("", text)
    return blocks + _INLINE.findall(prose)


def kvserve_subcommands(text: str) -> set[str]:
    return {m.group(1) for code in readme_code(text) for m in re.finditer(r"\bkvserve +([a-z][a-z0-9-]*)", code)}


def make_targets_shown(text: str) -> set[str]:
    return {m.group(1) for code in readme_code(text)
            for m in re.finditer(r"(?<![\w-])make +([a-z][a-z0-9_-]*)", code)}


def makefile_targets(text: str) -> set[str]:
    targets = {m.group(1) for m in re.finditer(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", text, re.MULTILINE)}
    for m in re.finditer(r"^\.PHONY\s*:(.*)$", text, re.MULTILINE):
        targets.update(m.group(1).split())
    return targets - {".PHONY"}


def test_readme_is_at_most_250_lines():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, (
        f"README.md has {len(lines)} lines; the front page keeps to {MAX_README_LINES}: move detail to docs/")


def test_the_parsers_find_what_they_should():
    text = ("Run `kvserve serve --port 1` or `make test`.\n\n```bash\nmake serve   # then\nkvserve up\n"
            "curl -s x | grep kvserve_requests\n```\n")
    assert kvserve_subcommands(text) == {"serve", "up"}
    assert make_targets_shown(text) == {"test", "serve"}
    assert makefile_targets(".PHONY: a b\nc: d\n\tx := 1\ne := 2\n") == {"a", "b", "c"}


README_SUBCOMMANDS = sorted(kvserve_subcommands(README.read_text(encoding="utf-8")))


def test_readme_shows_kvserve_subcommands():
    assert README_SUBCOMMANDS, "README.md shows no `kvserve SUBCOMMAND`; the parser or the page is broken"


@pytest.mark.parametrize("sub", README_SUBCOMMANDS)
def test_every_kvserve_subcommand_in_readme_exists(sub):
    r = subprocess.run([sys.executable, "-m", "kvserve", sub, "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, f"README.md shows `kvserve {sub}`, but `kvserve {sub} --help` failed:\n{r.stderr[-2000:]}"


def test_every_make_target_in_readme_exists():
    shown = make_targets_shown(README.read_text(encoding="utf-8"))
    assert shown, "README.md shows no `make TARGET`"
    missing = shown - makefile_targets((ROOT / "Makefile").read_text(encoding="utf-8"))
    assert not missing, f"README.md shows make targets the Makefile lacks: {sorted(missing)}"


@pytest.mark.parametrize("page", DOC_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_do_not_speak_of_work_sessions(page):
    text = page.read_text(encoding="utf-8").replace("InferenceSession", "")
    hits = [f"{page.relative_to(ROOT)}:{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1)
            if SESSION_TALK.search(line)]
    assert not hits, "docs describe the product, not the sessions that made it:\n" + "\n".join(hits)
