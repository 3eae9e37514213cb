"""Next-edit suggestions: the edit history's coalescing, the repeat-the-edit predictor's patterns and sites, the canvas
predictor on answers known in advance, and `canvas/nextEdit` through a real LSP client over stdio."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import pytest_lsp
from lsprotocol import types
from pygls.exceptions import JsonRpcException
from pytest_lsp import LanguageClient

from canvas_ls.engine.regions import Hole
from canvas_ls.server.backend import Answer, CancelFlag, Cancelled, Failed, FillRequest, Gap, Reply
from canvas_ls.server.config import NextEditOptions, parse_config
from canvas_ls.server.documents import Document
from canvas_ls.server.history import MAX_EDIT_CHARS, MAX_EDITS, PAUSE_S, Change, EditHistory
from canvas_ls.server.nextedit import (
    NextEdits,
    Pattern,
    Unchanged,
    changed_confidence,
    changed_signature,
    pattern,
    repeat,
    rewrite,
    sites,
    window,
)
from tests.conftest import SERVER
from tests.test_lsp import open_doc, options, request, uri, wait_ready


def typed(history: EditHistory, changes: list[tuple[int, str, str]], now: float = 0.0) -> None:
    for step, (start, removed, inserted) in enumerate(changes):
        history.record(Change(start, removed, inserted), step + 1, now + step * 0.1)


def edits(history: EditHistory) -> list[tuple[int, str, str]]:
    return [(edit.start, edit.removed, edit.inserted) for edit in history.edits]


# -- the history --------------------------------------------------------------------------------------------------


def test_a_name_retyped_character_by_character_is_one_edit() -> None:
    history = EditHistory()  # "total = 0": "total" selected and typed over with "sum_"
    typed(history, [(0, "total", "s"), (1, "", "u"), (2, "", "m"), (3, "", "_")])
    assert edits(history) == [(0, "total", "sum_")]
    typed(history, [(3, "_", "")], now=1.0)  # backspace inside what it wrote
    assert edits(history) == [(0, "total", "sum")]


def test_deleting_back_then_typing_is_one_edit_and_typing_back_the_old_text_is_none() -> None:
    history = EditHistory()  # "x = total": backspace over "total" from its end, then "sum"
    typed(history, [(8, "l", ""), (7, "a", ""), (6, "t", ""), (5, "o", ""), (4, "t", ""), (4, "", "s"), (5, "", "um")])
    assert edits(history) == [(4, "total", "sum")]
    typed(history, [(4, "sum", "total")], now=2.0)  # replaced back inside it: no edit left
    assert edits(history) == []
    typed(history, [(0, "", "a"), (1, "x", "")], now=3.0)  # typing, then deleting forward from its end
    assert edits(history) == [(0, "x", "a")]


def test_a_line_break_a_pause_or_a_change_elsewhere_starts_a_new_edit_and_older_ones_move() -> None:
    history = EditHistory()
    typed(history, [(10, "", "a"), (11, "", "\n")])  # Enter ends the line's edit
    typed(history, [(12, "", "b")], now=PAUSE_S + 1)  # after a pause
    typed(history, [(0, "", "xy")], now=PAUSE_S + 1.1)  # elsewhere, before the others: they move by 2
    assert edits(history) == [(12, "", "a"), (13, "", "\n"), (14, "", "b"), (0, "", "xy")]
    typed(history, [(13, "\nb", "")], now=PAUSE_S + 1.2)  # over two of them: context only from now on
    assert [edit.huge for edit in history.edits] == [False, True, True, False, False]


def test_the_history_is_bounded_and_a_huge_paste_is_context_only() -> None:
    history = EditHistory()
    for number in range(MAX_EDITS + 5):
        history.record(Change(number * 10, "", "x"), number + 1, number * 10.0)
    assert len(history.edits) == MAX_EDITS and history.edits[0].version == 6
    history.record(Change(0, "", "p" * (MAX_EDIT_CHARS + 1)), 99, 10_000.0)
    last = history.edits[-1]
    assert last.huge and len(last.inserted) == MAX_EDIT_CHARS


def test_a_whole_text_change_is_the_differing_middle() -> None:
    assert Change.between("a = total + 1\n", "a = sum + 1\n") == Change(4, "total", "sum")
    assert Change.between("abc", "abc") == Change(3, "", "")
    assert Change.between("aaa", "aa") == Change(2, "a", "")
    document = Document.open("file:///a.py", "x = 1\n", 1, "python")
    document.apply(2, [types.TextDocumentContentChangeWholeDocument(text="x = 2\n")])
    assert edits(document.history) == [(4, "1", "2")]


# -- the repeat predictor -------------------------------------------------------------------------------------------

SOURCE = """def mean(values):
    total = 0
    for v in values:
        total += v
    print("total")  # total
    return total / len(values)
