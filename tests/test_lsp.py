"""The language server over stdio, driven by a real LSP client (pytest-lsp) that launches `canvas-ls serve`.

The model here is the tiny random one: it writes noise, so completions that must survive the syntax check are
asked for inside comments (any text is valid there). What is asserted is the server's behaviour: capabilities,
ranges, cache and typing-through (no model call), cancellation, supersession, and staying up on bad input.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_lsp
from lsprotocol import types
from prometheus_client.parser import text_string_to_metric_families
from pygls.exceptions import JsonRpcException
from pytest_lsp import LanguageClient

from tests.conftest import FIXTURES, SERVE, SERVER

COMMENT_DOC = "import os\n\n\ndef main():\n    # TODO: \n    return os.getcwd()\n"
COMMENT_POS = types.Position(line=4, character=12)  # right after "# TODO: "


def plain(value: Any) -> Any:
    """pygls hands custom results back as named tuples; tests compare plain dicts and lists."""
    if hasattr(value, "_asdict"):
        return {k: plain(v) for k, v in value._asdict().items()}
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


async def request(client: LanguageClient, method: str, params: Any) -> Any:
    return plain(await client.protocol.send_request_async(method, params))


def uri(name: str) -> str:
    return f"file:///work/{name}"


async def wait_ready(client: LanguageClient, timeout: float = 60) -> dict[str, Any]:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        stats = await request(client, "canvas/stats", {})
        state = stats["engine"]["state"]
        if state in ("ready", "failed") or asyncio.get_running_loop().time() > deadline:
            assert state == "ready", stats
            return stats
        await asyncio.sleep(0.1)


def open_doc(client: LanguageClient, name: str, text: str, language: str = "python", version: int = 1) -> None:
    client.text_document_did_open(
        types.DidOpenTextDocumentParams(types.TextDocumentItem(uri(name), language, version, text))
    )


async def inline(client: LanguageClient, name: str, position: types.Position,
                 trigger: types.InlineCompletionTriggerKind = types.InlineCompletionTriggerKind.Automatic,
                 ) -> list[types.InlineCompletionItem]:  # fmt: skip
    result = await client.text_document_inline_completion_async(
        types.InlineCompletionParams(
            text_document=types.TextDocumentIdentifier(uri(name)),
            position=position,
            context=types.InlineCompletionContext(trigger_kind=trigger),
        )
    )
    return list(result.items if isinstance(result, types.InlineCompletionList) else result or [])


async def fill(client: LanguageClient, name: str, position: types.Position) -> dict[str, Any]:
    return await request(
        client,
        "canvas/fill",
        {"textDocument": {"uri": uri(name)}, "position": {"line": position.line, "character": position.character}},
    )


def options(writing_model_dir: Path, backend: str | None = None, **completion: Any) -> dict[str, Any]:
    """The server's options for the tiny model; no backend named means the default (the resident engine).
    Speculation is off unless asked for: background work would make the other tests' timing its hostage."""
    engine = {"model": str(writing_model_dir), "device": "cpu"} | ({"backend": backend} if backend else {})
    return {"engine": engine, "completion": {"speculate": False, **completion}}


@pytest_lsp.fixture(config=SERVER)
async def client(lsp_client: LanguageClient, writing_model_dir: Path):
    params = types.InitializeParams(
        capabilities=pytest_lsp.client_capabilities("neovim"),
        initialization_options=options(writing_model_dir, max_steps=4),
    )
    lsp_client.init_result = await lsp_client.initialize_session(params)
    yield


async def test_initialize_advertises_inline_completion(client: LanguageClient) -> None:
    capabilities = client.init_result.capabilities
    assert capabilities.inline_completion_provider is not None
    assert capabilities.completion_provider is not None
    assert capabilities.text_document_sync.change == types.TextDocumentSyncKind.Incremental
    assert client.init_result.server_info.name == "canvas-ls"


async def test_model_loading_is_reported_as_progress(client: LanguageClient) -> None:
    await wait_ready(client)
    reports = [r for values in client.progress_reports.values() for r in values]
    assert isinstance(reports[0], types.WorkDoneProgressBegin)
    assert isinstance(reports[-1], types.WorkDoneProgressEnd) and "ready" in reports[-1].message


