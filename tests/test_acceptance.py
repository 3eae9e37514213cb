"""Acceptance statistics, local only (`server/acceptance.py`, `canvas-ls stats`): through a real `canvas-ls serve` on
the fixed-answer model, a suggestion accepted whole, one accepted in part, one typed over, each recorded once, none
of their text in the database; a corrupt database moved aside with a message while completion goes on; the bound;
recording off."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import pytest_lsp
from lsprotocol import types
from pytest_lsp import LanguageClient

from canvas_ls.engine.architecture import build_tiny_model
from canvas_ls.server import acceptance
from canvas_ls.server.acceptance import ACCEPTED_COMMAND, Recorder, clear, default_path
from tests.conftest import SERVER, tokenizer_texts
from tests.test_identity import AFTER_RETURN, DOC
from tests.test_lsp import inline, open_doc, request, uri, wait_ready
from tests.test_lsp_fill import span

INVOKED = types.InlineCompletionTriggerKind.Invoked


@pytest_lsp.fixture(config=SERVER)
async def client(lsp_client: LanguageClient):
    yield


async def start(client: LanguageClient, model: Path, **options: Any) -> None:
    init = {"engine": {"model": str(model), "device": "cpu", "backend": "local"},
            "completion": {"speculate": False, "max_new_tokens_single_line": 4}, **options}  # fmt: skip
    capabilities = pytest_lsp.client_capabilities("neovim")
    await client.initialize_session(types.InitializeParams(capabilities=capabilities, initialization_options=init))
    await wait_ready(client)


def stats() -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "canvas_ls.server.cli", "stats", "--json"], capture_output=True,
                          text=True, check=True)  # fmt: skip
    return json.loads(done.stdout)


def type_at(client: LanguageClient, name: str, version: int, line: int, character: int, text: str) -> None:
    point = types.Position(line, character)
    change = types.TextDocumentContentChangePartial(range=types.Range(point, point), text=text)
    client.text_document_did_change(types.DidChangeTextDocumentParams(
        types.VersionedTextDocumentIdentifier(version=version, uri=uri(name)), [change]))  # fmt: skip


async def test_shown_accepted_partly_accepted_and_typed_over_are_each_recorded_without_code(
    client: LanguageClient, fixed_model_dir: Path, private_state_dir: Path
) -> None:
    clear(default_path())  # this test's counts alone
    await start(client, fixed_model_dir)
    open_doc(client, "size.py", DOC)
    first = await inline(client, "size.py", AFTER_RETURN, INVOKED)
    assert [(i.insert_text, i.command.command if i.command else None) for i in first] == [
        ("Nonecodecodecode", ACCEPTED_COMMAND)
    ]  # fmt: skip
    await client.workspace_execute_command_async(
        types.ExecuteCommandParams(ACCEPTED_COMMAND, first[0].command.arguments)
    )
    second = await inline(client, "size.py", AFTER_RETURN, INVOKED)  # shown again (from the cache)
    await client.workspace_execute_command_async(
        types.ExecuteCommandParams(ACCEPTED_COMMAND, [*second[0].command.arguments, 4])
    )  # "None": a word of it
    type_at(client, "size.py", 2, 1, 11, "x")  # typed over what the suggestion offered
    third = await inline(client, "size.py", types.Position(1, 12), INVOKED)
    assert len(third) == 1
    client.text_document_did_close(types.DidCloseTextDocumentParams(types.TextDocumentIdentifier(uri("size.py"))))
    await wait_ready(client)  # the close is handled before this answer
    report = stats()
    counts = {key: report["total"][key] for key in ("shown", "accepted", "partial", "dismissed", "chars_accepted")}
    # first: accepted whole; second: 4 characters, then typed over (dismissed); third: closed unanswered (dismissed)
    assert counts == {"shown": 3, "accepted": 1, "partial": 1, "dismissed": 2, "chars_accepted": 16 + 4}
    assert list(report["by_language"]) == ["python"] and list(report["by_kind"]) == ["completion"]
    assert list(report["by_model"]) == [str(fixed_model_dir)]
    stored = b"".join(p.read_bytes() for p in default_path().parent.glob("stats.sqlite3*"))
    assert b"Nonecode" not in stored and b"return" not in stored  # counts and lengths, never code


async def test_a_word_taken_without_the_accept_command_counts_as_a_partial_accept(
    client: LanguageClient, tmp_path: Path, private_state_dir: Path
) -> None:
    """VS Code runs no command when its "Accept Next Word" takes a part of the ghost text: the server finds the word
    kept where the suggestion was shown, followed by what followed it then, when the document's suggestion is
    settled (here its close; the user may have gone on to a new line): a partial accept of those characters, then
    the rest dismissed. A start typed by hand that ends inside one of the suggestion's words is no partial accept."""
    clear(default_path())
    infill = {"layout": "canvas", "gap_tokens": 8, "max_new_tokens": 4}
    model = build_tiny_model(tmp_path / "words", tokenizer_texts(), infill=infill, writes=(" None",))
    await start(client, model)
    for name, taken in (("word.py", "None"), ("next_line.py", "None\nw = 3"), ("letters.py", "No")):
        open_doc(client, name, "x = 1  # \ny = 2\n")
        shown = await inline(client, name, types.Position(0, 9), INVOKED)
        assert [item.insert_text for item in shown] == ["None None None None"]
        type_at(client, name, 2, 0, 9, taken)  # accept next word's edit; typed by hand
        client.text_document_did_close(types.DidCloseTextDocumentParams(types.TextDocumentIdentifier(uri(name))))
    await wait_ready(client)
    total = stats()["total"]
    assert {key: total[key] for key in ("shown", "accepted", "partial", "dismissed", "chars_accepted")} == {
        "shown": 3, "accepted": 0, "partial": 2, "dismissed": 3, "chars_accepted": 8
    }  # fmt: skip


