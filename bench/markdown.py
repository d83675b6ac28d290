"""Small text helpers shared by the benchmark modules: durations, ratios, paths as typed, report fragments."""
from __future__ import annotations

from pathlib import Path
from typing import Any

DATE_UTC = "%Y-%m-%d %H:%M UTC"  # how every section stamps when it was measured (report_http parses it)


def rel_path(p: Path | str) -> str:
    """A path as a user would type it from here: relative to the working directory where it lies below it."""
    p = Path(p)
    try:
        return str(p.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(p)


def t(s: float | None) -> str:
    """A duration for humans: ms below 1 s, else s."""
    if s is None:
        return "n/a"
    if s < 0.01:
        return f"{s * 1e3:.2f} ms"
    if s < 1:
        return f"{s * 1e3:.0f} ms"
    return f"{s:.2f} s" if s < 10 else f"{s:.1f} s"


def x(r: float | None) -> str:
    return "n/a" if r is None else f"{r:.2f}x"


def gflops(f: float) -> str:
    return f"{f / 1e9:.1f} GFLOP/s"


def ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else a / b



def failed(body: dict[str, Any]) -> list[str]:
    return [f"**This section failed** ({body.get('date_utc')}): `{body.get('error')}`", ""]


def commands(body: dict[str, Any]) -> list[str]:
    if not body.get("commands"):
        return []
    return ["Commands run by this section:", "", "```", *body["commands"], "```", ""]


def section_date(body: dict[str, Any]) -> str:
    at = f" at git {body['git']}" if body.get("git") else ""
    return f"_Measured {body.get('date_utc')}{at}, {body.get('elapsed_s', 0) / 60:.1f} min._"