"""


def edited(text: str, old: str, new: str, nth: int = 0, language: str = "python") -> Document:
    """The document after `old` (its nth occurrence) was replaced by `new`, with that edit in its history."""
    start = -1
    for _ in range(nth + 1):
        start = text.index(old, start + 1)
    document = Document.open("file:///mean.py", text, 1, language)
    change = types.TextDocumentContentChangePartial(
        range=types.Range(types.Position(*document.index.position(start)),
                          types.Position(*document.index.position(start + len(old)))), text=new)  # fmt: skip
    document.apply(2, [change])
    return document


def test_a_rename_is_repeated_where_the_name_stands_as_a_name_nearest_below_first() -> None:
    document = edited(SOURCE, "total", "acc")
    cursor = document.text.index("acc") + 3
    assert pattern(document, document.history.last) is not None
    found = repeat(document, cursor, [], NextEditOptions())
    lines = document.text.split("\n")
    assert [(document.index.line_of(s.start), document.text[s.start : s.end], s.text) for s in found] == [
        (3, "total", "acc"),
        (5, "total", "acc"),
    ]  # not the string's nor the comment's
    assert {(s.predictor, s.confidence, s.away) for s in found} == {("repeat", 0.85, True)}
    assert lines[1] == "    acc = 0"


def test_an_added_argument_and_a_changed_literal_are_repeated_at_the_same_calls() -> None:
    text = "a = f(x)\nb = f(x)\nc = f(y)\nd = g(x)\nsleep(timeout=30)\nwait(timeout=30)\n"
    document = edited(text, "f(x)", "f(x, 2)")
    found = repeat(document, 8, [], NextEditOptions())
    assert pattern(document, document.history.last).old == "f(x)"
    assert [(document.text[s.start : s.end], s.text, s.confidence) for s in found] == [("f(x)", "f(x, 2)", 0.2)]
    document = edited(text, "30", "60")
    assert (pattern(document, document.history.last).old, pattern(document, document.history.last).new) == (
        "timeout=30",
        "timeout=60",
    )
    assert [document.index.line_of(s.start) for s in repeat(document, 0, [], NextEditOptions())] == [5]


def test_a_rename_reaches_the_other_open_documents_of_its_language() -> None:
    document = edited(SOURCE, "mean", "average")
    other = Document.open("file:///main.py", "from stats import mean\nprint(mean([1]))\n", 1, "python")
    found = repeat(document, 0, [other], NextEditOptions())
    assert [(s.uri, other.text[s.start : s.end], s.confidence, s.away) for s in found] == [
        ("file:///main.py", "mean", 0.75, True),
        ("file:///main.py", "mean", 0.75, True),
    ]
    assert repeat(document, 0, [other], NextEditOptions(max_documents=0)) == []


def test_a_part_of_a_dotted_name_is_repeated_as_the_whole_dotted_name() -> None:
    text = "from pkg.engine.calibrate import run\nfrom pkg.engine import other\nimport pkg.engine.calibrate\n"
    document = edited(text, "engine", "server")
    assert pattern(document, document.history.last) == Pattern("pkg.engine.calibrate", "pkg.server.calibrate", "dotted")
    found = repeat(document, 0, [], NextEditOptions())
    assert [(document.index.line_of(s.start), s.text) for s in found] == [(2, "pkg.server.calibrate")]
    document = edited("self.size = 1\nother.size = 2\nprint(self.size)\n", "size", "count")
    assert [document.text[s.start : s.end] for s in repeat(document, 0, [], NextEditOptions())] == ["self.size"]


def test_nothing_to_repeat_for_multi_line_or_nameless_edits_or_an_imports_names() -> None:
    document = edited("x = 1\ny = 2\n", "1\ny", "3\nz")
    assert pattern(document, document.history.last) is None
    document = edited("x = 1 + 1\n", "+", "-")
    assert pattern(document, document.history.last) is None  # "1 - 1": no name in it
    document = edited("from a import b, c\nfrom a import b, d\n", "b, c", "b, c, e")
    assert pattern(document, document.history.last) is None  # another import need not take the name too


# -- the canvas predictor on fixed answers ------------------------------------------------------------------------


class Fixed:
    """A backend whose fill answers `reply`: a Reply, or a function of a window giving its rewritten text (applied to
    each window of the canvas)."""

    adapters = False
    whole_models = True
    state = "ready"

    def __init__(self, reply: Any) -> None:
        self.reply, self.parts = reply, ()

    async def fill(self, request: FillRequest, cancel: CancelFlag) -> Reply:
        self.parts = request.parts
        if not callable(self.reply):
            return self.reply
        gaps = tuple(gap(self.reply(part.text)) for part in request.parts if isinstance(part, Hole))
        return Answer(gaps[0].text, gaps[0].token_texts, gaps[0].confidence, gaps=gaps)


def gap(text: str, ended: bool = True, confidence: float = 0.95) -> Gap:
    return Gap(text, ended, (text,), (confidence,))


def answer(text: str, ended: bool = True, confidence: float = 0.95) -> Answer:
    return Answer(text, (text,), (confidence,), gaps=(gap(text, ended, confidence),))


async def test_the_canvas_rewrite_becomes_one_edit_and_an_unchanged_window_none() -> None:
    document = edited("def area(r):\n    return r * r\n\nprint(area(2))\n", "r * r", "3.14 * r * r")
    options = NextEditOptions(predictors=["canvas"], window_lines=1, min_confidence={"canvas": 0.9})
    offset = document.text.index("print")
    fixed = Fixed(lambda window: window.replace("area(2)", "area(2.0)"))
    outcome = await NextEdits().suggest(document, offset, [], fixed, options, 256)  # type: ignore[arg-type]
    ((suggestion),) = outcome.suggestions
    assert (document.text[suggestion.start : suggestion.end], suggestion.text) == ("", ".0")
    assert (suggestion.predictor, suggestion.confidence, suggestion.away, outcome.reason) == ("canvas", 0.95, False,
                                                                                              None)  # fmt: skip
    assert window(document, offset, 1).text == "\nprint(area(2))\n"
    prompt = fixed.parts[0]
    assert prompt.startswith("# recent edits, newest last:\n# 'r * r' -> '3.14 * r * r'\n")
    assert fixed.parts[1] == Hole("\nprint(area(2))\n", 0.3)
    for reply, reason in [
        (lambda window: window, "the model left the window as it was"),
        (lambda window: "print(area(2)", "the model's rewrite adds syntax errors"),
        (answer("x", ended=False), "the model's rewrite did not end within its budget"),
        (answer("\nprint(area(3))\n", confidence=0.5), "below the confidence threshold"),
        (Failed("the engine went away"), "the engine went away"),
        (Cancelled(), "superseded by a newer request"),
    ]:
        fixed.reply = reply
        outcome = await NextEdits().suggest(document, offset, [], fixed, options, 256)  # type: ignore[arg-type]
        assert (outcome.suggestions, outcome.reason) == ([], reason)


async def test_a_changed_signature_rewrites_its_calls_in_the_same_canvas() -> None:
    """An edit of a function's parameters: the lines of its calls (`area(...)`, `shapes.area(...)`, not the
    definition nor a string) are windows of the cursor's canvas, the code between them kept; each changed window is a
    suggestion, the cursor's first, then the nearest below."""
    source = ("def area(r):\n    return 3.14 * r * r\n\n\nlabel = 'area(1)'\nprint(area(2))\nx = 1\n"
              "total = shapes.area(3) + 1\n")  # fmt: skip
    document = edited(source, "(r)", "(r, pi)")
    offset = document.text.index("pi") + 2
    options = NextEditOptions(predictors=["canvas"], window_lines=0, canvas_sites=4)
    fixed = Fixed(lambda w: w.replace("area(2)", "area(2, 3.14)").replace("area(3)", "area(3, 3.14)"))
    outcome = await NextEdits().suggest(document, offset, [], fixed, options, 256)  # type: ignore[arg-type]
    assert [(s.text, document.index.line_of(s.start), s.away) for s in outcome.suggestions] == [
        (", 3.14", 5, True), (", 3.14", 7, True)]  # fmt: skip
    assert [part.text if isinstance(part, Hole) else None for part in fixed.parts] == [
        None, "def area(r, pi):\n", None, "print(area(2))\n", None, "total = shapes.area(3) + 1\n", None]  # fmt: skip
    assert fixed.parts[2] == "    return 3.14 * r * r\n\n\nlabel = 'area(1)'\n"  # kept as it is
    assert fixed.parts[4] == "x = 1\n"
    one = NextEditOptions(predictors=["canvas"], window_lines=0)  # the default: the cursor's window only
    assert (await NextEdits().suggest(document, offset, [], fixed, one, 256)).reason == (  # type: ignore[arg-type]
        "the model left the window as it was")  # fmt: skip
    body = edited(source, "3.14 * r * r", "pi * r * r")  # not the parameters: no call sites
    assert changed_signature(body, body.text.index("pi")) is None
    script = edited("function area(r) { return r * r; }\nconst x = 1;\nconsole.log(area(2));\n", "(r)", "(r, pi)",
                    language="javascript")  # fmt: skip
    assert changed_signature(script, script.text.index("pi")) == "area"
    assert [w.text for w in sites(script, 0, options)] == ["function area(r, pi) { return r * r; }\n",
                                                            "console.log(area(2));\n"]  # fmt: skip
    wider = NextEditOptions(predictors=["canvas"], window_lines=1, canvas_sites=4)  # a call next to it: one window
    assert [w.text for w in sites(script, 0, wider)] == [script.text]


