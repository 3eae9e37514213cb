"""Why nothing is shown: every request that shows nothing carries one reason of the closed list (`server/silence.py`),
`canvas/status` counts them, and a request the user asked for that shows nothing says why in the editor. Driven by a
real LSP client over stdio against `canvas-ls serve` with the tiny model."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest_lsp
from lsprotocol import types
from pytest_lsp import LanguageClient

from canvas_ls.server.silence import Why
from tests.conftest import SERVER
from tests.test_lsp import inline, open_doc, options, request, wait_ready

FIXTURE = (Path(__file__).parent.parent / "fixtures" / "python").glob("*.py")


@pytest_lsp.fixture(config=SERVER)
async def client(lsp_client: LanguageClient, writing_model_dir: Path):
    # A threshold the tiny model never reaches: typing requests are hidden unless asked for; Go is turned off.
    init = options(writing_model_dir, max_steps=2, min_confidence=0.99)
    init["languages"] = {"go": False}
    params = types.InitializeParams(capabilities=pytest_lsp.client_capabilities("neovim"), initialization_options=init)
    lsp_client.init_result = await lsp_client.initialize_session(params)
    yield


async def test_every_typing_request_that_shows_nothing_names_its_reason(client: LanguageClient) -> None:
    """200 typing requests at every kind of place in a real file (inside words, after them, blank lines, past the
    end): each one that shows nothing is counted under one reason of the closed list, and `canvas/status` says so."""
    await wait_ready(client)
    text = sorted(FIXTURE)[0].read_text()
    open_doc(client, "typing.py", text)
    lines = text.splitlines()
    places = [(line, column) for line in range(len(lines)) for column in (0, len(lines[line]) // 2, len(lines[line]))]
    places = [*(places * (200 // len(places) + 1))[:199], (len(lines) + 5, 0)]  # the last past the end
    shown = 0
    for line, column in places:
        shown += bool(await inline(client, "typing.py", types.Position(line, column)))
    status = await request(client, "canvas/status", {})
    assert status["requests"] == 200 and status["shown"] == shown
    silent = {item["why"]: item["count"] for item in status["silent"]}
    assert sum(silent.values()) == 200 - shown
    assert set(silent) <= {str(why) for why in Why}
    assert silent[str(Why.PAST_END)] == 1 and silent[str(Why.IN_WORD)] > 0
    assert silent[str(Why.LOW_CONFIDENCE)] > 0  # the tiny model never reaches 0.99
    assert {"why": "low confidence", "words": Why.LOW_CONFIDENCE.words} in status["reasons"]
    newest = status["last"][0]
    assert newest["why"] == "past the end" and newest["shown"] is False and newest["invoked"] is False
    assert len(status["last"]) == 20
    hidden = next(item for item in status["last"] if item["why"] == "low confidence")
    assert hidden["detail"].startswith("hidden: confidence ") and " below 0.99 " in hidden["detail"]


async def test_an_invoked_request_that_shows_nothing_says_why_in_the_editor(client: LanguageClient) -> None:
    await wait_ready(client)
    open_doc(client, "word.py", "value = compute_total(1)\n")
    open_doc(client, "main.go", "package main\n\nfunc main() {\n\t\n}\n", language="go")
    invoked = types.InlineCompletionTriggerKind.Invoked
    assert await inline(client, "word.py", types.Position(0, 10), invoked) == []  # inside "compute_total"
    assert await inline(client, "main.go", types.Position(3, 1), invoked) == []
    assert await inline(client, "word.py", types.Position(0, 10)) == []  # typing: no message
    await asyncio.sleep(0.2)  # the notifications sent before the last answer are in by now
    said = [m.message for m in client.messages if m.type == types.MessageType.Warning]
    assert said == [
        "canvas-ls: no suggestion: the cursor is inside a word (inside an identifier)",
        "canvas-ls: no suggestion: completion is off for this language (the languages option) (language disabled)",
    ]
    status = await request(client, "canvas/status", {})
    assert [(item["why"], item["invoked"]) for item in status["last"]] == [
        ("inside a word", False), ("language off", True), ("inside a word", True)
    ]  # fmt: skip
