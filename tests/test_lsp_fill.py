"""Several regions in one canvas through the language server (a real LSP client over stdio): the "Fill holes" and
"Rewrite selection" code actions, their commands (one workspace edit), `canvas/fillRegions`, and bad input.

The fills' answers are known in advance (`ending_model_dir`: one word, then the end), so the tests check the exact
edits applied and the reasons given for what is left out; the cancellation test runs the random model for 800 steps.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Union

import pytest
import pytest_lsp
from lsprotocol import types
from pygls.exceptions import JsonRpcException
from pytest_lsp import LanguageClient

from tests.conftest import SERVER
from tests.test_crossfile import MAIN, UTIL
from tests.test_lsp import open_doc, options, plain, request, uri, wait_ready

SHAPES = """import math


class Circle:
    def __init__(self, r):
        self.r = r

    def area(self):
        ...

    def grow(self, k):
        raise NotImplementedError

    def name(self):
        return "circle"
"""
NOTES = "first line\nsecond line\nthird line\nfourth line\n"


def span(a: int, b: int, c: int, d: int) -> dict[str, Any]:
    return {"start": {"line": a, "character": b}, "end": {"line": c, "character": d}}


def start_client(lsp_client: LanguageClient, model: Path, backend: str, **fill: Any) -> types.InitializeParams:
    lsp_client.applied = []  # the workspace edits the server asked this client to apply
    # lsprotocol's client-side hook reads any code action with a "command" key as a Command (its `command` is then
    # the CodeAction's Command object); the spec tells them apart by `command` being a string. Editors do.
    converter = lsp_client.protocol._converter
    converter.register_structure_hook(
        Union[types.Command, types.CodeAction],  # noqa: UP007 (the union lsprotocol registers its hook for)
        lambda value, _: converter.structure(
            value, types.Command if isinstance(value.get("command"), str) else types.CodeAction
        ),
    )

    @lsp_client.feature(types.WORKSPACE_APPLY_EDIT)
    def apply_edit(params: types.ApplyWorkspaceEditParams) -> types.ApplyWorkspaceEditResult:
        lsp_client.applied.append(params.edit)
        return types.ApplyWorkspaceEditResult(applied=True)

    # The fills' mechanics on the random model's own answers: the token cache of the document would copy NOTES'
    # lines on and on, and no answer would end within its budget (`test_token_cache` fills with it).
    settings = {**options(model, backend, max_steps=4, workspace_cache=0), "fill": fill}
    return types.InitializeParams(
        capabilities=pytest_lsp.client_capabilities("neovim"), initialization_options=settings
    )


async def session(lsp_client: LanguageClient, model: Path, backend: str) -> None:
    await lsp_client.initialize_session(start_client(lsp_client, model, backend, max_steps=4))
    await wait_ready(lsp_client)
    open_doc(lsp_client, "shapes.py", SHAPES)
    open_doc(lsp_client, "notes.txt", NOTES, language="plaintext")


@pytest_lsp.fixture(config=SERVER)
async def client(lsp_client: LanguageClient, ending_model_dir: Path):
    """The model that answers one word and ends (`ending_model_dir`), in the shared engine (the default; the model in
    the server is the cancellation test's other case: a server of its own loads torch and the model, ~6 s a session
    here)."""
    await session(lsp_client, ending_model_dir, "resident")
    yield


async def fill_regions(client: LanguageClient, name: str, regions: list[dict] | None = None, **extra: Any) -> dict:
    params = {"textDocument": {"uri": uri(name)}, **({"regions": regions} if regions is not None else {}), **extra}
    return await request(client, "canvas/fillRegions", params)


async def actions(client: LanguageClient, name: str, selection: dict[str, Any]) -> list[types.CodeAction]:
    result = await client.text_document_code_action_async(types.CodeActionParams(
        types.TextDocumentIdentifier(uri(name)), client.protocol._converter.structure(selection, types.Range),
        types.CodeActionContext(diagnostics=[])))  # fmt: skip
    return list(result or [])


async def test_code_actions_offer_fill_holes_and_rewrite(client: LanguageClient) -> None:
    on_class = await actions(client, "shapes.py", span(3, 6, 3, 6))
    assert [a.title for a in on_class] == ["Fill 2 holes with canvas-ls"]
    assert on_class[0].command.command == "canvas-ls.fillHoles"
    in_method = await actions(client, "shapes.py", span(8, 8, 8, 11))  # "..." selected inside area()
    assert [a.title for a in in_method] == ["Fill 1 hole with canvas-ls", "Rewrite selection with canvas-ls"]
    assert await actions(client, "shapes.py", span(14, 10, 14, 10)) == []  # name(): no placeholder, no selection
    assert [a.title for a in await actions(client, "notes.txt", span(0, 0, 0, 5))] == [
        "Rewrite selection with canvas-ls"
    ]


async def test_fill_holes_and_rewrite_commands(client: LanguageClient) -> None:
    """The command fills both holes of the class in one request and applies them as one workspace edit of the
    version the fill read; "Rewrite selection" rewrites the selected text at the server's rewrite strength. (The
    model writes "None" after indentation, "code" at a line's start: `ending_model_dir`.)"""
    action = (await actions(client, "shapes.py", span(3, 6, 3, 6)))[0]
    result = plain(await client.workspace_execute_command_async(
        types.ExecuteCommandParams(action.command.command, action.command.arguments)))  # fmt: skip
    assert result["error"] is None
    assert [(r["range"], r["status"], r["text"]) for r in result["regions"]] == [
        (span(8, 8, 8, 11), "filled", "None"),
        (span(11, 8, 11, 33), "filled", "None"),
    ]
    assert result["result"]["forward_passes"] == result["result"]["steps"] and len(result["result"]["gaps"]) == 2
    (edit,) = client.applied
    (change,) = edit.document_changes
    assert change.text_document.version == 1 and [e.new_text for e in change.edits] == ["None", "None"]

    argument = {"textDocument": {"uri": uri("notes.txt")}, "range": span(2, 0, 2, 10)}
    command = types.ExecuteCommandParams("canvas-ls.rewriteSelection", [argument])
    result = plain(await client.workspace_execute_command_async(command))
    (region,) = result["regions"]
    assert (region["strength"], region["status"], region["text"]) == (0.5, "filled", "code")  # fill.rewrite_strength
    assert [e.new_text for e in client.applied[1].document_changes[0].edits] == ["code"]


