"""The request path's own modules, directly: the context windows (`context.py`), the edit's shape, range and syntax
check (`edits.py`), the placeholders of a fill (`holes.py`) and a configuration change in the server object
(`session.py`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from canvas_ls.engine.supersession import Supersession
from canvas_ls.server.backend import Answer, CancelFlag, Identity
from canvas_ls.server.completion import request_settings
from canvas_ls.server.config import CompletionOptions
from canvas_ls.server.context import CHARS_PER_TOKEN, WINDOW_STRIDE, CompletionContext, Skip, build_context
from canvas_ls.server.documents import Document
from canvas_ls.server.edits import Edit, checked_edit
from canvas_ls.server.holes import Scope, find_holes
from canvas_ls.server.session import CanvasServer

OPTIONS = CompletionOptions()
DOC = "import os\n\n\ndef size(x):\n    return \n\n\ndef other():\n    pass\n"


def open_doc(text: str, name: str = "a.py", language: str = "python") -> Document:
    return Document.open(f"file:///{name}", text, 1, language)


def test_a_begun_line_asks_for_its_rest_with_both_sides_in_view() -> None:
    document = open_doc(DOC)
    context = build_context(document, document.index.offset(4, 11), OPTIONS)
    assert context == CompletionContext(offset=36, prefix="import os\n\n\ndef size(x):\n    return ",
                                        suffix="\n\n\ndef other():\n    pass\n", mode="single_line", gap_tokens=16,
                                        max_new_tokens=48, line_suffix="")  # fmt: skip


def test_a_blank_line_asks_for_a_block_and_a_word_is_not_cut() -> None:
    blank = open_doc("def f(x):\n    \n")
    assert build_context(blank, blank.index.offset(1, 4), OPTIONS) == CompletionContext(
        offset=14, prefix="def f(x):\n    ", suffix="\n", mode="multi_line", gap_tokens=32, max_new_tokens=128,
        line_suffix="",
    )  # fmt: skip
    document = open_doc(DOC)
    assert build_context(document, document.index.offset(3, 6), OPTIONS) == Skip("inside an identifier")


def test_a_long_documents_window_keeps_its_start_while_the_user_types() -> None:
    """Past the budget, the prefix window starts on a coarse grid: keystroke after keystroke the prefix only grows
    (the engine's prefix cache then encodes what was typed), the window moving once in `WINDOW_STRIDE` of the budget
    typed, not at every line; the imports and the enclosing headers stay in view."""
    body = "".join(f"        x{i} = values[{i}] * {i}\n" for i in range(200))
    text = "import os\nimport sys\n\n\nclass Box:\n    def total(self, values):\n" + body + "        "
    budget = int(OPTIONS.prefix_tokens * CHARS_PER_TOKEN)
    typed = "".join(f"y{i} = x{i} + x{i + 1}\n        " for i in range(30))  # 30 lines, 612 characters
    prefixes = []
    for end in range(len(typed) + 1):
        document = open_doc(text + typed[:end] + "\n        return y0\n\n    def other(self):\n        pass\n")
        context = build_context(document, len(text) + end, OPTIONS)
        assert isinstance(context, CompletionContext)
        prefixes.append(context.prefix)
    head = "import os\nimport sys\nclass Box:\n    def total(self, values):\n"
    assert all(prefix.startswith(head) and len(prefix) <= budget for prefix in prefixes)
    moves = [k for k in range(1, len(prefixes)) if not prefixes[k].startswith(prefixes[k - 1])]
    stride = int(budget * WINDOW_STRIDE)
    assert stride == 409 and len(moves) == 2  # 612 characters typed cross the grid twice; 30 lines
    for k in moves:  # the window moved on to a line start: at most a stride and a line shorter than the budget
        assert budget - stride - 40 <= len(prefixes[k]) <= budget


def test_the_edit_is_shaped_to_its_line_and_dropped_when_it_breaks_the_code() -> None:
    document = open_doc(DOC)
    context = build_context(document, document.index.offset(4, 11), OPTIONS)
    assert isinstance(context, CompletionContext)
    assert checked_edit(document, context, "len(x)\nmore", 30) == Edit(36, 36, "len(x)")  # one line asked for
    assert checked_edit(document, context, "len(x", 30) is None  # an unclosed call adds a syntax error
    assert checked_edit(document, context, "   ", 30) is None  # nothing to show


def test_the_edit_replaces_the_closers_it_writes_again() -> None:
    """After `foo(` the editor auto-paired `)`: an answer that writes `a, b)` replaces it instead of doubling it."""
    document = open_doc("x = foo()\n")
    context = build_context(document, 8, OPTIONS)
    assert isinstance(context, CompletionContext) and context.line_suffix == ")"
    assert checked_edit(document, context, "a, b)", 30) == Edit(8, 9, "a, b)")


def test_the_holes_of_the_function_around_the_cursor() -> None:
    text = ("def f(x):\n    y = 1\n    ...\n    # TODO: fix\n    return y\n\n\n"
            "class A:\n    def g(self):\n        raise NotImplementedError\n")  # fmt: skip
    document = open_doc(text)
    assert find_holes(document, 12) == Scope(0, 56, "function_definition", ((24, 27), (32, 43)))
    assert find_holes(document, text.index("raise")) == Scope(72, 118, "function_definition", ((93, 118),))
    assert find_holes(document, len(text) - 1) is None  # outside any function
    assert find_holes(open_doc("hello", "t.txt", "plaintext"), 1) is None  # no grammar


def test_a_configuration_change_gives_a_new_backend_and_forgets_the_old_models_answers(tmp_path: Path) -> None:
    """`CanvasServer.apply_config` (no client needed): another model is another backend object sharing the open
    documents' resolved paths, and the completer's cached answers of the old model go."""
    server = CanvasServer()
    server.backend.watch("file:///work/a.py")
    server.completer.cache["old"] = Answer("len(x)")
    first = server.backend
    server.apply_config({"engine": {"model": str(tmp_path / "other"), "backend": "local"}})
    assert server.backend is not first and server.completer.backend is server.backend
    assert server.backend.paths is server.paths and "file:///work/a.py" in server.paths
    assert server.completer.cache == {} and server.config.engine.model == str(tmp_path / "other")
    same = server.backend
    server.apply_config({"engine": {"model": str(tmp_path / "other"), "backend": "local"},
                         "completion": {"min_confidence": 0.5}})  # fmt: skip
    assert server.backend is same  # the engine's options did not change: the same backend
    assert server.backend.default.identity is None  # nothing loaded yet: no identity to answer for
    assert Identity("local", "m") != Identity("local", "m", "other fingerprint")


def test_a_newer_request_for_a_document_supersedes_the_older() -> None:
    """One running request per document (the completer's, next edits' and the engine's): the newer one's start sets
    the older's flag; the older's end leaves the newer in place; a close cancels it."""
    running: Supersession[CancelFlag] = Supersession()
    with running.running("a.py", CancelFlag(), "key 1") as first:
        assert (running.what("a.py"), first.is_set()) == ("key 1", False)
        with running.running("a.py", CancelFlag(), "key 2") as second, running.running("b.py", CancelFlag()) as other:
            assert (first.is_set(), second.is_set(), other.is_set(), running.what("a.py")) == (True, False, False,
                                                                                                "key 2")  # fmt: skip
        assert running.what("a.py") is None and "b.py" not in running  # both ended
    with running.running("a.py", CancelFlag()) as third:
        running.cancel("a.py")
        assert third.is_set() and len(running) == 0


def test_the_suffix_refresh_option_reaches_the_engine_and_is_checked() -> None:
    """`completion.suffix_refresh` is the engine's setting, asked only when set (else the model's own)."""
    document = open_doc(DOC)
    context = build_context(document, document.index.offset(4, 11), OPTIONS)
    assert isinstance(context, CompletionContext)
    assert "suffix_refresh" not in request_settings(context, OPTIONS, invoked=False).asked()
    asked = request_settings(context, CompletionOptions(suffix_refresh=4), invoked=False).asked()
    assert asked["suffix_refresh"] == 4
    with pytest.raises(ValueError, match="suffix_refresh"):
        CompletionOptions(suffix_refresh=0)