def test_a_rewrite_is_as_confident_as_the_tokens_that_changed_the_text() -> None:
    copied = Gap("\nprint(area(2.0))\n", True, ("\nprint(area(2", ".0", "))\n"), (0.99, 0.6, 0.98))
    assert changed_confidence(copied, 13, 15) == 0.6  # ".0" inserted: its token's confidence, not the copies'
    assert changed_confidence(copied, 2, 4) == 0.99  # inside the first token
    assert changed_confidence(copied, 15, 15) == 0.6  # a deletion at 15: the tokens on either side of it
    healed = Gap("b", True, ("a", "b"), (0.9, 0.3), healed="a")  # the first token rewrote the prefix's "a"
    assert changed_confidence(healed, 0, 1) == 0.3
    untold = Gap("b", True, (), (0.9, 0.4))  # no token texts (an OpenAI-compatible server's): its least confidence
    assert changed_confidence(untold, 0, 1) == 0.4


class Waiting:
    """A backend whose fill runs until its request is cancelled (the engine stops between denoising steps)."""

    def __init__(self) -> None:
        self.started = asyncio.Event()

    async def fill(self, request: FillRequest, cancel: CancelFlag) -> Reply:
        self.started.set()
        await cancel.until_set()
        return Cancelled()


async def test_a_newer_request_or_closing_the_document_stops_the_running_one() -> None:
    document = edited("def area(r):\n    return r * r\n\nprint(area(2))\n", "r * r", "3.14 * r * r")
    options = NextEditOptions(predictors=["canvas"], window_lines=1)
    edits, backend = NextEdits(), Waiting()
    older = asyncio.ensure_future(edits.suggest(document, 0, [], backend, options, 256))  # type: ignore[arg-type]
    await backend.started.wait()
    backend.started.clear()
    newer = asyncio.ensure_future(edits.suggest(document, 0, [], backend, options, 256))  # type: ignore[arg-type]
    assert (await older).reason == "superseded by a newer request"  # cancelled by the newer one, not left running
    await backend.started.wait()
    edits.forget(document.uri)  # the document closed mid-request
    assert ((await newer).suggestions, (await newer).reason) == ([], "superseded by a newer request")
    assert len(edits.in_flight) == 0