async def test_a_region_left_as_it_was_is_named_with_why(client: LanguageClient) -> None:
    """What the syntax check drops is named, with why, in a window/showMessage; the rest is applied. (`def None(self,
    k):` is no valid Python: the hole over the method's name `grow` stays as it was.)"""
    regions = [{"range": span(8, 8, 8, 11)}, {"range": span(10, 8, 10, 12)}]
    result = await fill_regions(client, "shapes.py", regions, apply=True)
    assert [(r["status"], r["text"]) for r in result["regions"]] == [("filled", "None"), ("syntax", None)]
    assert result["regions"][1]["reason"] == "the answer would add syntax errors"
    (edit,) = client.applied
    assert [e.new_text for e in edit.document_changes[0].edits] == ["None"]
    await asyncio.sleep(0.2)
    said = "canvas-ls: filled 1 of 2 regions; left as they were: 2 (the answer would add syntax errors)"
    assert said in [m.message for m in client.messages]


async def test_fill_regions_in_plain_text_applies_one_edit(client: LanguageClient) -> None:
    """Plain text has no syntax check: every answer that ended within its budget is applied, all in one edit of the
    version the fill read."""
    regions = [{"range": span(1, 0, 1, 6)}, {"range": span(3, 0, 3, 6), "strength": 0.5}]
    result = await fill_regions(client, "notes.txt", regions, apply=True)
    assert result["error"] is None and result["applied"] is True
    assert [(r["strength"], r["status"], r["text"]) for r in result["regions"]] == [
        (1.0, "filled", "code"),
        (0.5, "filled", "code"),
    ]
    (edit,) = client.applied
    (change,) = edit.document_changes
    assert change.text_document.version == 1 and [(e.range.start.line, e.new_text) for e in change.edits] == [
        (1, "code"),
        (3, "code"),
    ]
    # The engine's own limit, refused with a 400 and its reason.
    open_doc(client, "many.txt", "\n".join(f"line {i}" for i in range(12)) + "\n", language="plaintext")
    result = await fill_regions(client, "many.txt", [{"range": span(i, 0, i, 4)} for i in range(10)])
    assert "10 holes, over the limit of 8" in result["error"] and result["edit"] is None


async def test_a_fill_is_led_by_snippets_of_the_other_files(client: LanguageClient) -> None:
    """A fill gets the block a completion at its first region would: the definition of the name used there, from
    another open file of the language, under its path; the engine encodes it (more prefix tokens than the same fill
    with `completion.context_tokens` 0). shapes.py, open too, shares no name with main.py and is left out."""
    open_doc(client, "util.py", UTIL)
    open_doc(client, "main.py", MAIN + "    return cfg\n")
    hole = [{"range": span(4, 17, 4, 17)}]  # after `parse_config(`
    led = await fill_regions(client, "main.py", hole)
    assert led["error"] is None and led["context"] == ["util.py:4"]
    settings = {"canvas-ls": {"completion": {"context_tokens": 0}}}
    client.workspace_did_change_configuration(types.DidChangeConfigurationParams(settings=settings))
    alone = await fill_regions(client, "main.py", hole)
    assert alone["error"] is None and alone["context"] == []
    assert led["result"]["prefix_tokens"] > alone["result"]["prefix_tokens"] + 10


