"""The layout rules of the tree, checked on the source with `ast` (nothing is imported, so it is fast and
sees imports inside functions as well as at the top of a module).

- Boundaries (docs in /shared/DESIGN.md, "The flow of data": nothing downstream reaches back upstream):
  the engine (serving/engine/) imports no server framework, no torch and nothing above it; the load tester
  (loadtest/) talks only to a URL, so it imports no other package of the project; export/ and model/ import
  nothing of serving, the command line, the benchmarks or the load tester; serving/ nothing of the last three.
- No import cycle among the project's modules (every import counts, module level or inside a function,
  `if TYPE_CHECKING:` included; `from pkg import name` where `pkg/name.py` exists imports that submodule).
- Size: no module over MAX_MODULE_LINES lines and no function over MAX_FUNCTION_LINES lines, unless it says
  why: a comment line `# long: <reason>` at the top of the module (before its first statement other than
  the docstring), or on a function's `def` line or the line just above the function (above its decorators).

The checker's own tests run it on small synthetic sources, so a broken checker cannot pass silently.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("model", "export", "serving", "kvserve", "bench", "loadtest", "deploy", "tests")
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 400, 60
LONG_MARKER = re.compile(r"#\s*long:\s*\S")  # `# long: <reason>`; a marker without a reason does not count

ENGINE_FORBIDDEN = ("ray", "fastapi", "starlette", "torch", "serving.server", "kvserve", "bench", "loadtest")
LOADTEST_FORBIDDEN = ("model", "export", "serving", "bench", "kvserve")
MODEL_EXPORT_FORBIDDEN = ("serving", "kvserve", "bench", "loadtest")
SERVING_FORBIDDEN = ("kvserve", "bench", "loadtest")


# ------------------------------------------------------------------------------------------ the checker

def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Dotted name -> file, for every module of the project's packages."""
    return {module_name(f, root): f for p in packages for f in sorted((root / p).rglob("*.py"))}