async def test_settings_go_over_the_initialization_options(client: LanguageClient, writing_model_dir: Path) -> None:
    """didChangeConfiguration as clients send it: eglot's empty object and another server's section change nothing
    (they used to reset the model to the default); a canvas-ls section changes the keys it names, the rest stays."""
    await wait_ready(client)
    for settings in ({}, {"pylsp": {"plugins": {}}}):
        client.workspace_did_change_configuration(types.DidChangeConfigurationParams(settings=settings))
    stats = await request(client, "canvas/stats", {})
    assert stats["engine"] == {
        "state": "ready",
        "model": str(writing_model_dir),
        "error": None,
        "steps": None,
    }  # the resident engine counts its steps (its /health)
    open_doc(client, "a.py", COMMENT_DOC)
    settings = {"canvas-ls": {"completion": {"min_confidence": 1.0, "show_head": False}}}
    client.workspace_did_change_configuration(types.DidChangeConfigurationParams(settings=settings))
    hidden = await fill(client, "a.py", COMMENT_POS)
    assert hidden["source"] == "hidden"  # the new threshold, with the model the editor started the server with
    stats = await request(client, "canvas/stats", {})
    assert stats["engine"]["model"] == str(writing_model_dir) and stats["modelCalls"] == 1
    assert not [m for m in client.messages if m.type == types.MessageType.Error]


async def test_inline_completion_in_a_comment_inserts_at_the_cursor(client: LanguageClient) -> None:
    await wait_ready(client)
    open_doc(client, "a.py", COMMENT_DOC)
    items = await inline(client, "a.py", COMMENT_POS)
    assert len(items) == 1
    item = items[0]
    assert item.range == types.Range(COMMENT_POS, COMMENT_POS)
    assert item.insert_text and "\n" not in item.insert_text  # single line: the cursor's line has text


@pytest.mark.parametrize(
    ("fixture", "language"),
    [("python/stats.py", "python"), ("javascript/cart.js", "javascript"), ("go/shapes.go", "go")],
)
async def test_inline_completion_in_fixtures(client: LanguageClient, fixture: str, language: str) -> None:
    """In each fixture, complete after the "TODO: " comment: an item at the cursor, on one line."""
    await wait_ready(client)
    text = (FIXTURES / fixture).read_text()
    if "TODO: " not in text:
        text = text.replace("    m = mean(values)\n", "    # TODO: \n    m = mean(values)\n")
    line = next(i for i, row in enumerate(text.split("\n")) if row.rstrip().endswith("TODO:"))
    character = len(text.split("\n")[line].encode("utf-8"))  # the negotiated encoding is utf-8 (Neovim's first)
    open_doc(client, fixture, text, language)
    response = await fill(client, fixture, types.Position(line, character))
    assert response["result"]["prefix_tokens"] > 10 and response["result"]["layout"] == "canvas"
    items = await inline(client, fixture, types.Position(line, character))
    assert len(items) == 1
    assert items[0].range.start == types.Position(line, character) == items[0].range.end
    assert "\n" not in items[0].insert_text


async def test_same_context_is_answered_from_the_cache(client: LanguageClient) -> None:
    await wait_ready(client)
    open_doc(client, "a.py", COMMENT_DOC)
    first = await fill(client, "a.py", COMMENT_POS)
    again = await fill(client, "a.py", COMMENT_POS)
    assert first["source"] == "model" and again["source"] == "cache"
    assert again["edit"]["text"] == first["edit"]["text"]
    timings = (await request(client, "canvas/stats", {}))["modelCallMs"]  # one model call, timed (bench lsp's split)
    assert len(timings) == 1 and 0 < timings[0]["engine"] <= timings[0]["call"]


