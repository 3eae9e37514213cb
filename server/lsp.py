"""The language server: short handlers that hand off to `completion.Completer`.

Only this module knows about LSP messages. Nothing here writes to stdout: in stdio mode stdout is the protocol
stream, so logs go to stderr (or a file) and, for what the user should see, to `window/logMessage`.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from lsprotocol import types
from pygls.exceptions import JsonRpcInvalidParams
from pygls.lsp.server import LanguageServer

from server.backend import LocalBackend, OpenAIBackend, ResidentBackend
from server.completion import Completer, Outcome
from server.config import ServerConfig, parse_config
from server.documents import DocumentStore

log = logging.getLogger(__name__)
FILL_METHOD = "canvas/fill"
STATS_METHOD = "canvas/stats"
VERSION = "0.1.0"


def make_backend(config: ServerConfig) -> LocalBackend | ResidentBackend | OpenAIBackend:
    options = config.engine
    if options.backend == "resident":
        return ResidentBackend(options.socket, options.idle_exit_s, options.model, options.device)
    if options.backend == "openai":
        key = options.api_key or os.environ.get("CANVAS_LS_API_KEY")
        return OpenAIBackend(options.url or "http://127.0.0.1:8000", key, options.remote_model, options.suffix_mode,
                             options.fim_template)  # fmt: skip
    return LocalBackend()


class CanvasServer(LanguageServer):
    def __init__(self) -> None:
        super().__init__("canvas-ls", VERSION)
        self.documents = DocumentStore()
        self.config = ServerConfig()
        self.backend: LocalBackend | ResidentBackend | OpenAIBackend = make_backend(self.config)
        self.completer = Completer(self.backend, self.config)
        self.pending_messages: list[str] = []
        self.loop: asyncio.AbstractEventLoop | None = None

    def log_to_client(self, message: str, kind: types.MessageType = types.MessageType.Info) -> None:
        log.info(message)
        self.window_log_message(types.LogMessageParams(type=kind, message=f"canvas-ls: {message}"))

    def apply_config(self, options: Any) -> None:
        config, error = parse_config(options)
        if error is not None:
            self.pending_messages.append(error)
        reload = config.engine != self.config.engine or self.backend.state == "idle"
        # A local backend reloads in place; any change that involves another backend gets a new backend object.
        changed = config.engine != self.config.engine
        if changed and {config.engine.backend, self.config.engine.backend} != {"local"}:
            self.backend.shutdown()
            self.backend = make_backend(config)
            self.completer.backend = self.backend
        self.config = config
        self.completer.config = config
        if reload and self.loop is not None:
            self.loop.create_task(self.load_model())

    async def load_model(self) -> None:
        """Load (or reload) the model in the worker, shown as work-done progress when the client supports it."""
        token = f"canvas-ls/load/{id(self)}/{self.backend.state}"
        progress = bool(
            self.client_capabilities.window and self.client_capabilities.window.work_done_progress
        )  # fmt: skip
        if progress:
            try:
                await self.work_done_progress.create_async(token)
                self.work_done_progress.begin(
                    token, types.WorkDoneProgressBegin(title="canvas-ls", message="loading the model")
                )
            except Exception as exc:  # a client that refuses progress still gets its completions
                log.warning("no work-done progress: %s", exc)
                progress = False
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        options = self.config.engine
        self.log_to_client(f"loading model {options.model or '(default)'} on {options.device}")
        self.backend.load(options.model, options.device, lambda _: loop.call_soon_threadsafe(done.set_result, None))
        await done
        if self.backend.state == "ready":
            message = f"model {self.backend.model_name} ready in {self.backend.load_seconds:.1f} s"
            self.log_to_client(message)
        else:
            message = f"model failed to load: {self.backend.error}"
            self.log_to_client(message, types.MessageType.Error)
            self.window_show_message(types.ShowMessageParams(type=types.MessageType.Error, message=message))
        if progress:
            self.work_done_progress.end(token, types.WorkDoneProgressEnd(message=message))


server = CanvasServer()


@server.feature(types.INITIALIZE)
def initialize(ls: CanvasServer, params: types.InitializeParams) -> None:
    ls.documents.encoding = ls.workspace.position_encoding or "utf-16"
    ls.apply_config(params.initialization_options)


@server.feature(types.INITIALIZED)
async def initialized(ls: CanvasServer, params: types.InitializedParams) -> None:
    ls.loop = asyncio.get_running_loop()
    for message in ls.pending_messages:
        ls.window_show_message(types.ShowMessageParams(type=types.MessageType.Warning, message=message))
        ls.log_to_client(message, types.MessageType.Warning)
    ls.pending_messages.clear()
    await ls.load_model()


@server.feature(types.WORKSPACE_DID_CHANGE_CONFIGURATION)
def did_change_configuration(ls: CanvasServer, params: types.DidChangeConfigurationParams) -> None:
    if params.settings is None:
        return
    ls.apply_config(params.settings)
    for message in ls.pending_messages:
        ls.window_show_message(types.ShowMessageParams(type=types.MessageType.Warning, message=message))
    ls.pending_messages.clear()


@server.feature(types.TEXT_DOCUMENT_DID_OPEN)
def did_open(ls: CanvasServer, params: types.DidOpenTextDocumentParams) -> None:
    ls.documents.open(params.text_document)


@server.feature(types.TEXT_DOCUMENT_DID_CHANGE)
def did_change(ls: CanvasServer, params: types.DidChangeTextDocumentParams) -> None:
    ls.documents.change(params)


@server.feature(types.TEXT_DOCUMENT_DID_CLOSE)
def did_close(ls: CanvasServer, params: types.DidCloseTextDocumentParams) -> None:
    ls.completer.forget(params.text_document.uri)
    ls.documents.close(params.text_document.uri)


async def _complete(ls: CanvasServer, uri: str, position: types.Position,
                    invoked: bool = False) -> tuple[Outcome, types.Range | None]:  # fmt: skip
    document = ls.documents.get(uri)
    outcome = await ls.completer.complete(document, position.line, position.character, invoked)
    if outcome.edit is None or document is None:
        return outcome, None
    index = document.index
    start, end = index.position(outcome.edit.start), index.position(outcome.edit.end)
    return outcome, types.Range(types.Position(*start), types.Position(*end))


@server.feature(types.TEXT_DOCUMENT_INLINE_COMPLETION, types.InlineCompletionOptions())
async def inline_completion(ls: CanvasServer, params: types.InlineCompletionParams) -> types.InlineCompletionList:
    invoked = params.context.trigger_kind == types.InlineCompletionTriggerKind.Invoked
    outcome, span = await _complete(ls, params.text_document.uri, params.position, invoked)
    if outcome.edit is None or span is None:
        return types.InlineCompletionList(items=[])
    return types.InlineCompletionList(items=[types.InlineCompletionItem(insert_text=outcome.edit.text, range=span)])


@server.feature(types.TEXT_DOCUMENT_COMPLETION, types.CompletionOptions(trigger_characters=[".", "(", " "]))
async def completion(ls: CanvasServer, params: types.CompletionParams) -> types.CompletionList:
    """For clients without inline completion: one item whose textEdit holds the whole completion."""
    invoked = params.context is not None and params.context.trigger_kind == types.CompletionTriggerKind.Invoked
    outcome, span = await _complete(ls, params.text_document.uri, params.position, invoked)
    if outcome.edit is None or span is None:
        return types.CompletionList(is_incomplete=True, items=[])
    text = outcome.edit.text
    item = types.CompletionItem(
        label=text.split("\n", 1)[0].strip() or text.strip(),
        kind=types.CompletionItemKind.Snippet,
        detail="canvas-ls",
        text_edit=types.TextEdit(range=span, new_text=text),
        insert_text_format=types.InsertTextFormat.PlainText,
        filter_text=text,
        sort_text="0",
    )
    return types.CompletionList(is_incomplete=True, items=[item])


@server.feature(FILL_METHOD)
async def fill(ls: CanvasServer, params: Any) -> dict[str, Any]:
    """`canvas/fill` {textDocument: {uri}, position}: the edit and the engine's whole result."""
    uri = _get(_get(params, "textDocument"), "uri")
    position = _get(params, "position")
    line, character = _get(position, "line"), _get(position, "character")
    if not isinstance(uri, str) or not isinstance(line, int) or not isinstance(character, int):
        raise JsonRpcInvalidParams("canvas/fill wants {textDocument: {uri}, position: {line, character}}")
    outcome, span = await _complete(ls, uri, types.Position(line, character))
    return {
        "source": outcome.source,
        "elapsedMs": round(outcome.elapsed_ms, 2),
        "edit": None if span is None or outcome.edit is None else {
            "range": ls.protocol._converter.unstructure(span), "text": outcome.edit.text,
        },
        "result": outcome.result,
    }  # fmt: skip


@server.feature(STATS_METHOD)
def stats(ls: CanvasServer, params: Any) -> dict[str, Any]:
    """`canvas/stats`: engine state and request counters (model calls, cache and typing-through hits)."""
    counters = ls.completer.stats
    return {
        "engine": {"state": ls.backend.state, "model": ls.backend.model_name, "error": ls.backend.error},
        "requests": counters.requests,
        "modelCalls": counters.model_calls,
        "cacheHits": counters.cache_hits,
        "typingHits": counters.typing_hits,
        "bySource": [{"source": k, "count": v} for k, v in counters.by_source.items()],
        "cancelledAfterSteps": ls.backend.cancelled_after_steps,
        "engineRestarts": getattr(ls.backend, "restarts", 0),
        "modelCallMs": [{"call": call, "engine": engine} for call, engine in counters.call_ms],
    }


def _get(value: Any, key: str) -> Any:
    return value.get(key) if isinstance(value, dict) else getattr(value, key, None)


@server.feature(types.SHUTDOWN)
def shutdown(ls: CanvasServer, params: None) -> None:
    for uri in list(ls.completer.in_flight):
        ls.completer.forget(uri)
    ls.backend.shutdown()
