"""From the model's text to the edit the editor shows: shape, range, syntax check.

The canvas holds the suffix fixed, so the model does not need to be patched after the fact: no de-duplication of
the suffix, no bracket repair. What remains is the editor's side of things: a single-line completion stops at the
line end, the range swallows auto-paired closers the completion writes again, and a candidate that adds syntax
errors to the edited region is dropped (or cut to its first line when that one is clean).
"""

from __future__ import annotations

from dataclasses import dataclass

from tree_sitter import Node

from .context import CompletionContext, only_closers
from .documents import Document
from .positions import utf8

# Lines around the edit that the syntax check re-parses (before and after): enough for the enclosing statement.
CHECK_LINES = 60


@dataclass(frozen=True)
class Edit:
    start: int  # document offsets of the replaced range (start == end: a plain insertion)
    end: int
    text: str


def shape(context: CompletionContext, text: str, max_lines: int) -> str:
    """The completion as the editor should insert it; '' when nothing is left."""
    lines = text.split("\n")
    return "\n".join(lines[:1] if context.mode == "single_line" else lines[:max_lines]).rstrip()


def to_edit(context: CompletionContext, text: str) -> Edit:
    """Insert at the cursor; replace the rest of the line when it holds only closers the completion writes too."""
    closers = context.line_suffix.strip()
    first_line = text.split("\n", 1)[0]
    if only_closers(context.line_suffix) and first_line.rstrip().endswith(closers):
        return Edit(context.offset, context.offset + len(context.line_suffix), text)
    return Edit(context.offset, context.offset, text)


def _count_errors(node: Node) -> int:
    count = int(node.is_error or node.is_missing)
    if node.has_error:
        count += sum(_count_errors(child) for child in node.children)
    return count


def adds_syntax_errors(document: Document, edit: Edit) -> bool:
    """Whether the edit adds ERROR/MISSING nodes to the lines around it (False when there is no grammar)."""
    if document.parser is None:
        return False
    text, index = document.text, document.index
    first = max(0, index.line_of(edit.start) - CHECK_LINES)
    last = index.line_of(edit.end) + CHECK_LINES
    window_start = index.starts[first]
    window_end = index.starts[last + 1] if last + 1 < len(index.starts) else len(text)
    before = text[window_start:window_end]
    after = text[window_start : edit.start] + edit.text + text[edit.end : window_end]
    errors_before = _count_errors(document.parser.parse(utf8(before)).root_node)
    errors_after = _count_errors(document.parser.parse(utf8(after)).root_node)
    return errors_after > errors_before


def checked_edit(document: Document, context: CompletionContext, text: str, max_lines: int) -> Edit | None:
    """The edit to offer, or None: shaped, ranged, and free of new syntax errors."""
    shaped = shape(context, text, max_lines)
    if not shaped:
        return None
    edit = to_edit(context, shaped)
    if not adds_syntax_errors(document, edit):
        return edit
    first_line = shaped.split("\n", 1)[0].rstrip()
    if first_line and first_line != shaped:
        edit = to_edit(context, first_line)
        if not adds_syntax_errors(document, edit):
            return edit
    return None