async def test_a_document_in_a_git_repository_is_answered_with_its_token_cache(client: LanguageClient,
                                                                              tmp_path: Path) -> None:  # fmt: skip
    """The resident engine finds the document's repository (the git root above its file), builds its token cache in
    the background on the first request there, and mixes it into the next ones: the random model then writes what
    the repository writes after `return` (the tiny tokenizer's lone space first, which healing would bar after a
    typed space, hence no space after `return`). The server's steps are capped at 4 here, and a slot's context is
    known once the slot before it is accepted: the first 4 tokens, ` `, `r`, `en`, `de`, come from the cache."""
    import subprocess

    await wait_ready(client)
    repo = tmp_path / "repo"
    (repo / "app").mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    views = "".join(f"def handler_{i}(request):\n    return render(request, items)\n\n" for i in range(20))
    (repo / "app" / "views.py").write_text(views)
    answers = []
    document = repo / "app" / "new.py"
    for attempt in range(20):  # a new text each time: the server's own cache would answer the same context (and
        # one document: other open ones would come into the context block, and their `return` ends the line there)
        text = f"def handler(request_{attempt}):\n    return"
        if attempt == 0:
            client.text_document_did_open(types.DidOpenTextDocumentParams(
                types.TextDocumentItem(document.as_uri(), "python", 1, text)))  # fmt: skip
        else:
            client.text_document_did_change(types.DidChangeTextDocumentParams(
                types.VersionedTextDocumentIdentifier(version=attempt + 1, uri=document.as_uri()),
                [types.TextDocumentContentChangeWholeDocument(text)]))  # fmt: skip
        response = await request(client, "canvas/fill", {"textDocument": {"uri": document.as_uri()},
                                                         "position": {"line": 1, "character": 10}})  # fmt: skip
        answers.append(response["result"]["text"])
        if answers[-1].startswith(" rende"):
            break
        await asyncio.sleep(0.2)
    assert answers[-1].startswith(" rende"), answers
    assert not answers[0].startswith(" rende")  # the first request ran before the cache was built


async def test_typing_through_is_answered_without_a_model_call(client: LanguageClient) -> None:
    await wait_ready(client)
    open_doc(client, "a.py", COMMENT_DOC)
    first = await fill(client, "a.py", COMMENT_POS)
    shown = first["edit"]["text"]
    assert len(shown) >= 2, shown
    calls = (await request(client, "canvas/stats", {}))["modelCalls"]
    typed = shown[:1]
    client.text_document_did_change(
        types.DidChangeTextDocumentParams(
            text_document=types.VersionedTextDocumentIdentifier(uri=uri("a.py"), version=2),
            content_changes=[
                types.TextDocumentContentChangePartial(range=types.Range(COMMENT_POS, COMMENT_POS), text=typed)
            ],
        )
    )
    encoding = client.init_result.capabilities.position_encoding
    width = len(typed.encode("utf-8")) if encoding == "utf-8" else len(typed.encode("utf-16-le")) // 2
    moved = types.Position(COMMENT_POS.line, COMMENT_POS.character + width)
    items = await inline(client, "a.py", moved)
    assert [i.insert_text for i in items] == [shown[1:]]
    stats = await request(client, "canvas/stats", {})
    assert stats["modelCalls"] == calls and stats["typingHits"] == 1


async def test_answers_the_model_does_not_stand_behind_are_hidden_while_typing(
    client: LanguageClient, writing_model_dir: Path
) -> None:
    """min_confidence: a typing request's answer under it is hidden; a request the user invoked is shown whole;
    canvas/fill and canvas/stats say why. One model call: the cache re-decides. (Cutting to the confident head, on
    answers known in advance: tests/test_display.py.)"""

    def configure(**completion: Any) -> None:
        settings = {"canvas-ls": options(writing_model_dir, max_steps=4, **completion)}
        client.workspace_did_change_configuration(types.DidChangeConfigurationParams(settings=settings))

    await wait_ready(client)
    open_doc(client, "a.py", COMMENT_DOC)
    first = await fill(client, "a.py", COMMENT_POS)  # the tiny model is uncalibrated: its threshold is 0
    assert first["source"] == "model" and first["result"]["min_confidence"] == 0 and first["detail"] is None
    configure(min_confidence=1.0, show_head=False)
    hidden = await fill(client, "a.py", COMMENT_POS)
    assert hidden["source"] == "hidden" and hidden["edit"] is None
    assert hidden["detail"].startswith("hidden: confidence ") and "below 1.00" in hidden["detail"]
    assert hidden["detail"].endswith("invoke a completion to see the model's answer")  # what to do about it
    assert await inline(client, "a.py", COMMENT_POS) == []
    stats = await request(client, "canvas/stats", {})
    assert stats["hidden"] == 2 and stats["last"]["source"] == "hidden" and stats["modelCalls"] == 1
    invoked = await inline(client, "a.py", COMMENT_POS, types.InlineCompletionTriggerKind.Invoked)
    assert len(invoked) == 1 and invoked[0].insert_text.strip()  # asked for: always shown
    configure(min_confidence=0)  # 0 shows everything
    assert (await fill(client, "a.py", COMMENT_POS))["edit"]["text"] == first["edit"]["text"]
    assert (await request(client, "canvas/stats", {}))["modelCalls"] == 2  # the invoked request's own call


