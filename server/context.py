"""What the model sees: prefix and suffix windows around the cursor, chosen with the syntax tree.

    should we complete here?   no completion inside an identifier (unless only closers follow)
    how much?                  a blank line (statement start, empty body, after `:` or `{`) -> multi-line;
                               text on the line -> the rest of the line
    prefix window              the tail before the cursor within the token budget, plus what must stay whole when
                               the tail does not reach it: the file's imports and the headers of the enclosing
                               definitions (function, class...)
    suffix window              up to the end of the enclosing block, within the budget, ending at a line end

Windows are measured in characters at CHARS_PER_TOKEN (a byte-level BPE on code averages 3.2 to 3.7 bytes per
token); the engine trims to exact token counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tree_sitter import Node

from .config import CompletionOptions
from .documents import Document
from .languages import GRAMMARS, Grammar
from .silence import Why

CHARS_PER_TOKEN = 3.2
CLOSERS = frozenset(")]}>\"'`;,")
# Share of the prefix budget that imports and enclosing headers may take when the tail does not reach them.
HEADER_SHARE = 0.25
# The window of a long document starts on a grid of this share of the budget (then at the next line start), so that
# keystroke after keystroke the prefix only grows, and the engine's prefix cache encodes what was typed: a start
# that followed the cursor moved at every line typed, and each move re-encoded the whole window (a 0.5B model's
# ~900 tokens on 2 Zen 4 cores: ~2.4 s a request against ~0.64 s). The window is up to this share (and a line) shorter
# than the budget.
WINDOW_STRIDE = 0.125

Mode = Literal["single_line", "multi_line"]


@dataclass(frozen=True)
class CompletionContext:
    offset: int  # cursor, as an offset into the document text
    prefix: str  # the window before the cursor
    suffix: str  # the window after the cursor
    mode: Mode
    gap_tokens: int
    max_new_tokens: int
    line_suffix: str  # the rest of the cursor's line, right of the cursor
    lead_tokens: int = 0  # the budget of the snippets from other files that lead the prefix (0: none)


@dataclass(frozen=True)
class Skip:
    reason: str
    why: Why = Why.IN_WORD


def is_word(char: str) -> bool:
    return char.isalnum() or char == "_"


def only_closers(text: str) -> bool:
    stripped = text.strip()
    return bool(stripped) and all(c in CLOSERS for c in stripped)


def build_context(document: Document, offset: int, options: CompletionOptions) -> CompletionContext | Skip:
    text = document.text
    index = document.index
    line = index.line_of(offset)
    line_start = index.starts[line]
    line_end = text.find("\n", offset)
    line_end = len(text) if line_end < 0 else line_end
    line_prefix, line_suffix = text[line_start:offset], text[offset:line_end].removesuffix("\r")

    # 1. Cheap exits first.
    before, after = text[offset - 1 : offset], text[offset : offset + 1]
    if before and after and is_word(before) and is_word(after) and not only_closers(line_suffix):
        return Skip("inside an identifier")

    # 2. Scope: a blank line is a statement start (an empty body, a line after `:` or `{`): write a block.
    multi = line_prefix.strip() == "" and line_suffix.strip() == ""
    mode: Mode = "multi_line" if multi else "single_line"

    # 3. Windows.
    grammar = GRAMMARS.get(document.language)
    node = node_at(document, offset) if grammar is not None else None
    prefix = _prefix_window(document, offset, options.prefix_tokens, grammar, node)
    suffix = _suffix_window(document, offset, line_end, options.suffix_tokens, grammar, node)
    return CompletionContext(
        offset=offset,
        prefix=prefix,
        suffix=suffix,
        mode=mode,
        gap_tokens=options.gap_tokens_multi_line if multi else options.gap_tokens_single_line,
        max_new_tokens=options.max_new_tokens_multi_line if multi else options.max_new_tokens_single_line,
        line_suffix=line_suffix,
    )


def prefix_window(document: Document, offset: int, budget_tokens: int) -> str:
    """The window before `offset` that a completion there sees (for prompts laid out elsewhere: a fill's)."""
    grammar = GRAMMARS.get(document.language)
    node = node_at(document, offset) if grammar is not None else None
    return _prefix_window(document, offset, budget_tokens, grammar, node)


def node_at(document: Document, offset: int, end: int | None = None) -> Node | None:
    """The smallest syntax node over [offset, end] (`end` None: at `offset`); None without a tree."""
    if document.tree is None:
        return None
    point = document.index.point(offset)
    last = point if end is None else document.index.point(end)
    return document.tree.root_node.descendant_for_point_range(point, last)


def _char_offset(document: Document, point: tuple[int, int]) -> int:
    """String offset of a tree-sitter point (row, byte column)."""
    row, column = point
    index = document.index
    line_bytes = index.line_text(row).encode("utf-8", "surrogatepass")
    return index.starts[row] + len(line_bytes[:column].decode("utf-8", "surrogatepass"))


def _prefix_window(document: Document, offset: int, budget_tokens: int, grammar: Grammar | None,
                   node: Node | None) -> str:  # fmt: skip
    text = document.text
    budget = int(budget_tokens * CHARS_PER_TOKEN)
    if offset <= budget:
        return text[:offset]
    stride = max(1, int(budget * WINDOW_STRIDE))
    first = -(-(offset - budget) // stride) * stride  # the earliest start the budget allows, rounded up to the grid
    # What must stay whole although the tail does not reach it: the imports, then the enclosing headers.
    tail_start = first + int(budget * HEADER_SHARE)
    pieces: list[str] = []
    used = 0
    spans = [*_imports(document, grammar), *_enclosing_headers(document, grammar, node)] if grammar else []
    for header_start, header_end in spans:
        if header_end > tail_start:
            continue  # the tail holds it already
        piece = text[header_start:header_end].rstrip() + "\n"
        if used + len(piece) > budget * HEADER_SHARE:
            break
        pieces.append(piece)
        used += len(piece)
    start = first + used
    newline = text.find("\n", start, offset)
    start = newline + 1 if newline >= 0 else start  # the tail begins with a whole line
    return "".join(pieces) + text[start:offset]


def _imports(document: Document, grammar: Grammar) -> list[tuple[int, int]]:
    root = document.tree.root_node if document.tree is not None else None
    if root is None:
        return []
    spans = []
    for child in root.children:
        if child.type in grammar.imports:
            start = _char_offset(document, (child.start_point.row, 0))
            spans.append((start, _char_offset(document, tuple(child.end_point))))
    return spans


def _enclosing_headers(document: Document, grammar: Grammar, node: Node | None) -> list[tuple[int, int]]:
    """(start, end) of each enclosing definition's header, outermost first: whole lines up to its body."""
    spans = []
    while node is not None:
        if node.type in grammar.definitions:
            body = node.child_by_field_name("body")
            start = _char_offset(document, (node.start_point.row, 0))
            if body is not None and body.start_point.row > node.start_point.row:
                end = _char_offset(document, (body.start_point.row, 0))
            else:
                row = node.start_point.row
                end = start + len(document.index.line_text(row))
            spans.append((start, end))
        node = node.parent
    return spans[::-1]


def _suffix_window(document: Document, offset: int, line_end: int, budget_tokens: int, grammar: Grammar | None,
                   node: Node | None) -> str:  # fmt: skip
    text = document.text
    end = min(len(text), offset + int(budget_tokens * CHARS_PER_TOKEN))
    block = node
    while grammar is not None and block is not None and block.type not in grammar.blocks:
        block = block.parent
    if block is not None:
        block_end = _char_offset(document, tuple(block.end_point))
        if block_end > offset:
            end = min(end, block_end)
    end = max(end, line_end)  # always the whole rest of the cursor's line
    if end < len(text):
        cut = text.rfind("\n", line_end, end + 1)
        end = cut if cut >= line_end else end
    return text[offset:end]
