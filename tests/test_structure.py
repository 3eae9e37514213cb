"""The code's shape holds: no import circles between the modules of engine/, server/ and bench/ (imports inside
functions included), and the language server loads nothing of the benchmarks."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "server", "bench")


def imports(path: Path, package: str) -> set[str]:
    """The modules of ours ("engine.canvas") a file imports, anywhere in it."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom) or not node.level:
            continue
        where = ([package] if node.level == 1 else []) + (node.module.split(".") if node.module else [])
        candidates = [".".join(where[:2])] + [".".join([*where, alias.name]) for alias in node.names]
        found |= {name for name in candidates if (REPO / name.replace(".", "/")).with_suffix(".py").is_file()}
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in graph.get(module, ()):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for module in graph:
        if module not in index:
            visit(module)
    return found


def import_graph() -> dict[str, set[str]]:
    """Each module of ours and the modules of ours it imports."""
    return {f"{package}.{path.stem}": imports(path, package)
            for package in PACKAGES for path in (REPO / package).glob("*.py")}  # fmt: skip


def test_no_import_circles() -> None:
    # Read in a fresh interpreter: CPython 3.11.7's parser fails ("AST constructor recursion depth mismatch") when
    # another thread of the process compiles code meanwhile, as an earlier test's background compile thread may
    # (fixed in 3.11.8).
    script = ("import json; from tests.test_structure import import_graph; "
              "print(json.dumps({k: sorted(v) for k, v in import_graph().items()}))")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True)
    graph = {module: set(names) for module, names in json.loads(done.stdout).items()}
    assert graph["engine.engine"] >= {"engine.canvas", "engine.compiled"}  # the graph is read
    assert circles(graph) == []
    assert circles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]  # and a circle would be found


def test_the_language_server_loads_nothing_of_the_benchmarks() -> None:
    """`canvas-ls serve` (the real parser, the real server, stdin closed at once) leaves no `canvas_ls.bench`
    module in `sys.modules`; `canvas-ls bench --help` does load them."""
    script = ("import sys; from canvas_ls.server.cli import main; main(sys.argv[1:]); "
              "print(sorted(m for m in sys.modules if m.startswith('canvas_ls.bench')))")  # fmt: skip
    served = subprocess.run([sys.executable, "-c", script, "serve"], capture_output=True, text=True,
                            stdin=subprocess.DEVNULL, timeout=120)  # fmt: skip
    assert served.stdout.strip().splitlines()[-1] == "[]", served.stderr[-2000:]
    benched = subprocess.run([sys.executable, "-c", script, "bench", "--help"], capture_output=True, text=True,
                             stdin=subprocess.DEVNULL, timeout=120)  # fmt: skip
    assert (benched.returncode, "step" in benched.stdout) == (0, True)  # bench's own parser: its subcommands