async def test_huge_and_binary_looking_documents_get_a_reason_not_a_crash() -> None:
    options = NextEditOptions(predictors=["repeat", "canvas"], window_lines=1)
    long_line = "x = '" + "a" * 20_000 + "'\n"
    document = edited("value = 1\n" + long_line + "print(value)\n", "value", "amount")
    offset = document.text.index("x = ")
    outcome = await NextEdits().suggest(document, offset, [], Fixed(lambda w: w), options, 256)  # type: ignore[arg-type]
    assert [(s.text, document.index.line_of(s.start)) for s in outcome.suggestions] == [("amount", 2)]
    found = await rewrite(document, offset, Fixed(lambda w: w), options, CancelFlag(), 256)  # type: ignore[arg-type]
    assert found == Unchanged("the window around the cursor is over 12000 characters")
    binary = edited("k\x00\x01 = 1\n\ufffd\x7f k\x00\x01\n", "1", "2")
    outcome = await NextEdits().suggest(binary, 0, [], Fixed(lambda w: w), options, 256)  # type: ignore[arg-type]
    assert (outcome.suggestions, outcome.reason) == ([], "the model left the window as it was")
    history = EditHistory()
    history.record(Change(0, "", "z" * (MAX_EDIT_CHARS + 1)), 2)
    assert history.last is not None and history.last.huge  # kept as "huge": never repeated nor shown to the model


