"""bench/ holds the benchmarks the product runs, and nothing else: every module of it imports, and every one is
reachable from what `make bench`, `make soak` and `make gpu-check` run (`kvserve bench`'s sections in bench/cli.py,
bench/soak.py, bench/gpu_check/), so a one-off experiment left in the tree fails here. An experiment that
explains a current choice goes to docs/decisions/ (question, measurement, answer, the commit that reproduces it)
and leaves bench/.

Reachability is static: the import graph of tests/test_layout.py (imports anywhere in a module, function level
included) plus `python -m bench.X` subprocesses (a string literal naming a bench module).
"""
from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from test_layout import MODULES, SOURCES, import_graph

ROOT = Path(__file__).resolve().parents[1]
ROOTS = ("bench.cli", "bench.soak", "bench.gpu_check", "bench.gpu_check.__main__")
BENCH = sorted(name for name in MODULES if name == "bench" or name.startswith("bench."))


def module_literals(source: str, known: set[str]) -> set[str]:
    """String constants in `source` that name a known module (`[sys.executable, "-m", "bench.decode_step"]`)."""
    return {node.value for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in known}


def reachable(sources: dict[str, str], roots: tuple[str, ...], packages: frozenset[str] = frozenset()) -> set[str]:
    """Every module reachable from `roots` through imports and subprocess module names; a package's __init__
    comes with any of its modules (importing `a.b` runs `a`)."""
    graph = import_graph(sources, packages)
    for name, source in sources.items():
        graph[name] |= module_literals(source, set(sources)) - {name}
    seen, todo = set(), [r for r in roots if r in sources]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parents = [".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)]
        todo += [m for m in (*graph.get(name, ()), *parents) if m in sources and m not in seen]
    return seen


def test_the_roots_are_what_the_make_targets_and_kvserve_bench_run():
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^bench:.*\n\t\$\(BIN\)/kvserve bench ", makefile, re.MULTILINE)
    assert "-m bench.soak " in makefile and "-m bench.gpu_check " in makefile
    assert '"bench.cli"' in SOURCES["kvserve.cli"]  # `kvserve bench` is bench/cli.py's `register`
    assert set(ROOTS) <= set(BENCH)


def test_every_bench_module_is_reachable_from_kvserve_bench_make_soak_or_make_gpu_check():
    bench_sources = {name: SOURCES[name] for name in BENCH}
    packages = frozenset(n for n in BENCH if MODULES[n].name == "__init__.py")
    orphans = sorted(set(BENCH) - reachable(bench_sources, ROOTS, packages))
    assert not orphans, (
        f"bench modules that neither `kvserve bench` (bench/cli.py), `make soak` (bench/soak.py) nor `make gpu-check` "
        f"(bench/gpu_check) reach: {orphans}. Make each a section of one of them, or retire it: its conclusion to "
        f"docs/decisions/ (with the commit that still has it), the module and its tests out of the tree.")


@pytest.mark.parametrize("name", BENCH)
def test_every_bench_module_imports(name):
    importlib.import_module(name)


def test_the_checker_finds_an_orphan_and_follows_subprocess_module_names():
    sources = {"b": "", "b.cli": "from b import report\nCMD = ['python', '-m', 'b.step']\n", "b.report": "",
               "b.step": "import b.util\n", "b.util": "", "b.old": "from b import util\n", "b.kit": "",
               "b.kit.part": ""}
    got = reachable(sources, ("b.cli",), frozenset({"b", "b.kit"}))
    assert got == {"b", "b.cli", "b.report", "b.step", "b.util"}  # b.old imports a reached module: still an orphan
    assert "b.kit" in reachable({**sources, "b.cli": "import b.kit.part\n"}, ("b.cli",), frozenset({"b", "b.kit"}))
    assert module_literals("x = ['-m', 'b.step', 'b.stepper']\n", {"b.step"}) == {"b.step"}


def test_every_bench_package_is_shipped():
    """A wheel or sdist carries the packages pyproject.toml lists, and `kvserve bench` renders bench/gpu_check's
    section: a bench package missing there breaks the installed command, not the checkout."""
    import tomllib

    shipped = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {n for n in BENCH if MODULES[n].name == "__init__.py"}
    assert packages <= shipped, f"pyproject.toml [tool.setuptools] packages lacks {sorted(packages - shipped)}"
