"""Context from the other files the user works on: a budgeted block of snippets placed before the prefix.

    sources     the other open documents of the same language, and recently closed ones (`DocumentStore.others`)
    snippets    each top-level definition of a source (its first CHUNK_LINES lines: the header and the start of
                the body), the other top-level code in runs of up to CHUNK_LINES lines; files without a grammar
                in windows of CHUNK_LINES lines
    score       identifier overlap (Jaccard) with the lines around the cursor, plus a bonus for a snippet that
                defines a name used near the cursor (what tree-sitter finds as the definition's name)
    block       the best snippets within the budget, in file and line order, each under a path header comment

The block must not defeat prefix KV reuse (`engine/prefix_cache.py`): it leads the prefix, so a block that changed
on every keystroke would re-encode the whole prompt each time. So one block is kept per document and reused while
the cursor stays in the same top-level definition (or 40-line stretch), the sources are unchanged and no name used
near the cursor gains a definition the block lacks.
"""

from __future__ import annotations

import keyword
import os
import re
from collections import OrderedDict
from dataclasses import dataclass, field, replace

from ..engine.commits import COMMENT
from ..engine.paths import file_path
from .context import CHARS_PER_TOKEN
from .documents import Document
from .languages import GRAMMARS

CHUNK_LINES = 30
QUERY_LINES = 30  # lines before the cursor whose identifiers make the query
NEAR_LINES = 3  # lines up to the cursor whose names ask for their definitions
ANCHOR_LINES = 40  # without a grammar, the block is kept while the cursor stays in the same 40-line stretch
DEFINES_BONUS = 1.0
MIN_LINES = 2  # a snippet cut to the budget keeps at least this many lines (a definition's header), or is left out
WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]{2,}")
STOP = frozenset(keyword.kwlist) | {
    "self",
    "cls",
    "this",
    "const",
    "let",
    "var",
    "function",
    "return",
    "func",
    "int",
    "str",
    "string",
    "bool",
    "void",
    "new",
    "nil",
    "null",
    "true",
    "false",
}


def words(text: str) -> set[str]:
    return {w for w in WORD.findall(text) if w not in STOP}


@dataclass(frozen=True)
class Snippet:
    path: str  # shown in the header: relative to the current document's folder when under it
    line: int  # first line, 0-based
    text: str
    words: frozenset[str]
    defines: frozenset[str]


@dataclass
class Block:
    text: str
    snippets: list[Snippet]
    anchor: tuple[int, int]  # (top-level node start line, or the 40-line stretch) the block was chosen for
    sources: tuple[tuple[str, int], ...]  # (uri, version) of the sources it was chosen from


@dataclass
class CrossFile:
    """Chooses and keeps the block per document; counts how often a block was reused as it stood."""

    # (source uri, its version, the folder its header path is relative to) -> its snippets, LRU
    chunks: OrderedDict[tuple[str, int, str], list[Snippet]] = field(default_factory=OrderedDict)
    blocks: dict[str, Block] = field(default_factory=dict)
    built: int = 0
    reused: int = 0

    def block(self, document: Document, offset: int, sources: list[Document], budget_tokens: int) -> Block | None:
        if budget_tokens <= 0 or not sources:
            return None
        anchor = _anchor(document, offset)
        versions = tuple(sorted((s.uri, s.version) for s in sources))
        near = _near(document, offset)
        kept = self.blocks.get(document.uri)
        if kept is not None and kept.anchor == anchor and kept.sources == versions:
            defined = {name for s in kept.snippets for name in s.defines}
            missing = near - defined
            if not any(s.defines & missing for source in sources for s in self._snippets(source, document)):
                self.reused += 1
                return kept
        candidates = [s for source in sources for s in self._snippets(source, document)]
        chosen = choose(candidates, words(_before(document, offset, QUERY_LINES)), near, budget_tokens)
        block = Block(render(chosen, document.language), chosen, anchor, versions)
        self.blocks[document.uri] = block
        self.built += 1
        return block

    def forget(self, uri: str) -> None:
        self.blocks.pop(uri, None)

    def _snippets(self, source: Document, current: Document) -> list[Snippet]:
        key = (source.uri, source.version, os.path.dirname(current.uri))
        found = self.chunks.get(key)
        if found is None:
            found = snippets(source, display_path(source.uri, current.uri))
            self.chunks[key] = found
            while len(self.chunks) > 64:
                self.chunks.popitem(last=False)
        return found