def test_next_edit_options_are_checked() -> None:
    assert parse_config({"next_edit": {"predictors": ["magic"]}})[1].startswith(
        "Invalid canvas-ls options, using defaults: next_edit.predictors: unknown ['magic']"
    )
    assert "next_edit.strength must be in [0.01, 1]" in parse_config({"next_edit": {"strength": 0}})[1]


# -- canvas/nextEdit over stdio -------------------------------------------------------------------------------------


@pytest_lsp.fixture(config=SERVER)
async def client(lsp_client: LanguageClient, ending_model_dir: Path):
    settings = {**options(ending_model_dir, workspace_cache=0), "next_edit": {"window_lines": 2, "canvas_sites": 4}}
    await lsp_client.initialize_session(types.InitializeParams(
        capabilities=types.ClientCapabilities(), initialization_options=settings))  # fmt: skip
    await wait_ready(lsp_client)
    yield


def change(client: LanguageClient, name: str, version: int, line: int, start: int, end: int, text: str) -> None:
    client.text_document_did_change(types.DidChangeTextDocumentParams(
        types.VersionedTextDocumentIdentifier(version=version, uri=uri(name)),
        [types.TextDocumentContentChangePartial(
            range=types.Range(types.Position(line, start), types.Position(line, end)), text=text)]))  # fmt: skip


async def next_edit(client: LanguageClient, name: str, line: int, character: int, **document: Any) -> dict:
    params = {"textDocument": {"uri": uri(name), **document}, "position": {"line": line, "character": character}}
    return await request(client, "canvas/nextEdit", params)


def at(line: int, start: int, end: int) -> dict[str, Any]:
    return {"start": {"line": line, "character": start}, "end": {"line": line, "character": end}}


