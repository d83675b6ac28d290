"""serving/ and export/ have zero findings from the tools configured in pyproject.toml: `ruff check` (lint and
import order), `ruff format --check` and `mypy`, each run as CI runs it, from this interpreter's environment
(`make test` installs the pinned versions with the `dev` extra). mypy keeps its cache in .mypy_cache: a first run
takes about half a minute, a later one a few seconds.

Each check also runs on a file with a deliberate finding, so a tool that stopped reporting would fail here too.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ("serving", "export")
TIMEOUT_S = 900  # far above a cold mypy run (~35 s of CPU): only a hung tool gets there


def run_tool(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """`python -m <tool> args...` with this interpreter; a tool that is not installed fails with the fix."""
    tool = args[0]
    found = subprocess.run([sys.executable, "-m", tool, "--version"], capture_output=True, text=True, cwd=cwd)
    if found.returncode != 0:
        pytest.fail(
            f"{tool} is not installed in {sys.executable}'s environment; install the dev extra: "
            f"pip install -e '.[dev]' (or `make venv`)"
        )
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, cwd=cwd, timeout=TIMEOUT_S)


def assert_clean(result: subprocess.CompletedProcess[str]) -> None:
    command = " ".join(result.args[2:])
    assert result.returncode == 0, f"`{command}` found something to fix:\n{result.stdout}{result.stderr}"


def test_ruff_check_finds_nothing():
    assert_clean(run_tool("ruff", "check", *CHECKED))


def test_ruff_format_leaves_every_file_as_it_is():
    assert_clean(run_tool("ruff", "format", "--check", *CHECKED))


def test_mypy_finds_nothing():
    assert_clean(run_tool("mypy", *CHECKED))


def test_each_check_reports_a_deliberate_finding(tmp_path: Path):
    """The same tools and configuration on one bad file: an unused import, a layout ruff would change and a
    str where an int is declared. Each run must fail and name the problem."""
    bad = tmp_path / "bad.py"
    bad.write_text('import os\n\n\ndef f() -> int:\n    return  "not an int"\n')
    config = str(ROOT / "pyproject.toml")
    lint = run_tool("ruff", "check", "--no-cache", "--config", config, str(bad))
    assert lint.returncode != 0 and "F401" in lint.stdout, lint.stdout + lint.stderr
    fmt = run_tool("ruff", "format", "--check", "--no-cache", "--config", config, str(bad))
    assert fmt.returncode != 0 and "bad.py" in fmt.stdout + fmt.stderr, fmt.stdout + fmt.stderr
    types = run_tool("mypy", "--config-file", config, str(bad))
    assert types.returncode != 0 and "return-value" in types.stdout, types.stdout + types.stderr