async def test_every_request_counts_toward_the_shown_rate_and_the_latency(
    client: LanguageClient, fixed_model_dir: Path, private_state_dir: Path
) -> None:
    """Requests that show nothing are counted too, by why (for the shown rate and the latency of every request,
    per day): written when the document closes."""
    clear(default_path())
    await start(client, fixed_model_dir)
    open_doc(client, "size.py", DOC)
    assert len(await inline(client, "size.py", AFTER_RETURN, INVOKED)) == 1
    assert await inline(client, "size.py", types.Position(0, 6)) == []  # inside "size": nothing asked
    client.text_document_did_close(types.DidCloseTextDocumentParams(types.TextDocumentIdentifier(uri("size.py"))))
    await wait_ready(client)
    report = stats()
    total, (day,) = report["total"], report["days"]
    assert (total["requests"], total["shown_rate"], day["requests"], day["shown_rate"]) == (2, 0.5, 2, 0.5)
    assert day["latency_mean_ms"] > 0 and day["latency_p50_ms"] > 0
    assert report["by_language"]["python"]["requests"] == 2
    with sqlite3.connect(default_path()) as db:
        reasons = db.execute("SELECT why, count FROM requests ORDER BY why").fetchall()
    assert reasons == [("", 1), ("inside a word", 1)]


async def test_a_suggestion_typed_through_stays_one_shown_suggestion(
    client: LanguageClient, fixed_model_dir: Path, private_state_dir: Path
) -> None:
    """Typing the start of a shown suggestion shows its rest under the same id: accepted then, it is one suggestion
    shown and accepted, not one dismissed and another shown."""
    clear(default_path())
    await start(client, fixed_model_dir)
    open_doc(client, "size.py", DOC)
    first = await inline(client, "size.py", AFTER_RETURN, INVOKED)
    type_at(client, "size.py", 2, 1, 11, "No")  # the suggestion's own first characters
    rest = await inline(client, "size.py", types.Position(1, 13), INVOKED)
    assert [(i.insert_text, i.command.arguments) for i in rest] == [("necodecodecode", first[0].command.arguments)]
    await client.workspace_execute_command_async(
        types.ExecuteCommandParams(ACCEPTED_COMMAND, rest[0].command.arguments)
    )
    await wait_ready(client)
    total = stats()["total"]
    assert {key: total[key] for key in ("shown", "accepted", "partial", "dismissed")} == {
        "shown": 1, "accepted": 1, "partial": 0, "dismissed": 0,
    }  # fmt: skip