async def test_a_rename_typed_in_the_editor_is_suggested_at_the_other_uses(client: LanguageClient) -> None:
    open_doc(client, "mean.py", SOURCE)
    open_doc(client, "main.py", "from mean import total\n")
    assert await next_edit(client, "mean.py", 1, 4) == {
        "version": 1,
        "edits": [],
        "reason": "no recent edit in this document",
    }
    for version, (start, end, text) in enumerate([(4, 9, "a"), (5, 5, "c"), (6, 6, "c")], 2):  # "total" -> "acc"
        change(client, "mean.py", version, 1, start, end, text)
    answer = await next_edit(client, "mean.py", 1, 7, version=4)
    assert answer == {"version": 4, "reason": None, "edits": [
        {"textDocument": {"uri": uri("mean.py")}, "range": at(3, 8, 13), "newText": "acc", "confidence": 0.85,
         "predictor": "repeat", "away": True},
        {"textDocument": {"uri": uri("mean.py")}, "range": at(5, 11, 16), "newText": "acc", "confidence": 0.85,
         "predictor": "repeat", "away": True},
        {"textDocument": {"uri": uri("main.py")}, "range": at(0, 17, 22), "newText": "acc", "confidence": 0.75,
         "predictor": "repeat", "away": True},
    ]}  # fmt: skip
    stale = await next_edit(client, "mean.py", 1, 7, version=3)
    assert stale == {"version": 4, "edits": [], "reason": "stale: the document is at another version"}


async def test_the_canvas_predictor_rewrites_the_window_through_the_engine(client: LanguageClient) -> None:
    """The model that writes one word and ends (`ending_model_dir`) rewrites the 5-line window in plain text to
    "code": one edit over the window, from the engine, in the resident engine's canvas."""
    text = "one\ntwo\nthree\nfour\nfive\nsix\nseven\n"
    open_doc(client, "notes.txt", text, language="plaintext")
    change(client, "notes.txt", 2, 3, 0, 4, "4")
    answer = await next_edit(client, "notes.txt", 3, 1)
    ((edit),) = answer["edits"]
    assert (edit["range"], edit["newText"], edit["predictor"], edit["away"]) == (
        {"start": {"line": 1, "character": 0}, "end": {"line": 6, "character": 0}},
        "code",
        "canvas",
        False,
    )
    assert edit["confidence"] > 0.9

    # A changed signature: its call's line is a second window of the same canvas, a second edit, away from the cursor
    source = "def area(r):\n    return r\n\n\nx = 1\ny = 2\nz = 3\nprint(area(2))\n"
    open_doc(client, "shapes.py", source)
    change(client, "shapes.py", 2, 0, 8, 11, "(r, pi)")
    answer = await next_edit(client, "shapes.py", 0, 15)
    found = [(e["range"]["start"]["line"], e["range"]["end"]["line"], e["newText"], e["away"]) for e in answer["edits"]]
    assert found == [(0, 3, "code", False), (7, 8, "code", True)], answer


async def test_bad_next_edit_requests_are_refused_with_why(client: LanguageClient) -> None:
    open_doc(client, "a.py", "x = 1\n")
    gone = await next_edit(client, "nope.py", 0, 0)
    assert gone == {"version": None, "edits": [], "reason": f"{uri('nope.py')} is not open"}
    for params, message in [
        ({"textDocument": {"uri": uri("a.py")}},
         "Invalid params for canvas/nextEdit: required field missing @ $.position"),
        ({"textDocument": {"uri": uri("a.py")}, "position": {"line": 40, "character": 0}},
         "canvas/nextEdit: the position is past the end of the document"),
        ({"textDocument": {"uri": uri("a.py"), "version": "1"}, "position": {"line": 0, "character": 0}},
         "Invalid params for canvas/nextEdit: expected int, got str @ $.textDocument.version"),
    ]:  # fmt: skip
        with pytest.raises(JsonRpcException) as refused:
            await request(client, "canvas/nextEdit", params)
        assert (refused.value.code, refused.value.message) == (-32602, message)
