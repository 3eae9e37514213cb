"""Document sync under random edits: the server's text equals a reference that applies the same edits by offset, and
its incrementally edited tree-sitter tree equals a fresh parse of the text.

Edits are drawn as LSP sends them: ranges in the negotiated position encoding (UTF-16, UTF-8 or UTF-32), converted
from offsets by the LSP spec's rules here (not by the server's code), over text with multi-byte and astral
characters, CRLF line ends and tabs; some ranges end past the end of a line or of the text (the server clamps them,
as the spec says), some notifications arrive out of order (an older version is dropped)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from lsprotocol import types

from canvas_ls.server.documents import Document, DocumentStore
from canvas_ls.server.positions import utf8

ALPHABET = st.sampled_from(
    ["a", "b", " ", "\n", "\r\n", "\t", "(", ")", ":", "é", "€", "😀", "𝔘", "x = 1\n", "def f():\n"]
)
TEXT = st.lists(ALPHABET, max_size=40).map("".join)


def position(text: str, offset: int, encoding: str) -> types.Position:
    """The LSP position of a string offset, by the spec: lines end at \\n; characters counted in `encoding`."""
    line_start = text.rfind("\n", 0, offset) + 1
    column = text[line_start:offset]
    width = {"utf-16": len(column.encode("utf-16-le", "surrogatepass")) // 2, "utf-8": len(utf8(column)),
             "utf-32": len(column)}[encoding]  # fmt: skip
    return types.Position(text.count("\n", 0, offset), width)


def line_end(text: str, offset: int) -> int:
    """Where a character past the end of the offset's line lands: its end, before a CR."""
    end = text.find("\n", offset)
    end = len(text) if end < 0 else end
    return end - 1 if end > 0 and text[end - 1] == "\r" and end - 1 >= offset else end


@st.composite
def edits(draw: st.DrawFn, text: str) -> tuple[int, int, str, str]:
    """(start, end, new text, kind) as offsets into `text`; kind says how the range's end is sent."""
    cuts = [i for i in range(len(text) + 1) if not (0 < i < len(text) and text[i - 1] == "\r" and text[i] == "\n")]
    start = draw(st.sampled_from(cuts))
    end = draw(st.sampled_from([c for c in cuts if c >= start]))
    kind = draw(st.sampled_from(["exact", "exact", "exact", "past_line", "past_text"]))
    return start, end, draw(TEXT), kind


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), TEXT, st.sampled_from(["python", "plaintext"]), st.sampled_from(["utf-16", "utf-8", "utf-32"]))
def test_incremental_sync_matches_a_reference_and_a_fresh_parse(data: st.DataObject, initial: str, language: str,
                                                                encoding: str) -> None:  # fmt: skip
    name = "fuzz.py" if language == "python" else "fuzz.txt"
    document = Document.open(f"file:///{name}", initial, 1, language, encoding)
    reference, version = initial, 1
    for _ in range(data.draw(st.integers(1, 8))):
        start, end, new, kind = data.draw(edits(reference))
        first = position(reference, start, encoding)
        last = position(reference, end, encoding)
        if kind == "past_line":  # a character past the line's end: the end of that line
            last = types.Position(last.line, last.character + 10_000)
            end = line_end(reference, end)
        elif kind == "past_text":  # a line past the end: the end of the text
            last = types.Position(reference.count("\n") + 3, 0)
            end = len(reference)
        if data.draw(st.booleans()) and version > 1:  # an older notification arriving late: dropped
            stale = types.TextDocumentContentChangePartial(range=types.Range(first, last), text="STALE")
            assert not document.apply(version - 1, [stale])
        version += 1
        change = types.TextDocumentContentChangePartial(range=types.Range(first, last), text=new)
        assert document.apply(version, [change])
        reference = reference[:start] + new + reference[max(start, end) :]
        assert document.text == reference
        if document.parser is not None:
            fresh = document.parser.parse(utf8(reference)).root_node
            assert str(document.tree.root_node) == str(fresh)
            assert document.tree.root_node.end_byte == len(utf8(reference))


# -- the store, as the server's handlers drive it: opens, changes and closes in any order ---------------------------

URIS = st.sampled_from(["file:///s/a.py", "file:///s/b.py", "file:///s/c.txt"])
EDGE_TEXT = st.lists(st.sampled_from(["a", "\n", "\r\n", "😀", "𝔘", "é", "\ud800", "\x00", "\t", "def f():\n"]),
                     max_size=12).map("".join)  # fmt: skip


class DocumentSync(RuleBasedStateMachine):
    """didOpen / didChange / didClose in any order, checked after every step against a reference of the text:
    changes to unopened documents and stale versions are refused (and logged by the store), out-of-range ranges
    clamp, surrogate pairs are never split on the way in."""

    def __init__(self) -> None:
        super().__init__()
        self.store = DocumentStore()
        self.reference: dict[str, tuple[str, int]] = {}

    @rule(uri=URIS, text=EDGE_TEXT, version=st.integers(-5, 5))
    def open(self, uri: str, text: str, version: int) -> None:
        self.store.open(types.TextDocumentItem(uri, "python" if uri.endswith(".py") else "plaintext", version, text))
        self.reference[uri] = (text, version)

    @rule(uri=URIS, data=st.data(), bump=st.integers(-2, 3), past=st.booleans())
    def change(self, uri: str, data: st.DataObject, bump: int, past: bool) -> None:
        text, version = self.reference.get(uri, ("", 0))
        start, end, new, _ = data.draw(edits(text))
        first, last = position(text, start, "utf-16"), position(text, end, "utf-16")
        if past:  # a range past the end of the text: clamped to its end
            last, end = types.Position(text.count("\n") + 5, 3), len(text)
        change = types.TextDocumentContentChangePartial(range=types.Range(first, last), text=new)
        params = types.DidChangeTextDocumentParams(types.VersionedTextDocumentIdentifier(version + bump, uri),
                                                   [change])  # fmt: skip
        document = self.store.change(params)
        if uri not in self.reference:
            assert document is None  # a change to a document that is not open: refused, logged
        elif bump > 0:
            self.reference[uri] = (text[:start] + new + text[max(start, end) :], version + bump)
        # else: a stale version, dropped with a logged reason; the text stays

    @rule(uri=URIS)
    def close(self, uri: str) -> None:
        self.store.close(uri)
        self.reference.pop(uri, None)

    @invariant()
    def texts_match(self) -> None:
        for uri, (text, version) in self.reference.items():
            document = self.store.get(uri)
            assert document is not None and document.text == text and document.version == version
        for uri in ("file:///s/a.py", "file:///s/b.py", "file:///s/c.txt"):
            if uri not in self.reference:
                assert self.store.get(uri) is None


DocumentSync.TestCase.settings = settings(max_examples=80, stateful_step_count=15, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
test_document_sync_against_a_reference = DocumentSync.TestCase