@pytest_lsp.fixture(config=SERVER)
async def editing(lsp_client: LanguageClient, ending_model_dir: Path, private_state_dir: Path):
    """A client that applies the workspace edits the server asks for, as an editor does (each a didChange back), on
    the model that writes one word ("code") and ends."""
    versions: dict[str, int] = {}

    @lsp_client.feature(types.WORKSPACE_APPLY_EDIT)
    def apply_edit(params: types.ApplyWorkspaceEditParams) -> types.ApplyWorkspaceEditResult:
        for change in params.edit.document_changes or []:
            name = change.text_document.uri.rsplit("/", 1)[1]
            versions[name] = versions.get(name, 1) + 1
            lsp_client.text_document_did_change(types.DidChangeTextDocumentParams(
                types.VersionedTextDocumentIdentifier(version=versions[name], uri=change.text_document.uri),
                [types.TextDocumentContentChangePartial(range=e.range, text=e.new_text)
                 for e in reversed(change.edits)]))  # fmt: skip
        return types.ApplyWorkspaceEditResult(applied=True)

    lsp_client.versions = versions
    clear(default_path())
    await start(lsp_client, ending_model_dir, completion={"speculate": False, "workspace_cache": 0})
    yield


async def test_next_edits_fills_and_rewrites_are_recorded_by_what_the_document_keeps(editing: LanguageClient) -> None:
    """Next edits: the edit the key accepts, accepted when the next request finds it applied (the client applies it
    and asks again), dismissed when the document closes without it. A fill kept until the document closes is
    accepted; a rewrite the user undid, dismissed. Each by its kind, none of the text in the database."""
    from tests.test_next_edit import SOURCE, change, next_edit

    open_doc(editing, "mean.py", SOURCE)
    for version, (start, end, text) in enumerate([(4, 9, "a"), (5, 5, "c"), (6, 6, "c")], 2):  # "total" -> "acc"
        change(editing, "mean.py", version, 1, start, end, text)
    first = (await next_edit(editing, "mean.py", 1, 7, version=4))["edits"][0]
    assert (first["range"]["start"]["line"], first["newText"]) == (3, "acc")
    change(editing, "mean.py", 5, 3, 8, 13, "acc")  # the key accepts it: the editor applies it, then asks again
    second = (await next_edit(editing, "mean.py", 3, 8, version=5))["edits"][0]
    assert (second["range"]["start"]["line"], second["newText"]) == (5, "acc")
    editing.text_document_did_close(types.DidCloseTextDocumentParams(types.TextDocumentIdentifier(uri("mean.py"))))

    open_doc(editing, "notes.txt", "first line\nsecond line\nthird line\nfourth line\n", language="plaintext")
    filled = await request(editing, "canvas/fillRegions", {"textDocument": {"uri": uri("notes.txt")}, "apply": True,
                                                           "regions": [{"range": span(1, 0, 1, 6)}]})  # fmt: skip
    assert filled["applied"] is True and [r["text"] for r in filled["regions"]] == ["code"]
    await wait_ready(editing)  # the edit's didChange is in
    await editing.workspace_execute_command_async(
        types.ExecuteCommandParams(
            "canvas-ls.rewriteSelection", [{"textDocument": {"uri": uri("notes.txt")}, "range": span(3, 0, 3, 6)}]
        )
    )
    await wait_ready(editing)
    change(editing, "notes.txt", 4, 3, 0, 4, "fourth")  # undone: "code line" back to "fourth line"
    editing.text_document_did_close(types.DidCloseTextDocumentParams(types.TextDocumentIdentifier(uri("notes.txt"))))
    await wait_ready(editing)
    kinds = {kind: {key: row[key] for key in ("shown", "accepted", "dismissed", "chars_accepted")}
             for kind, row in stats()["by_kind"].items()}  # fmt: skip
    assert kinds == {
        "fill": {"shown": 1, "accepted": 1, "dismissed": 0, "chars_accepted": 4},
        "next edit": {"shown": 2, "accepted": 1, "dismissed": 1, "chars_accepted": 3},
        "rewrite": {"shown": 1, "accepted": 0, "dismissed": 1, "chars_accepted": 0},
    }
    stored = b"".join(p.read_bytes() for p in default_path().parent.glob("stats.sqlite3*"))
    assert [word for word in (b"code", b"third line", b"print", b"+= v") if word in stored] == []  # answers, contexts


async def test_a_corrupt_database_is_moved_aside_and_completion_goes_on(
    client: LanguageClient, fixed_model_dir: Path, private_state_dir: Path
) -> None:
    path = default_path()
    clear(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"this is not a database, " * 100)
    await start(client, fixed_model_dir)
    open_doc(client, "size.py", DOC)
    items = await inline(client, "size.py", AFTER_RETURN, INVOKED)
    assert [i.insert_text for i in items] == ["Nonecodecodecode"]
    await wait_ready(client)
    warnings = [m.message for m in client.messages if "statistics database" in m.message]
    assert len(warnings) == 1 and warnings[0].startswith("canvas-ls: the statistics database was unreadable (file is "
                                                         "not a database): moved to ")  # fmt: skip
    aside = Path(warnings[0].split("moved to ")[1].split(", a new one")[0])
    assert aside.read_bytes().startswith(b"this is not a database")
    again = await inline(client, "size.py", AFTER_RETURN, INVOKED)  # recorded in the new database
    # both: the database was read (and moved aside) for the learned thresholds before the first one was shown
    assert [i.command is not None for i in again] == [True] and stats()["total"]["shown"] == 2


