"""Open documents: text, version, language and a tree-sitter tree kept current with incremental parsing.

Every change is applied to the text and, as an edit, to the tree, then the tree is re-parsed incrementally. A
change whose version is not newer than the document's is stale (it arrived out of order) and is dropped, so a
late notification can never rewind the text.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

from lsprotocol import types
from tree_sitter import Parser, Tree

from .history import Change, EditHistory
from .languages import language_for, parser_for
from .positions import LineIndex, PositionError, utf8

log = logging.getLogger(__name__)


@dataclass
class Document:
    uri: str
    text: str
    version: int
    language: str  # canonical name; "plaintext" (or another id) when there is no grammar
    encoding: str = "utf-16"  # the negotiated LSP position encoding
    parser: Parser | None = None
    tree: Tree | None = None
    history: EditHistory = field(default_factory=EditHistory, repr=False)  # its recent edits (next-edit suggestions)
    _index: LineIndex | None = field(default=None, repr=False)

    @classmethod
    def open(cls, uri: str, text: str, version: int, language_id: str | None, encoding: str = "utf-16") -> Document:
        language = language_for(language_id, uri)
        document = cls(uri, text, version, language, encoding, parser_for(language))
        document.reparse()
        return document

    @property
    def index(self) -> LineIndex:
        if self._index is None or self._index.text is not self.text:
            self._index = LineIndex(self.text, self.encoding)
        return self._index

    def reparse(self, old: Tree | None = None) -> None:
        if self.parser is not None:
            source = utf8(self.text)
            self.tree = self.parser.parse(source, old) if old is not None else self.parser.parse(source)

    def apply(self, version: int, changes: list[types.TextDocumentContentChangeEvent]) -> bool:
        """Apply the changes of one didChange; False (and nothing changed) when the version is stale."""
        if version <= self.version:
            log.warning("%s: dropped stale change (version %s, document at %s)", self.uri, version, self.version)
            return False
        for change in changes:
            if isinstance(change, types.TextDocumentContentChangePartial):
                made = self._apply_range(change.range, change.text)
            else:
                made = Change.between(self.text, change.text)
                self.text = change.text
                self.reparse()
            self.history.record(made, version)
        self.version = version
        return True

    def edited(self, start: int, end: int, new_text: str) -> Document:
        """A copy with text[start:end] replaced (its tree re-parsed incrementally); this document is unchanged.
        What the document will be once an edit is accepted."""
        copy = Document(self.uri, self.text, self.version, self.language, self.encoding, self.parser,
                        self.tree.copy() if self.tree is not None else None)  # fmt: skip
        copy._replace(start, end, new_text)
        return copy

    def _apply_range(self, span: types.Range, new_text: str) -> Change:
        index = self.index
        try:
            start = index.offset(span.start.line, span.start.character)
            end = index.offset(span.end.line, span.end.character)
        except PositionError:  # a range past the end: clamp to the end of the text
            start = min(len(self.text), _safe_offset(index, span.start))
            end = min(len(self.text), _safe_offset(index, span.end))
        start, end = min(start, end), max(start, end)
        made = Change(start, self.text[start:end], new_text)
        self._replace(start, end, new_text)
        return made

    def _replace(self, start: int, end: int, new_text: str) -> None:
        index = self.index
        start_point, old_end_point = index.point(start), index.point(end)
        start_byte = len(utf8(self.text[:start]))
        old_end_byte = start_byte + len(utf8(self.text[start:end]))
        self.text = self.text[:start] + new_text + self.text[end:]
        if self.tree is not None:
            new_index = self.index
            self.tree.edit(
                start_byte=start_byte,
                old_end_byte=old_end_byte,
                new_end_byte=start_byte + len(utf8(new_text)),
                start_point=start_point,
                old_end_point=old_end_point,
                new_end_point=new_index.point(start + len(new_text)),
            )
            self.reparse(self.tree)


def _safe_offset(index: LineIndex, position: types.Position) -> int:
    try:
        return index.offset(position.line, position.character)
    except PositionError:
        return len(index.text)


# Closed documents kept as context for the others (`DocumentStore.others`), and the largest one worth reading.
RECENT_DOCUMENTS = 20
SOURCE_MAX_CHARS = 1_000_000


class DocumentStore:
    def __init__(self) -> None:
        self._documents: dict[str, Document] = {}
        self.recent: OrderedDict[str, Document] = OrderedDict()  # closed, most recent last
        self.encoding = "utf-16"  # set from the initialize handshake

    def open(self, item: types.TextDocumentItem) -> Document:
        document = Document.open(item.uri, item.text, item.version, item.language_id, self.encoding)
        self._documents[item.uri] = document
        self.recent.pop(item.uri, None)
        return document

    def change(self, params: types.DidChangeTextDocumentParams) -> Document | None:
        document = self._documents.get(params.text_document.uri)
        if document is None:
            log.warning("change for a document that is not open: %s", params.text_document.uri)
            return None
        document.apply(params.text_document.version, list(params.content_changes))
        return document

    def close(self, uri: str) -> None:
        document = self._documents.pop(uri, None)
        if document is not None:
            document.history.clear()
            self.recent[uri] = document
            while len(self.recent) > RECENT_DOCUMENTS:
                self.recent.popitem(last=False)

    def others(self, document: Document) -> list[Document]:
        """The other open documents of its language, then the recently closed ones (context from other files)."""
        pool = [*self._documents.values(), *reversed(self.recent.values())]
        return [d for d in pool if d.uri != document.uri and d.language == document.language
                and len(d.text) <= SOURCE_MAX_CHARS]  # fmt: skip

    def get(self, uri: str) -> Document | None:
        return self._documents.get(uri)
