"""Where the holes are: the placeholders of a function or class, found with tree-sitter.

A placeholder is code that says "something goes here": Python's `...` and `raise NotImplementedError`, `pass` with a
TODO comment; Rust's `todo!()` and `unimplemented!()`; a TODO comment in any language (`// TODO`, `/* TODO */`,
`-- TODO`); an empty body (`{}`). Each becomes a hole: the range the fill replaces (an empty body's inside).
"""

from __future__ import annotations

from dataclasses import dataclass

from tree_sitter import Node

from .context import _char_offset, node_at
from .documents import Document
from .languages import GRAMMARS

COMMENTS = frozenset({"comment", "line_comment", "block_comment"})
STRINGS = frozenset({"string", "string_literal", "raw_string_literal", "template_string", "interpreted_string_literal",
                     "char_literal", "character_literal", "text_block"})  # fmt: skip
PLACEHOLDER_MACROS = frozenset({"todo", "unimplemented"})


@dataclass(frozen=True)
class Scope:
    start: int  # document offsets of the function or class the holes were looked for in
    end: int
    kind: str  # its node type, e.g. "function_definition"
    holes: tuple[tuple[int, int], ...]  # [start, end) offsets of each placeholder, in document order


def find_holes(document: Document, offset: int) -> Scope | None:
    """The placeholders of the innermost function or class around `offset`; None outside any (or no grammar)."""
    grammar = GRAMMARS.get(document.language)
    node = node_at(document, offset)
    if grammar is None or node is None:
        return None
    while node is not None and node.type not in grammar.definitions:
        node = node.parent
    if node is None:
        return None
    spans: list[tuple[int, int]] = []
    _collect(document, node, grammar.blocks, spans)
    # `pass  # TODO` is one hole, not a comment inside a hole: keep the spans no other span holds
    spans = [a for a in spans if not any(b != a and b[0] <= a[0] and a[1] <= b[1] for b in spans)]
    return Scope(
        _char_offset(document, node.start_point), _char_offset(document, node.end_point), node.type, tuple(spans)
    )


def _collect(document: Document, node: Node, blocks: frozenset[str], spans: list[tuple[int, int]]) -> None:
    span = _placeholder(document, node, blocks)
    if span is not None:
        spans.append(span)
        return
    for child in node.children:
        _collect(document, child, blocks, spans)


def _placeholder(document: Document, node: Node, blocks: frozenset[str]) -> tuple[int, int] | None:
    text = _text(node)
    start, end = _char_offset(document, node.start_point), _char_offset(document, node.end_point)
    if (
        node.type == "expression_statement"
        and node.named_child_count == 1
        and node.named_children[0].type == "ellipsis"
    ):
        return start, end
    if node.type == "raise_statement" and text.removeprefix("raise").strip().startswith("NotImplementedError"):
        return start, end
    if node.type == "pass_statement":  # with a TODO comment on its line or the line before
        comment = _todo_comment_near(node)
        if comment is not None:
            comment_start = _char_offset(document, comment.start_point)
            comment_end = _char_offset(document, comment.end_point)
            return min(start, comment_start), max(end, comment_end)
        return None
    macro = node.child_by_field_name("macro") if node.type == "macro_invocation" else None
    if macro is not None and _text(macro) in PLACEHOLDER_MACROS:
        return start, end
    if _is_todo(node):
        return start, end
    if node.type in blocks and node.named_child_count == 0 and text.startswith("{") and text.endswith("}"):
        return start + 1, end - 1  # an empty body: fill its inside
    return None


def _todo_comment_near(node: Node) -> Node | None:
    """A TODO comment after `pass` on its line, or alone on the line before it."""
    after, before = node.next_sibling, node.prev_sibling
    if before is None and node.parent is not None:  # a comment before a block's first line sits outside the block
        before = node.parent.prev_sibling
    if after is not None and after.start_point[0] == node.end_point[0] and _is_todo(after):
        return after
    if before is not None and before.end_point[0] == node.start_point[0] - 1 and _is_todo(before):
        return before
    return None


def _is_todo(node: Node) -> bool:
    return node.type in COMMENTS and "TODO" in _text(node)


def inside_string_or_comment(document: Document, start: int, end: int) -> bool:
    """Whether [start, end) lies within one string or comment that is not itself a placeholder (a TODO)."""
    node = node_at(document, start)
    while node is not None:
        if node.type in STRINGS or (node.type in COMMENTS and "TODO" not in _text(node)):
            node_start, node_end = _char_offset(document, node.start_point), _char_offset(document, node.end_point)
            return node_start < start and end < node_end
        node = node.parent
    return False


def _text(node: Node) -> str:
    return (node.text or b"").decode("utf-8", "replace")