BAD_REGIONS = [
    ([{"range": span(1, 0, 1, 6)}, {"range": span(1, 3, 1, 9)}], "regions 1 and 2 overlap"),
    ([{"range": span(1, 0, 40, 0)}], "region 1 lies outside the document"),
    ([{"range": span(2, 5, 1, 0)}], "region 1 is reversed"),
    ([], "nothing to fill: no hole given"),
    ([{"range": span(1, 0, 1, 2), "strength": 0}], "hole 1: strength must be in (0, 1]"),
]
# Params of the wrong type: refused before the handler runs, from the type (`server/protocol.py`), naming the field.
BAD_REGION_TYPES = [
    ([{"range": span(1, 0, 1, 2), "strength": "hard"}], "expected float, got str @ $.regions[0].strength"),
    ([{"range": {"start": {"line": 1}}}],
     "required field missing @ $.regions[0].range.start.character; required field missing @ $.regions[0].range.end"),
    ("not a list", "expected list, got str @ $.regions"),
]  # fmt: skip


async def test_bad_regions_give_a_clear_error(client: LanguageClient) -> None:
    for regions, error in BAD_REGIONS:
        result = await fill_regions(client, "notes.txt", regions, apply=True)
        assert error in (result["error"] or ""), (regions, result["error"])
        assert result["edit"] is None and client.applied == []
        await asyncio.sleep(0.1)
        assert any(error in m.message for m in client.messages)  # shown to the user
    assert (await request(client, "canvas/stats", {}))["engine"]["state"] == "ready"
    four = await fill_regions(client, "notes.txt", [{"range": span(i, 0, i, 2)} for i in range(4)])
    assert four["error"] is None and len(four["regions"]) == 4  # within the limit of 8: it runs
    # A hole inside a string (no placeholder there) is refused; rewriting a string's text is allowed.
    result = await fill_regions(client, "shapes.py", [{"range": span(14, 16, 14, 19)}])  # inside "circle"
    assert result["error"] == "region 1 is inside a string or comment, where this language has no hole"
    rewrite = await fill_regions(client, "shapes.py", [{"range": span(14, 16, 14, 19), "strength": 0.5}])
    assert rewrite["error"] is None
    # "Fill holes" where there are none, or outside any function or class; a document that is not open.
    result = await fill_regions(client, "shapes.py", position={"line": 14, "character": 10})
    assert result["error"].startswith("no holes here") and result["regions"] == []
    outside = await fill_regions(client, "shapes.py", position={"line": 0, "character": 0})
    assert outside["error"] == "no function or class here to fill holes in"
    unknown = await request(client, "canvas/fillRegions", {"textDocument": {"uri": uri("nope.py")}, "regions": []})
    assert unknown["error"].endswith("is not open")
    for regions, error in BAD_REGION_TYPES:
        params = {"textDocument": {"uri": uri("notes.txt")}, "regions": regions, "apply": True}
        with pytest.raises(JsonRpcException) as refused:
            await request(client, "canvas/fillRegions", params)
        expected = (-32602, f"Invalid params for canvas/fillRegions: {error}")
        assert (refused.value.code, refused.value.message) == expected
    assert client.applied == []


@pytest_lsp.fixture(config=SERVER, params=["local", "resident"])
async def slow_client(lsp_client: LanguageClient, writing_model_dir: Path, request: pytest.FixtureRequest):
    """Fills that take 800 denoising steps (seconds), unless stopped; in the server and in the shared engine."""
    fill = {"max_steps": 800, "gap_tokens": 8, "max_new_tokens": 8}  # no hole grows: one canvas of 800 steps
    await lsp_client.initialize_session(start_client(lsp_client, writing_model_dir, request.param, **fill))
    await wait_ready(lsp_client)
    open_doc(lsp_client, "notes.txt", NOTES, language="plaintext")
    yield


async def test_cancel_mid_fill_and_a_document_changed_during_the_fill(slow_client: LanguageClient) -> None:
    params = {"textDocument": {"uri": uri("notes.txt")}, "regions": [{"range": span(1, 0, 1, 6)}], "apply": True}
    pending = asyncio.ensure_future(slow_client.protocol.send_request_async("canvas/fillRegions", params, msg_id=7001))
    await asyncio.sleep(0.5)
    slow_client.protocol.notify("$/cancelRequest", types.CancelParams(id=7001))
    with pytest.raises(Exception, match="cancel"):
        await asyncio.wait_for(pending, 60)
    assert slow_client.applied == []
    assert (await request(slow_client, "canvas/stats", {}))["engine"]["state"] == "ready"
    # The document changes while the next fill runs: its answers are for the old text, so nothing is applied.
    pending = asyncio.ensure_future(fill_regions(slow_client, "notes.txt", [{"range": span(1, 0, 1, 6)}], apply=True))
    await asyncio.sleep(0.5)
    slow_client.text_document_did_change(types.DidChangeTextDocumentParams(
        types.VersionedTextDocumentIdentifier(version=2, uri=uri("notes.txt")),
        [types.TextDocumentContentChangeWholeDocument(text="a new text\n")]))  # fmt: skip
    result = await asyncio.wait_for(pending, 120)
    assert result["stale"] is True and result["edit"] is None and slow_client.applied == []
    assert result["message"] == "the document changed while the fill ran: nothing applied"