async def accept(client: LanguageClient, name: str, at: types.Position, text: str, version: int) -> types.Position:
    """Insert `text` at `at` as the editor does when a suggestion is accepted; the cursor after it."""
    client.text_document_did_change(
        types.DidChangeTextDocumentParams(
            text_document=types.VersionedTextDocumentIdentifier(uri=uri(name), version=version),
            content_changes=[types.TextDocumentContentChangePartial(range=types.Range(at, at), text=text)],
        )
    )
    encoding = client.init_result.capabilities.position_encoding
    width = len(text.encode("utf-8")) if encoding == "utf-8" else len(text.encode("utf-16-le")) // 2
    return types.Position(at.line, at.character + width)


async def speculation(client: LanguageClient, until: str, at_least: int = 1) -> dict[str, int]:
    for _ in range(600):
        counts = (await request(client, "canvas/stats", {}))["speculation"]
        if counts[until] >= at_least:
            return counts
        await asyncio.sleep(0.05)
    raise AssertionError(f"no speculation {until}: {counts}")


async def test_the_next_suggestion_is_ready_when_one_is_accepted(
    client: LanguageClient, writing_model_dir: Path
) -> None:
    """After a suggestion is shown, the one that follows it is computed in the background; accepting it is
    answered from that, without a model call. A change that leaves the suggestion drops it (wasted)."""
    await wait_ready(client)
    settings = {"canvas-ls": options(writing_model_dir, max_steps=4, speculate=True)}
    client.workspace_did_change_configuration(types.DidChangeConfigurationParams(settings=settings))
    open_doc(client, "a.py", COMMENT_DOC)
    shown = (await fill(client, "a.py", COMMENT_POS))["edit"]["text"]
    await speculation(client, "ready")
    calls = (await request(client, "canvas/stats", {}))["modelCalls"]
    after = await accept(client, "a.py", COMMENT_POS, shown, 2)
    answered = await fill(client, "a.py", after)
    stats = await request(client, "canvas/stats", {})
    assert answered["source"] == "speculated" and stats["modelCalls"] == calls
    assert stats["speculation"]["used"] == 1 and stats["speculation"]["wasted"] == 0
    # the speculation started after that answer is dropped by a change that leaves its suggestion behind
    await speculation(client, "started", 2)
    nxt = (answered["edit"] or {"text": ""})["text"]
    await accept(client, "a.py", after, "y" if nxt.startswith("x") else "x", 3)
    counts = await speculation(client, "wasted")
    assert counts["running"] == counts["ready"] == 0


async def prefetch(client: LanguageClient, name: str, at: types.Position, version: int | None = 1,
                   wait: bool = False) -> Any:  # fmt: skip
    """`canvas/prefetch`; without `wait` it must answer at once, with null."""
    document = {"uri": uri(name)} | ({"version": version} if version is not None else {})
    params = {"textDocument": document, "position": {"line": at.line, "character": at.character}}
    answer = await request(client, "canvas/prefetch", params | ({"wait": True} if wait else {}))
    assert wait or answer is None
    return answer


async def test_a_prefetch_answers_the_request_that_follows(client: LanguageClient) -> None:
    """Where the editor says the cursor went, the completion starts before it is asked for; the request then
    joins it (or finds its answer): one model call (the prefetch's). A prefetch for another version of
    the document starts nothing; one for another place is superseded by the request."""
    await wait_ready(client)
    open_doc(client, "a.py", COMMENT_DOC)
    open_doc(client, "b.py", COMMENT_DOC + "\n")
    await prefetch(client, "a.py", COMMENT_POS)
    answered = await fill(client, "a.py", COMMENT_POS)
    stats = await request(client, "canvas/stats", {})
    assert answered["source"] == "prefetched", answered
    assert stats["modelCalls"] == 1 and stats["prefetch"] == {"started": 1, "used": 1}
    assert answered["edit"] is not None and answered["result"] is None  # shown from the cache: no engine result
    moved = await accept(client, "a.py", COMMENT_POS, answered["edit"]["text"][:1], 2)  # typing the suggestion out
    await prefetch(client, "a.py", moved, version=2)  # typing-through answers there: no prefetch starts
    stats = await request(client, "canvas/stats", {})
    assert stats["modelCalls"] == 1 and stats["prefetch"]["started"] == 1

    request_first = asyncio.ensure_future(fill(client, "b.py", COMMENT_POS))  # a prefetch right behind the request
    await asyncio.sleep(0)  # for the same place neither cancels the request nor starts a second model call
    await prefetch(client, "b.py", COMMENT_POS)
    assert (await request_first)["result"] is not None  # answered by its own model call (not cancelled or joined)
    await prefetch(client, "b.py", types.Position(1, 0), version=7)  # changes still on their way: nothing starts
    await prefetch(client, "b.py", types.Position(5, 4), version=None)  # elsewhere: the request supersedes it
    elsewhere = await fill(client, "b.py", types.Position(4, 11))
    assert elsewhere["result"] is not None
    stats = await request(client, "canvas/stats", {})
    assert stats["prefetch"] == {"started": 2, "used": 1} and stats["modelCalls"] == 4  # none for the race
    with pytest.raises(JsonRpcException) as refused:
        await request(client, "canvas/prefetch", {"position": {"line": 0}})
    assert (refused.value.code, refused.value.message) == (-32602, "Invalid params for canvas/prefetch: required field "
                                                           "missing @ $.textDocument; required field missing @ "
                                                           "$.position.character")  # fmt: skip