def imports_of(source: str, module: str, known: set[str] | frozenset[str] = frozenset(),
               is_package: bool = False) -> set[str]:
    """Every module `source` (the text of `module`) imports, anywhere in it, as absolute dotted names.

    `from a import b` is `a.b` when that is a known module, else `a`; relative imports are resolved; in
    tests/, `import helper` of a sibling file is `tests.helper` (pytest puts tests/ on sys.path)."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, *([node.module] if node.module else [])])
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    if module.split(".")[0] == "tests":
        found = {f"tests.{m}" if f"tests.{m.split('.')[0]}" in known else m for m in found}
    return found


def within(name: str, prefixes: tuple[str, ...]) -> bool:
    """`name` is one of `prefixes` or inside one of them (`torch.nn` is within `torch`, `torchvision` is not)."""
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def import_graph(modules: dict[str, str], packages: set[str] | frozenset[str] = frozenset()) -> dict[str, set[str]]:
    """Module -> the project modules it imports (an import of `a.b.c` that is not a module counts as `a.b`).
    `modules` maps names to source text; `packages` are the names whose file is an `__init__.py`."""
    known = set(modules)
    graph: dict[str, set[str]] = {}
    for name, source in modules.items():
        edges = set()
        for m in imports_of(source, name, known, name in packages):
            while m and m not in known:
                m = m.rpartition(".")[0]
            if m and m != name:
                edges.add(m)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None when the graph is acyclic (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    for root in sorted(graph):
        if root in state:
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state and nxt in graph:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def size_violations(source: str, where: str) -> list[str]:
    """A module over MAX_MODULE_LINES or a function over MAX_FUNCTION_LINES lines without a `# long:` reason."""
    lines, tree = source.splitlines(), ast.parse(source)
    out = []
    body = tree.body[1:] if ast.get_docstring(tree) is not None else tree.body
    header = lines[: body[0].lineno - 1] if body else lines
    if len(lines) > MAX_MODULE_LINES and not any(LONG_MARKER.match(line.strip()) for line in header):
        out.append(f"{where}: {len(lines)} lines (> {MAX_MODULE_LINES})")
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        n = node.end_lineno - node.lineno + 1
        top = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        said = LONG_MARKER.search(lines[node.lineno - 1]) or (top > 1 and LONG_MARKER.match(lines[top - 2].strip()))
        if n > MAX_FUNCTION_LINES and not said:
            out.append(f"{where}:{node.lineno}: function {node.name} is {n} lines (> {MAX_FUNCTION_LINES})")
    return out


# ------------------------------------------------------------------------------------------ the tree

MODULES = project_modules()
SOURCES = {name: path.read_text(encoding="utf-8") for name, path in MODULES.items()}
IS_PACKAGE = frozenset(n for n, p in MODULES.items() if p.name == "__init__.py")


def _forbidden(under: tuple[str, ...], banned: tuple[str, ...]) -> list[str]:
    return sorted(f"{name} imports {m}" for name, src in SOURCES.items() if within(name, under)
                  for m in imports_of(src, name, set(SOURCES), name in IS_PACKAGE) if within(m, banned))


def test_the_tree_is_found():
    expected = {"serving.engine.engine", "loadtest.runner", "export.evaluate", "kvserve.cli", "tests.test_layout"}
    assert expected <= set(MODULES)


def test_the_engine_imports_no_server_framework_torch_or_upper_layer():
    assert _forbidden(("serving.engine",), ENGINE_FORBIDDEN) == []


def test_the_load_tester_imports_nothing_of_the_project():
    assert _forbidden(("loadtest",), LOADTEST_FORBIDDEN) == []


def test_model_and_export_import_nothing_downstream():
    assert _forbidden(("model", "export"), MODEL_EXPORT_FORBIDDEN) == []


def test_serving_imports_neither_the_command_line_nor_benchmarks_nor_the_load_tester():
    assert _forbidden(("serving",), SERVING_FORBIDDEN) == []


def test_no_import_cycle():
    cycle = find_cycle(import_graph(SOURCES, IS_PACKAGE))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_modules_and_functions_are_short_or_say_why():
    found = [v for name, src in SOURCES.items() for v in size_violations(src, str(MODULES[name].relative_to(ROOT)))]
    assert found == [], "\n".join(found)


# ------------------------------------------------------------------------------------------ the checker's tests

def test_checker_sees_imports_inside_functions_relative_and_of_submodules():
    src = ("import numpy as np\nfrom . import b\nfrom .c import x\nfrom pkg import d, VALUE\n"
           "def f():\n    from torch import nn\n    import ray.serve\n"
           "if TYPE_CHECKING:\n    from fastapi import Request\n")
    known = {"pkg.a", "pkg.b", "pkg.c", "pkg.d", "pkg"}
    assert imports_of(src, "pkg.a", known) == {"numpy", "pkg.b", "pkg.c", "pkg.d", "pkg", "torch", "ray.serve",
                                               "fastapi"}
    assert imports_of("from .. import up\n", "pkg.sub.m", {"pkg.up"}) == {"pkg.up"}
    assert imports_of("from engine_util import run\n", "tests.test_x", {"tests.engine_util"}) == {"tests.engine_util"}
    assert within("torch.nn", ("torch",)) and not within("torchvision", ("torch",))
    assert within("serving.server.app", ("serving.server",)) and not within("serving.engine.x", ("serving.server",))


def test_checker_finds_a_forbidden_import_inside_a_function():
    src = '"""Engine."""\ndef run():\n    import fastapi\n    from serving.server import app\n'
    got = {m for m in imports_of(src, "serving.engine.loop", {"serving.server.app"}) if within(m, ENGINE_FORBIDDEN)}
    assert got == {"fastapi", "serving.server.app"}


def test_checker_finds_cycles_including_ones_made_by_function_level_imports():
    sources = {"p.a": "from p import b\n", "p.b": "def f():\n    from p.c import x\n", "p.c": "import p.a\n",
               "p.d": "import p.a\n"}
    cycle = find_cycle(import_graph(sources))
    assert cycle is not None and cycle[0] == cycle[-1] and set(cycle) == {"p.a", "p.b", "p.c"}
    assert find_cycle(import_graph({**sources, "p.c": "import os\n"})) is None
    assert find_cycle({"x": {"x"}}) == ["x", "x"]  # import_graph drops self-imports; find_cycle still sees them


def test_checker_finds_long_functions_and_modules_unless_they_say_why():
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    long_fn = f"def f():\n{body}"
    assert size_violations(long_fn, "m.py") == [f"m.py:1: function f is {MAX_FUNCTION_LINES + 1} lines (> 60)"]
    assert size_violations(f"def f():\n{body[:-len('    x59 = 59')-1]}", "m.py") == []
    assert size_violations(f"# long: one table of cases\n{long_fn}", "m.py") == []
    assert size_violations(f"@decorator\ndef f():  # long: a generated dispatch\n{body}", "m.py") == []
    assert size_violations(f"# long:\n{long_fn}", "m.py") != []  # a marker must give its reason
    assert size_violations(f"x = 1\n# long: not next to the def\n\n{long_fn}", "m.py") != []
    module = '"""Doc."""\n' + "y = 0\n" * MAX_MODULE_LINES
    assert size_violations(module, "m.py") == [f"m.py: {MAX_MODULE_LINES + 1} lines (> {MAX_MODULE_LINES})"]
    assert size_violations('"""Doc."""\n# long: the whole grammar in one place\n' + "y = 0\n" * 400, "m.py") == []
    assert size_violations('"""Doc."""\ny = 0\n# long: too late, not at the top\n' + "y = 0\n" * 400, "m.py") != []


@pytest.mark.parametrize("rule", [ENGINE_FORBIDDEN, LOADTEST_FORBIDDEN, MODEL_EXPORT_FORBIDDEN, SERVING_FORBIDDEN])
def test_every_forbidden_package_is_a_package_of_this_tree_or_a_real_dependency(rule):
    """A misspelt rule would forbid nothing: each project name it lists exists here."""
    tops = {m.split(".")[0] for m in MODULES} | {"serving.server"}
    assert all(r in tops or r in ("ray", "fastapi", "starlette", "torch") for r in rule), rule