async def test_recording_off_records_nothing(client: LanguageClient, fixed_model_dir: Path) -> None:
    clear(default_path())
    await start(client, fixed_model_dir, statistics=False)
    open_doc(client, "size.py", DOC)
    items = await inline(client, "size.py", AFTER_RETURN, INVOKED)
    assert [(i.insert_text, i.command) for i in items] == [("Nonecodecodecode", None)]
    assert stats()["events"] == 0 and not default_path().exists()


def test_the_database_stays_within_its_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(acceptance, "MAX_EVENTS", 1_000)
    monkeypatch.setattr(acceptance, "PRUNE_EVERY", 100)
    recorder = Recorder(tmp_path / "stats.sqlite3")
    for number in range(3_000):
        recorder.shown(f"file:///d{number % 7}.py", 0, "x" * 5, "completion", "python", "", "m", 10.0)
    with sqlite3.connect(tmp_path / "stats.sqlite3") as db:
        count, newest = db.execute("SELECT count(*), max(id) FROM events").fetchone()
    assert count <= 1_000 + 100 and newest >= 3_000  # the oldest went, the newest stayed


def test_stats_clear_and_a_bad_since(tmp_path: Path) -> None:
    env = {"XDG_STATE_HOME": str(tmp_path)}
    Recorder(tmp_path / "canvas-ls" / "stats.sqlite3").shown("file:///a.py", 0, "x", "completion", "go", "", "m", 1.0)

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        import os

        return subprocess.run([sys.executable, "-m", "canvas_ls.server.cli", "stats", *args], capture_output=True,
                              text=True, env={**os.environ, **env})  # fmt: skip

    assert json.loads(run("--json", "--since", "7d").stdout)["total"]["shown"] == 1
    bad = run("--since", "a week")
    assert (bad.returncode, bad.stderr.strip()) == (2, "canvas-ls: error: --since wants days or hours such as 7d or "
                                                       "12h, got 'a week'")  # fmt: skip
    assert run("--clear").returncode == 0 and json.loads(run("--json").stdout)["events"] == 0


def test_the_user_engine_metrics_count_suggestions_by_fate_kind_and_language(
    tiny_model_dir: Path, private_state_dir: Path, tmp_path: Path
) -> None:
    """The resident engine on the user's socket exposes the statistics' counts on /metrics (read at the scrape),
    counts only."""
    import httpx

    from tests.test_resident import ENGINE, wait_health

    clear(default_path())
    recorder = Recorder()
    for number, (kind, language) in enumerate((("completion", "python"), ("completion", "python"),
                                               ("next edit", "go"))):  # fmt: skip
        recorder.shown(f"file:///{number}", 0, "value", kind, language, "", "m", 10.0)
    recorder.accepted(1, 3)  # 3 characters of the first
    recorder.settle("file:///2", "value and more")  # the next edit is there: accepted
    path = tmp_path / "run" / "engine.sock"
    process = subprocess.Popen([*ENGINE, "--model", str(tiny_model_dir), "--socket", str(path)],
                               stdin=subprocess.DEVNULL)  # fmt: skip
    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(path)), base_url="http://engine", timeout=60) as c:
            wait_health(c)
            lines = [line for line in c.get("/metrics").text.splitlines() if line.startswith("canvas_suggestion")]
    finally:
        process.kill()
        process.wait()
    assert lines == [
        'canvas_suggestions{event="accepted",kind="next edit",language="go"} 1.0',
        'canvas_suggestions{event="partial",kind="completion",language="python"} 1.0',
        'canvas_suggestions{event="shown",kind="completion",language="python"} 2.0',
        'canvas_suggestions{event="shown",kind="next edit",language="go"} 1.0',
        'canvas_suggestion_chars_accepted{kind="next edit",language="go"} 5.0',
        'canvas_suggestion_chars_accepted{kind="completion",language="python"} 3.0',
    ]