async def test_a_prefetch_that_waits_says_when_the_request_would_be_answered_at_once(client: LanguageClient) -> None:
    """With `wait: true` the prefetch answers once its completion is computed, {ready: true}, and the request there
    is then answered from it with no model call of its own (the editor can ask without waiting out its
    debounce). Ready again where the answer is cached; not ready for a version the server has not seen."""
    await wait_ready(client)
    open_doc(client, "a.py", COMMENT_DOC)
    assert await prefetch(client, "a.py", COMMENT_POS, wait=True) == {"ready": True}
    stats = await request(client, "canvas/stats", {})
    assert stats["modelCalls"] == 1 and stats["prefetch"] == {"started": 1, "used": 0}
    answered = await fill(client, "a.py", COMMENT_POS)
    assert answered["source"] == "prefetched" and answered["result"] is None, answered
    assert await prefetch(client, "a.py", COMMENT_POS, wait=True) == {"ready": True}  # cached
    assert await prefetch(client, "a.py", COMMENT_POS, version=5, wait=True) == {"ready": False}
    stats = await request(client, "canvas/stats", {})
    assert stats["modelCalls"] == 1 and stats["prefetch"] == {"started": 1, "used": 1}


async def test_completion_fallback_returns_one_text_edit(client: LanguageClient) -> None:
    await wait_ready(client)
    open_doc(client, "a.py", COMMENT_DOC)
    result = await client.text_document_completion_async(
        types.CompletionParams(types.TextDocumentIdentifier(uri("a.py")), COMMENT_POS)
    )
    assert len(result.items) == 1
    edit = result.items[0].text_edit
    assert edit.range == types.Range(COMMENT_POS, COMMENT_POS) and edit.new_text


async def test_no_completion_inside_an_identifier(client: LanguageClient) -> None:
    await wait_ready(client)
    open_doc(client, "a.py", "value = compute_total(3)\n")
    response = await fill(client, "a.py", types.Position(0, 11))  # compu|te_total
    assert response["source"] == "skip:inside an identifier" and response["edit"] is None


@pytest_lsp.fixture(config=SERVER, params=["resident", "local"])
async def slow_client(lsp_client: LanguageClient, writing_model_dir: Path, request: pytest.FixtureRequest):
    """A session whose model calls take 2000 denoising steps per canvas (seconds), unless stopped; with the model
    in the shared engine (the default) and in the server itself."""
    lsp_client.backend = request.param
    params = types.InitializeParams(
        capabilities=pytest_lsp.client_capabilities("neovim"),
        initialization_options=options(writing_model_dir, request.param, max_steps=2000, gap_tokens_single_line=32),
    )
    await lsp_client.initialize_session(params)
    await wait_ready(lsp_client)
    open_doc(lsp_client, "a.py", COMMENT_DOC)
    yield


def make_fast(client: LanguageClient, writing_model_dir: Path) -> None:
    settings = {"canvas-ls": options(writing_model_dir, client.backend, max_steps=2)}
    client.workspace_did_change_configuration(types.DidChangeConfigurationParams(settings=settings))


def resident_engine(writing_model_dir: Path) -> httpx.Client:
    from canvas_ls.engine.paths import default_socket

    transport = httpx.HTTPTransport(uds=str(default_socket(str(writing_model_dir), "cpu")))
    return httpx.Client(transport=transport, base_url="http://engine")


async def steps_taken(client: LanguageClient, writing_model_dir: Path) -> int:
    """The denoising steps the session's engine has taken: the server's (local backend) or the engine's /health."""
    if client.backend == "local":
        return (await request(client, "canvas/stats", {}))["engine"]["steps"]
    with resident_engine(writing_model_dir) as engine:
        return engine.get("/health").json()["steps"]