def choose(candidates: list[Snippet], query: set[str], near: set[str], budget_tokens: int) -> list[Snippet]:
    """The best-scoring snippets within the budget (a snippet that does not fit is skipped, not cut), in file and
    line order."""

    def score(snippet: Snippet) -> float:
        union = len(snippet.words | query)
        overlap = len(snippet.words & query) / union if union else 0.0
        return overlap + DEFINES_BONUS * bool(snippet.defines & near)

    scored = sorted(((score(s), s) for s in candidates), key=lambda pair: -pair[0])
    budget = budget_tokens * CHARS_PER_TOKEN
    chosen, used = [], 0
    for value, snippet in scored:
        header = len(snippet.path) + 8
        if value <= 0 or used + header >= budget:
            continue
        if used + header + len(snippet.text) > budget:  # keep the lines that fit: a definition's header first
            lines = snippet.text.split("\n")
            kept = []
            for line in lines:
                if used + header + sum(len(k) + 1 for k in kept) + len(line) > budget:
                    break
                kept.append(line)
            if len(kept) < MIN_LINES:
                continue
            snippet = replace(snippet, text="\n".join(kept))
        chosen.append(snippet)
        used += header + len(snippet.text) + 1
    return sorted(chosen, key=lambda s: (s.path, s.line))


def render(chosen: list[Snippet], language: str) -> str:
    mark = COMMENT.get(language, "//")
    return "".join(f"{mark} {s.path}\n{s.text.rstrip()}\n\n" for s in chosen)


def snippets(document: Document, path: str) -> list[Snippet]:
    """The document's top-level definitions and runs of other top-level code, each at most CHUNK_LINES lines."""
    lines = document.text.split("\n")
    grammar = GRAMMARS.get(document.language)
    pieces: list[tuple[int, int, frozenset[str]]] = []  # (first line, end line exclusive, names defined)
    if document.tree is not None and grammar is not None:
        run: list[int] = []  # other top-level code: [first, end)
        for node in document.tree.root_node.children:
            first, end = node.start_point.row, node.end_point.row + 1
            if node.type in grammar.definitions:
                if run:
                    pieces.append((run[0], run[1], frozenset()))
                    run = []
                pieces.append((first, end, frozenset(_names(node))))
            elif node.type in grammar.imports or node.type == "comment":
                continue  # imports and comments say little about what the file defines
            elif run and end - run[0] <= CHUNK_LINES:
                run[1] = end
            else:
                if run:
                    pieces.append((run[0], run[1], frozenset()))
                run = [first, end]
        if run:
            pieces.append((run[0], run[1], frozenset()))
    else:
        pieces = [(start, start + CHUNK_LINES, frozenset()) for start in range(0, len(lines), CHUNK_LINES)]
    found = []
    for first, end, defines in pieces:
        text = "\n".join(lines[first : min(end, first + CHUNK_LINES)])
        if text.strip():
            found.append(Snippet(path, first, text, frozenset(words(text)), defines))
    return found


def _names(node) -> list[str]:
    """The names a top-level definition introduces (a decorated one's inner definition's)."""
    inner = node.child_by_field_name("definition") or node
    name = inner.child_by_field_name("name")
    if name is None:  # e.g. `export function f` / Go's type declarations: the first named child with a name
        for child in inner.named_children:
            name = child.child_by_field_name("name")
            if name is not None:
                break
    return [name.text.decode("utf-8", "replace")] if name is not None and name.text else []


def _before(document: Document, offset: int, lines: int) -> str:
    """The cursor's line up to the cursor and the `lines - 1` lines before it."""
    text, start = document.text, offset
    for _ in range(lines):
        start = text.rfind("\n", 0, start)
        if start < 0:
            return text[:offset]
    return text[start + 1 : offset]


def _near(document: Document, offset: int) -> set[str]:
    return words(_before(document, offset, NEAR_LINES))


def _anchor(document: Document, offset: int) -> tuple[int, int]:
    """The top-level node the cursor is in (its start line), or its 40-line stretch."""
    line = document.index.line_of(offset)
    if document.tree is not None:
        point = document.index.point(offset)
        for node in document.tree.root_node.children:
            if node.start_point <= point <= node.end_point and node.end_point.row > node.start_point.row:
                return (0, node.start_point.row)
    return (1, line // ANCHOR_LINES)


def display_path(uri: str, current: str) -> str:
    """How a snippet's file is named in its header: relative to the current document's folder when under it."""
    path, here = _path(uri), os.path.dirname(_path(current))
    if not path:  # a document with an empty URI or path (found by tests/test_wire.py's fuzzer: relpath raised)
        return uri or "(untitled)"
    relative = os.path.relpath(path, here) if here else path
    return relative if not relative.startswith("..") else os.path.basename(path)


def _path(uri: str) -> str:
    path = file_path(uri)
    return uri if path is None else path
