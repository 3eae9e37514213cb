"""Context from other files: snippets, choice within the budget, the block's stability while typing, the store's
recent files, and `canvas-ls bench crossfile` on a small repository."""

from __future__ import annotations

import json
from pathlib import Path

from lsprotocol import types

from canvas_ls.server.completion import Completer
from canvas_ls.server.config import ServerConfig
from canvas_ls.server.crossfile import CrossFile, choose, snippets, words
from canvas_ls.server.documents import Document, DocumentStore
from tests.test_cli import cli

UTIL = '''import os


def parse_config(path):
    """Read the configuration at `path`."""
    with open(path) as source:
        return source.read()


class Loader:
    def load(self, name):
        return os.path.join("data", name)


LIMIT = 3
'''
NOISE = "def unrelated_helper(values):\n    return sorted(values)[::-1]\n"
MAIN = "from util import parse_config\n\n\ndef main():\n    cfg = parse_config(\n"


def doc(name: str, text: str, version: int = 1, language: str = "python") -> Document:
    return Document.open(f"file:///repo/{name}", text, version, language)


def test_snippets_are_top_level_definitions_with_their_names() -> None:
    found = snippets(doc("util.py", UTIL), "util.py")
    assert [(s.line, sorted(s.defines)) for s in found] == [(3, ["parse_config"]), (9, ["Loader"]), (14, [])]
    assert found[0].text.startswith("def parse_config(path):") and "import os" not in "".join(s.text for s in found)
    assert "parse_config" in words(found[0].text) and "def" not in words(found[0].text)


def test_the_definition_of_a_name_used_near_the_cursor_is_chosen_and_cut_to_fit() -> None:
    candidates = snippets(doc("util.py", UTIL), "util.py") + snippets(doc("noise.py", NOISE), "noise.py")
    chosen = choose(candidates, query={"cfg", "main"}, near={"cfg", "parse_config"}, budget_tokens=512)
    assert [s.path for s in chosen] == ["util.py"] and chosen[0].defines == {"parse_config"}
    # 26 tokens (83 characters): the header comment and the definition's first two lines; 20: under two lines fit
    (tight,) = choose(candidates, query=set(), near={"parse_config"}, budget_tokens=26)
    assert tight.text == 'def parse_config(path):\n    """Read the configuration at `path`."""'
    assert choose(candidates, query=set(), near={"parse_config"}, budget_tokens=20) == []
    assert choose(candidates, query=set(), near={"nothing"}, budget_tokens=512) == []  # no overlap: no block


def test_the_block_stays_while_typing_in_one_place_and_follows_new_names() -> None:
    cross = CrossFile()
    sources = [doc("util.py", UTIL), doc("noise.py", NOISE)]
    main = doc("main.py", MAIN)
    first = cross.block(main, len(MAIN) - 1, sources, 512)
    assert first is not None and first.text.startswith("# util.py\ndef parse_config(path):")
    typed = doc("main.py", MAIN[:-1] + "'a.toml'\n", version=2)
    assert cross.block(typed, len(typed.text) - 1, sources, 512) is first and cross.reused == 1
    # a name defined in a source and not in the block appears near the cursor: the block is rebuilt
    more = doc("main.py", MAIN + "    data = Loader().load(cfg)\n", version=3)
    rebuilt = cross.block(more, len(more.text) - 1, sources, 512)
    assert rebuilt is not first and any("Loader" in s.defines for s in rebuilt.snippets)
    # an edit in a source also rebuilds it
    changed = [doc("util.py", UTIL + "\n", version=2), sources[1]]
    assert cross.block(more, len(more.text) - 1, changed, 512) is not rebuilt


def test_the_store_offers_open_and_recently_closed_files_of_the_language() -> None:
    store = DocumentStore()
    files = [("a.py", "python", UTIL), ("b.go", "go", "package b\n"), ("c.py", "python", NOISE),
             ("main.py", "python", MAIN)]  # fmt: skip
    for name, language, text in files:
        store.open(types.TextDocumentItem(f"file:///r/{name}", language, 1, text))
    store.close("file:///r/a.py")
    main = store.get("file:///r/main.py")
    assert [d.uri for d in store.others(main)] == ["file:///r/c.py", "file:///r/a.py"]  # open first, then recent
    completer = Completer(None, ServerConfig(), store)  # type: ignore[arg-type]  # no model call here
    context = completer._context(main, len(MAIN) - 1)
    assert context.prefix.startswith("# a.py\ndef parse_config(path):") and context.prefix.endswith(MAIN[:-1])
    completer.config.completion.context_tokens = 0
    assert completer._context(main, len(MAIN) - 1).prefix == MAIN[:-1]


def test_bench_crossfile_measures_recall(tmp_path: Path) -> None:
    repo = tmp_path / "proj"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "util.py").write_text(UTIL)
    (repo / "pkg" / "noise.py").write_text(NOISE)
    (repo / "main.py").write_text(MAIN + "    return Loader().load(cfg)\n")
    out = tmp_path / "cross.json"
    done = cli("bench", "crossfile", "--repo", str(repo), "--exact-limit", "0", "--open", "2",
                     "--budgets", "64,512", "--out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["tasks"] == 2  # parse_config( and Loader() in main.py
    assert report["recall"]["512"] == 1.0 and out.with_suffix(".png").stat().st_size > 10_000