async def denoising(client: LanguageClient, writing_model_dir: Path, before: int) -> None:
    """Returns once the engine has taken a step past `before`: the request just sent is denoising."""
    for _ in range(1200):
        if await steps_taken(client, writing_model_dir) > before:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the request never reached the engine")


async def cancellations(client: LanguageClient, writing_model_dir: Path) -> tuple[int, float]:
    """How many requests were cancelled mid-denoising and their steps in all: from the server (local backend), or
    from the engine's /metrics (resident: the server only drops the connection; the engine sees it and stops)."""
    if client.backend == "local":
        steps = (await request(client, "canvas/stats", {}))["cancelledAfterSteps"]
        return len(steps), sum(steps)
    with resident_engine(writing_model_dir) as engine:
        metrics = {s.name: s.value for f in text_string_to_metric_families(engine.get("/metrics").text)
                   for s in f.samples if f.name == "canvas_cancelled_after_steps"}  # fmt: skip
    return int(metrics["canvas_cancelled_after_steps_count"]), metrics["canvas_cancelled_after_steps_sum"]


async def test_cancel_request_stops_denoising_at_the_next_step(
    slow_client: LanguageClient, writing_model_dir: Path
) -> None:
    count, steps = await cancellations(slow_client, writing_model_dir)
    before = await steps_taken(slow_client, writing_model_dir)
    pending = asyncio.ensure_future(
        slow_client.protocol.send_request_async(
            "canvas/fill", {"textDocument": {"uri": uri("a.py")}, "position": {"line": 4, "character": 12}}, msg_id=9001
        )
    )
    await denoising(slow_client, writing_model_dir, before)
    slow_client.protocol.notify("$/cancelRequest", types.CancelParams(id=9001))
    with pytest.raises(Exception, match="cancel"):
        await asyncio.wait_for(pending, 60)
    make_fast(slow_client, writing_model_dir)
    after = await fill(slow_client, "a.py", types.Position(4, 11))  # the worker is free for the next request
    assert after["result"] is not None and after["result"]["steps"] <= 2 * after["result"]["canvases"], after["source"]
    for _ in range(100):  # the engine learns of the cancel from the dropped connection, within its next step
        if (now := await cancellations(slow_client, writing_model_dir))[0] > count:
            break
        await asyncio.sleep(0.1)
    assert now[0] == count + 1
    assert 0 < now[1] - steps < 2000  # denoising stopped mid-canvas, not at its step cap


async def test_newer_request_supersedes_the_older(slow_client: LanguageClient, writing_model_dir: Path) -> None:
    before = await steps_taken(slow_client, writing_model_dir)
    older = asyncio.ensure_future(fill(slow_client, "a.py", COMMENT_POS))
    await denoising(slow_client, writing_model_dir, before)
    make_fast(slow_client, writing_model_dir)
    newer = await fill(slow_client, "a.py", types.Position(4, 11))
    assert (await asyncio.wait_for(older, 60))["source"] == "cancelled"
    assert newer["result"] is not None  # the newer request reached the model


# -- bad input: the server answers empty (or with a clear error) and stays up --------------------------------------


async def still_up(client: LanguageClient) -> None:
    """The server answers, and its model is (or becomes) ready."""
    assert (await wait_ready(client))["engine"]["state"] == "ready"


async def test_request_while_the_model_is_loading_is_empty(client: LanguageClient) -> None:
    open_doc(client, "a.py", COMMENT_DOC)
    response = await fill(client, "a.py", COMMENT_POS)
    assert response["source"] == "not ready:the model is still loading" and response["edit"] is None
    await still_up(client)


@pytest.mark.parametrize("position", [types.Position(4, 500), types.Position(99, 0)])
async def test_position_past_the_end(client: LanguageClient, position: types.Position) -> None:
    await wait_ready(client)
    open_doc(client, "a.py", COMMENT_DOC)
    if position.line == 99:
        assert (await fill(client, "a.py", position))["source"] == "skip:position past the end"
    else:  # past the end of the line: the end of the line, as the spec says
        assert (await fill(client, "a.py", position))["result"] is not None  # asked at the line's end
    assert await inline(client, "a.py", types.Position(99, 0)) == []
    await still_up(client)


async def test_unknown_uri(client: LanguageClient) -> None:
    await wait_ready(client)
    assert await inline(client, "never-opened.py", types.Position(0, 0)) == []
    assert (await fill(client, "never-opened.py", types.Position(0, 0)))["source"] == "skip:unknown document"
    await still_up(client)


async def test_changes_out_of_order_never_rewind_the_text(client: LanguageClient) -> None:
    await wait_ready(client)
    open_doc(client, "a.py", "x = 1\n")
    end = types.Position(1, 0)

    def change(version: int, text: str, span: types.Range | None) -> None:
        event = (
            types.TextDocumentContentChangeWholeDocument(text=text)
            if span is None
            else types.TextDocumentContentChangePartial(range=span, text=text)
        )
        client.text_document_did_change(
            types.DidChangeTextDocumentParams(
                text_document=types.VersionedTextDocumentIdentifier(uri=uri("a.py"), version=version),
                content_changes=[event],
            )
        )

    change(3, "# note: \n", types.Range(end, end))  # version 3 adds a second line
    change(2, "", None)  # version 2 arrives late: it would empty the file
    response = await fill(client, "a.py", types.Position(1, 8))
    assert response["source"] != "skip:position past the end"  # the second line is still there
    await still_up(client)


async def test_a_5_mb_file(client: LanguageClient) -> None:
    await wait_ready(client)
    function = "def f{n}(x):\n    # {n}: \n    return x + {n}\n\n\n"
    text = "".join(function.format(n=n) for n in range(5 * 1024 * 1024 // len(function.format(n=0))))
    last_comment = text.count("\n") - 4  # the '# n: ' line of the last function
    open_doc(client, "big.py", text)
    line = text.split("\n")[last_comment]
    response = await fill(client, "big.py", types.Position(last_comment, len(line)))
    assert response["result"] is not None
    assert response["result"]["prefix_tokens"] <= 1024 + 1  # the window, not 5 MB, reached the model
    await still_up(client)


async def test_non_utf8_bytes(client: LanguageClient) -> None:
    await wait_ready(client)
    text = bytes(range(256)).decode("latin-1") + "\n\ufffd\ufffd = 1\n# note: \n"
    open_doc(client, "bytes.py", text)
    response = await fill(client, "bytes.py", types.Position(text.count("\n") - 1, 8))
    assert response["source"] == "model"  # the position read after the odd bytes, the model asked there
    await still_up(client)


async def test_a_language_with_no_grammar_uses_plain_text(client: LanguageClient) -> None:
    await wait_ready(client)
    open_doc(
        client, "report.cob", "       IDENTIFICATION DIVISION.\n       PROGRAM-ID. HELLO.\n       ", language="cobol"
    )
    items = await inline(client, "report.cob", types.Position(2, 7))
    assert len(items) == 1  # no grammar, no syntax check: the model's text is offered as it is
    await still_up(client)


@pytest_lsp.fixture(config=SERVER)
async def raw_client(lsp_client: LanguageClient):
    """A client the test initializes itself."""
    yield


async def test_a_session_a_test_left_open_or_never_began_ends_at_teardown(writing_model_dir: Path) -> None:
    """The suite's client (`conftest.EndingClient`) at its teardown, `stop`: a server the test left initialized gets
    `shutdown` and `exit`, one never initialized is killed; either way `stop`, which in pytest-lsp waits for the
    process without a limit, returns (a test that failed before its `shutdown_session` held the suite for 17 minutes
    once)."""
    for initialize, code in ((True, 0), (False, -signal.SIGKILL)):
        client = await SERVER.start()
        if initialize:
            capabilities = pytest_lsp.client_capabilities("neovim")
            init = types.InitializeParams(capabilities=capabilities, initialization_options=options(writing_model_dir))
            await client.initialize_session(init)
        process = client._server  # what `stop` ends
        await asyncio.wait_for(client.stop(), 60)
        assert process.returncode == code


async def test_invalid_options_give_a_message_and_defaults(raw_client: LanguageClient, writing_model_dir: Path) -> None:
    lsp_client = raw_client
    params = types.InitializeParams(
        capabilities=pytest_lsp.client_capabilities("neovim"),
        initialization_options={"engine": {"model": str(writing_model_dir)}, "completion": {"gap_tokens": "many"}},
    )
    await lsp_client.initialize_session(params)
    await lsp_client.wait_for_notification(types.WINDOW_SHOW_MESSAGE)
    assert lsp_client.messages[0].message.startswith("Invalid canvas-ls options, using defaults:")
    assert "extra fields found (gap_tokens)" in lsp_client.messages[0].message
    await lsp_client.shutdown_session()


async def test_an_invoked_completion_always_writes_something(raw_client: LanguageClient, tiny_model_dir: Path) -> None:
    """Where the (random) model answers nothing on its own, a completion the user asked for still shows one."""
    capabilities = pytest_lsp.client_capabilities("neovim")
    init = options(tiny_model_dir, max_steps=4)
    await raw_client.initialize_session(types.InitializeParams(capabilities=capabilities, initialization_options=init))
    await wait_ready(raw_client)
    open_doc(raw_client, "a.py", COMMENT_DOC)
    assert await inline(raw_client, "a.py", COMMENT_POS) == []  # the model's own answer here: nothing
    items = await inline(raw_client, "a.py", COMMENT_POS, types.InlineCompletionTriggerKind.Invoked)
    assert len(items) == 1 and items[0].insert_text.strip()
    await raw_client.shutdown_session()


async def test_shutdown_during_a_request(slow_client: LanguageClient, writing_model_dir: Path) -> None:
    before = await steps_taken(slow_client, writing_model_dir)
    pending = asyncio.ensure_future(fill(slow_client, "a.py", COMMENT_POS))
    await denoising(slow_client, writing_model_dir, before)
    await slow_client.shutdown_async(None)
    slow_client.exit(None)
    assert await asyncio.wait_for(slow_client._server.wait(), 60) == 0
    assert pending.done()
    slow_client.capabilities = None  # the session is over; nothing left for the fixture to shut down


async def test_a_disabled_language_is_skipped(raw_client: LanguageClient, writing_model_dir: Path) -> None:
    init = {**options(writing_model_dir), "languages": {"python": False}}
    await raw_client.initialize_session(
        types.InitializeParams(capabilities=pytest_lsp.client_capabilities("neovim"), initialization_options=init)
    )
    open_doc(raw_client, "a.py", COMMENT_DOC)
    assert (await fill(raw_client, "a.py", COMMENT_POS))["source"] == "skip:language disabled"
    open_doc(raw_client, "b.go", "package main\n\n// note: \n", language="go")
    assert (await fill(raw_client, "b.go", types.Position(2, 9)))["source"] != "skip:language disabled"
    await raw_client.shutdown_session()


async def test_serve_over_tcp(writing_model_dir: Path) -> None:
    import socket
    import subprocess

    from pygls.lsp.client import LanguageClient as PlainClient

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([*SERVE, "--tcp", f"127.0.0.1:{port}"], stdin=subprocess.DEVNULL)
    client = PlainClient("tcp-test", "1")
    try:
        for _ in range(200):
            try:
                await client.start_tcp("127.0.0.1", port)
                break
            except OSError:
                await asyncio.sleep(0.1)
        result = await client.initialize_async(
            types.InitializeParams(
                capabilities=types.ClientCapabilities(), initialization_options=options(writing_model_dir)
            )
        )
        assert result.capabilities.inline_completion_provider is not None
        await client.shutdown_async(None)
    finally:
        server.kill()
        server.wait()


def test_the_server_answers_initialize_without_importing_torch(tmp_path: Path) -> None:
    """The language server's process never needs torch (the model runs in the resident engine): `canvas-ls serve`
    answers `initialize` and exits on `exit` with torch never imported (`python -X importtime` lists every import)."""
    import json
    import os
    import subprocess

    def message(payload: dict[str, Any]) -> bytes:
        body = json.dumps(payload).encode()
        return b"Content-Length: %d\r\n\r\n" % len(body) + body

    stdin = message({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"capabilities": {}}})
    stdin += message({"jsonrpc": "2.0", "method": "initialized", "params": {}})
    stdin += message({"jsonrpc": "2.0", "id": 2, "method": "shutdown"}) + message({"jsonrpc": "2.0", "method": "exit"})
    env = {**os.environ, "PYTHONPATH": str(FIXTURES.parent)}  # the checkout, run from elsewhere
    done = subprocess.run([sys.executable, "-X", "importtime", *SERVE[1:]], input=stdin, capture_output=True,
                          timeout=60, cwd=tmp_path, env=env)  # fmt: skip
    assert b'"inlineCompletionProvider"' in done.stdout
    imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.decode().splitlines() if "|" in line]
    assert "canvas_ls.server.lsp" in imported and "lsprotocol.types" in imported
    assert not [name for name in imported if name == "torch" or name.startswith("torch.")]
