"""The language server's handlers: short functions that hand off to `completion.Completer`, `fill.fill_regions` and
the `Learner`; the server object they run on is `session.CanvasServer`, and every message reaches them through
`wire.Dispatcher`. Only these three modules know about LSP messages. Nothing here writes to stdout: in stdio mode
stdout is the protocol stream, so logs go to stderr (or a file) and, for what the user should see, to
`window/logMessage`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

from lsprotocol import types
from pygls.exceptions import JsonRpcInvalidParams

from ..engine.confidence import HIDDEN
from ..engine.paths import document_repository
from ..engine.regions import Region
from ..engine.workspaces import WORKSPACE_MINUTES, repository_root
from .acceptance import ACCEPTED_COMMAND, AFTER_CHARS, COMPLETION, FILL, NEXT_EDIT, REWRITE
from .backend import CancelFlag, Identity
from .completion import PREFETCH_READY, Outcome, Source
from .config import layered
from .documents import Document
from .fill import FillOutcome, Lead, fill_regions
from .holes import find_holes
from .personal import RESET_THRESHOLD_COMMAND
from .positions import PositionError
from .protocol import (
    FILL_HOLES_COMMAND,
    FILL_METHOD,
    FILL_REGIONS_METHOD,
    LEARN_COMMAND,
    NEXT_EDIT_METHOD,
    PREFETCH_METHOD,
    REWRITE_COMMAND,
    AcceptedArguments,
    FillHolesArgument,
    FillParams,
    FillRegionsParams,
    LearnArgument,
    NextEditParams,
    PrefetchParams,
    RegionParams,
    RewriteArgument,
    argument,
    positional,
)
from .session import CanvasServer
from .silence import MOVED_ON, Why, sentence
from .wire import unstructure
from .workspaces import Learned, LearnJob, uri_path

log = logging.getLogger(__name__)
STATS_METHOD = "canvas/stats"
STATUS_METHOD = "canvas/status"


server = CanvasServer()


@server.feature(types.INITIALIZE)
def initialize(ls: CanvasServer, params: types.InitializeParams) -> None:
    ls.documents.encoding = ls.workspace.position_encoding or "utf-16"
    ls.initialization_options = params.initialization_options
    ls.apply_config(params.initialization_options)
    ls.initialized = True


@server.feature(types.INITIALIZED)
def initialized(ls: CanvasServer, params: types.InitializedParams) -> None:
    ls.loop = asyncio.get_running_loop()
    ls.workspace_refresh = ls.loop.create_task(ls.refresh_workspaces())
    for message in ls.pending_messages:
        ls.window_show_message(types.ShowMessageParams(type=types.MessageType.Warning, message=message))
        ls.log_to_client(message, types.MessageType.Warning)
    ls.pending_messages.clear()
    ls.load_model()  # before any later message is handled: from here on a request sees "loading"


@server.feature(types.WORKSPACE_DID_CHANGE_CONFIGURATION)
def did_change_configuration(ls: CanvasServer, params: types.DidChangeConfigurationParams) -> None:
    if params.settings is None:
        return
    ls.apply_config(layered(ls.initialization_options, params.settings))
    for message in ls.pending_messages:
        ls.window_show_message(types.ShowMessageParams(type=types.MessageType.Warning, message=message))
    ls.pending_messages.clear()


@server.feature(types.TEXT_DOCUMENT_DID_OPEN)
def did_open(ls: CanvasServer, params: types.DidOpenTextDocumentParams) -> None:
    ls.documents.open(params.text_document)
    ls.backend.watch(params.text_document.uri)


@server.feature(types.TEXT_DOCUMENT_DID_CHANGE)
def did_change(ls: CanvasServer, params: types.DidChangeTextDocumentParams) -> None:
    document = ls.documents.change(params)
    if document is not None:
        ls.completer.changed(document)


@server.feature(types.TEXT_DOCUMENT_DID_CLOSE)
def did_close(ls: CanvasServer, params: types.DidCloseTextDocumentParams) -> None:
    closing = ls.documents.get(params.text_document.uri)  # its suggestions: kept or accepted as it closes, or not
    ls.acceptance.settle(params.text_document.uri, closing.text if closing is not None else None)
    ls.acceptance.flush()
    ls.completer.forget(params.text_document.uri)
    ls.next_edits.forget(params.text_document.uri)
    ls.documents.close(params.text_document.uri)


async def _complete(ls: CanvasServer, uri: str, position: types.Position,
                    invoked: bool = False) -> tuple[Outcome, types.Range | None]:  # fmt: skip
    document = ls.documents.get(uri)
    outcome = await ls.completer.complete(document, position.line, position.character, invoked)
    if outcome.source is Source.ERROR:
        ls.show_error_once(outcome.reason or "the engine failed")
    if invoked and outcome.edit is None and outcome.why is not None and outcome.why not in MOVED_ON:
        # the user asked and sees nothing: always say why, where the editor shows messages
        kind = (
            types.MessageType.Info if outcome.source in (Source.HIDDEN, Source.REJECTED) else types.MessageType.Warning
        )
        message = f"canvas-ls: {sentence(outcome.why, outcome.detail or outcome.reason)}"
        ls.window_show_message(types.ShowMessageParams(type=kind, message=message))
    if outcome.edit is None or document is None:
        return outcome, None
    return outcome, _span(document.index, outcome.edit.start, outcome.edit.end)


@server.feature(types.TEXT_DOCUMENT_INLINE_COMPLETION, types.InlineCompletionOptions())
async def inline_completion(ls: CanvasServer, params: types.InlineCompletionParams) -> types.InlineCompletionList:
    invoked = params.context.trigger_kind == types.InlineCompletionTriggerKind.Invoked
    uri = params.text_document.uri
    document = ls.documents.get(uri)
    if document is not None:  # what became of the last suggestion shown here (`acceptance.py`)
        try:
            cursor = document.index.offset(params.position.line, params.position.character)
        except PositionError:
            cursor = None
        ls.acceptance.settle(uri, document.text, cursor)
    outcome, span = await _complete(ls, uri, params.position, invoked)
    if document is not None:  # every request, for the shown rate and the latency (`acceptance.py`)
        why = "" if outcome.edit is not None and span is not None else str(outcome.why or Why.NOTHING_TO_ADD)
        model = outcome.identity.model if outcome.identity is not None else ""
        ls.acceptance.requested(COMPLETION, document.language, model, why, outcome.elapsed_ms)
    if outcome.edit is None or span is None or document is None:
        return types.InlineCompletionList(items=[])
    if outcome.source is Source.TYPING:  # the rest of the suggestion being typed through: still the one shown
        shown = ls.acceptance.still_shown(uri)
    else:
        after = document.text[outcome.edit.end : outcome.edit.end + AFTER_CHARS]  # what a partial accept leaves
        shown = _shown(ls, document, outcome.edit.start, outcome.edit.text, COMPLETION, outcome.elapsed_ms, after,
                       score=outcome.score, calibrated=outcome.calibrated, identity=outcome.identity)  # fmt: skip
    # the editor runs the item's command when the user accepts it: the statistics learn it (whole, or the
    # characters a partial accept took)
    command = None
    if shown is not None:
        command = types.Command(title="canvas-ls: accepted", command=ACCEPTED_COMMAND, arguments=[shown])
    item = types.InlineCompletionItem(insert_text=outcome.edit.text, range=span, command=command)
    return types.InlineCompletionList(items=[item])


def _shown(ls: CanvasServer, document: Document, offset: int, text: str, kind: str, elapsed_ms: float,
           after: str = "", score: float | None = None, calibrated: float | None = None,
           identity: Identity | None = None) -> int | None:  # fmt: skip
    """A suggestion shown in `document` recorded in the statistics (`acceptance.py`): its id, or None."""
    identity = identity or ls.backend.resolve(document.uri).identity
    return ls.acceptance.shown(document.uri, offset, text, kind, document.language,
                               document_repository(document.uri) or "", identity.model if identity else "",
                               elapsed_ms, score, calibrated, after)  # fmt: skip


@server.command(RESET_THRESHOLD_COMMAND)
def reset_threshold_command(ls: CanvasServer, *arguments: Any) -> str:
    """The display thresholds learned from the user's accepts start again from the models' own."""
    ls.thresholds.reset()
    return "the display thresholds start again from the models' own"


@server.command(ACCEPTED_COMMAND)
def accepted_command(ls: CanvasServer, *arguments: Any) -> None:
    """A shown suggestion accepted: [its id, the characters taken (a partial accept; absent: all of it)]."""
    given = positional(arguments, AcceptedArguments, ACCEPTED_COMMAND)
    ls.acceptance.accepted(given.shown, given.chars)


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
async def fill(ls: CanvasServer, params: FillParams) -> dict[str, Any]:
    """`canvas/fill` {textDocument: {uri}, position}: the edit and the engine's whole result."""
    outcome, span = await _complete(ls, params.text_document.uri, params.position)
    return {
        "source": outcome.label,
        "detail": outcome.detail,
        "elapsedMs": round(outcome.elapsed_ms, 2),
        "edit": None if span is None or outcome.edit is None else {
            "range": unstructure(ls.protocol, span), "text": outcome.edit.text,
        },
        "result": outcome.result,
    }  # fmt: skip


@server.feature(PREFETCH_METHOD)
async def prefetch(ls: CanvasServer, params: PrefetchParams) -> dict[str, bool] | None:
    """`canvas/prefetch` {textDocument: {uri, version?}, position, wait?}: the cursor went there (the editor will ask
    for a completion there once its debounce ends); start that completion now. A request rather than a notification
    so that the editor sends its pending changes first; for another version of the document (changes still on their
    way) nothing starts. Answers at once (null), or with `wait: true` once the completion is done: {ready: true} when
    the request for that place would now be answered at once, so that the editor can ask without waiting out the
    rest of its debounce."""
    uri, version, wait = params.text_document.uri, params.text_document.version, params.wait
    line, character = params.position.line, params.position.character
    document = ls.documents.get(uri)
    if document is None or (version is not None and version != document.version):
        return {"ready": False} if wait else None
    task = ls.completer.prefetch(document, line, character)
    if not wait:
        return None
    outcome = await asyncio.shield(task)  # a cancelled wait leaves the completion running for the request
    return {"ready": outcome.source in PREFETCH_READY}


@server.feature(NEXT_EDIT_METHOD)
async def next_edit(ls: CanvasServer, params: NextEditParams) -> dict[str, Any]:
    """`canvas/nextEdit` {textDocument: {uri, version?}, position}: after the user's recent edits in the document,
    the edits that should follow (`server/nextedit.py`), each {textDocument: {uri}, range, newText, confidence,
    predictor, away}, for the document version that was read (`version`); none, with `reason`, when there is nothing
    to suggest, the request was superseded, or the document changed meanwhile (`version` given and not the
    document's: answered at once, stale)."""
    uri, version = params.text_document.uri, params.text_document.version
    document = ls.documents.get(uri)
    if document is None:
        return {"version": None, "edits": [], "reason": f"{uri} is not open"}
    if version is not None and version != document.version:
        return {"version": document.version, "edits": [], "reason": "stale: the document is at another version"}
    try:
        offset = document.index.offset(params.position.line, params.position.character)
    except PositionError:
        raise JsonRpcInvalidParams(f"{NEXT_EDIT_METHOD}: the position is past the end of the document") from None
    ls.acceptance.settle(uri, document.text)  # the edit shown before: accepted (applied by the key) or not
    options = ls.config.next_edit
    others = [] if options.max_documents == 0 else ls.documents.others(document)
    started = time.perf_counter()
    outcome = await ls.next_edits.suggest(document, offset, [d for d in others if ls.documents.get(d.uri)],
                                          ls.backend, options, ls.config.completion.prefix_tokens)  # fmt: skip
    if outcome.failed:
        ls.show_error_once(outcome.reason or "the model failed")
    first = outcome.suggestions[0] if outcome.suggestions else None
    shown_in = ls.documents.get(first.uri) if first is not None else None
    if first is not None and shown_in is not None:  # the edit the next-edit key accepts (`acceptance.py`)
        _shown(ls, shown_in, first.start, first.text, NEXT_EDIT, (time.perf_counter() - started) * 1000,
               shown_in.text[first.end :])  # fmt: skip
    edits = []
    for suggestion in outcome.suggestions:
        index = (ls.documents.get(suggestion.uri) or document).index
        edits.append({
            "textDocument": {"uri": suggestion.uri},
            "range": unstructure(ls.protocol, _span(index, suggestion.start, suggestion.end)),
            "newText": suggestion.text,
            "confidence": suggestion.confidence,
            "predictor": suggestion.predictor,
            "away": suggestion.away,
        })  # fmt: skip
    return {"version": outcome.version, "edits": edits, "reason": outcome.reason}


def _engine_state(ls: CanvasServer) -> dict[str, Any]:
    """The engine as `canvas/status` and `canvas/stats` report it (steps: an in-process engine's; None otherwise)."""
    backend = ls.backend
    return {"state": backend.state, "model": backend.model_name, "error": backend.error, "steps": backend.steps}


@server.feature(STATUS_METHOD)
def status(ls: CanvasServer, params: Any) -> dict[str, Any]:
    """`canvas/status`: the engine's state, the last requests' outcomes (newest first) and how many requests showed
    a suggestion or nothing, per reason of the closed list (`silence.py`; `reasons` gives each its words). Lists of
    objects, not objects keyed by reason: a reason is words ("low confidence"), not an identifier."""
    counters = ls.completer.stats
    last = [{
        "uri": uri,
        "shown": outcome.edit is not None,
        "why": None if outcome.why is None else str(outcome.why),
        "words": None if outcome.why is None else outcome.why.words,
        "detail": outcome.detail or outcome.reason,
        "source": str(outcome.source),
        "invoked": invoked,
        "ms": round(outcome.elapsed_ms, 1),
    } for uri, outcome, invoked in reversed(counters.recent)]  # fmt: skip
    return {
        "engine": _engine_state(ls),
        "requests": counters.requests,
        "shown": counters.shown,
        "silent": [{"why": str(why), "count": count} for why, count in counters.silent.items()],
        "last": last,
        "reasons": [{"why": str(why), "words": why.words} for why in Why],
    }


@server.feature(STATS_METHOD)
def stats(ls: CanvasServer, params: Any) -> dict[str, Any]:
    """`canvas/stats`: engine state and request counters (model calls, cache and typing-through hits)."""
    counters = ls.completer.stats
    return {
        "engine": _engine_state(ls),
        "requests": counters.requests,
        "modelCalls": counters.model_calls,
        "cacheHits": counters.cache_hits,
        "typingHits": counters.typing_hits,
        "contextBlocks": {"built": ls.completer.cross_file.built, "reused": ls.completer.cross_file.reused},
        "hidden": counters.by_source.get("hidden", 0),
        "heads": counters.heads,
        "prefetch": {"started": counters.prefetched, "used": counters.prefetch_used},
        "speculation": {
            "started": counters.speculated,
            "used": counters.speculation_used,
            "wasted": counters.speculation_wasted,
            "running": sum(not ahead.done for ahead in ls.completer.speculations.values()),
            "ready": sum(ahead.done for ahead in ls.completer.speculations.values()),
        },
        "last": None
        if ls.completer.last is None
        else {
            "uri": ls.completer.last[0],
            "source": ls.completer.last[1].label,
            "detail": ls.completer.last[1].detail,
            "why": None if ls.completer.last[1].why is None else str(ls.completer.last[1].why),
        },  # the last completion request: what it gave, or why nothing was shown
        "errors": counters.errors,
        "lastError": counters.last_error,
        "bySource": [{"source": k, "count": v} for k, v in counters.by_source.items()],
        "cancelledAfterSteps": ls.backend.cancelled_after_steps,
        "engineRestarts": ls.backend.restarts,
        # the models tuned on a workspace that this server has started (state "ready" once they answer), and the
        # repositories it is learning now
        "workspaceModels": [{"model": model, "adapter": adapter, "state": backend.state, "name": backend.model_name}
                            for (model, adapter), backend in ls.backend.workspace_backends.items()],
        "learning": [str(root) for root in ls.learner.jobs],
        # the per-call timings (up to 1,000), unless the client asks for the counters alone ({"brief": true})
        "modelCallMs": [] if _get(params, "brief") is True else [
            {"call": call, "engine": engine} for call, engine in counters.call_ms
        ],
    }  # fmt: skip


def _get(value: Any, key: str) -> Any:
    return value.get(key) if isinstance(value, dict) else getattr(value, key, None)


def _position(value: Any) -> tuple[int, int] | None:
    """(line, character) of a JSON position whose two fields are LSP uintegers (0 to 2**31 - 1); None if not."""
    point = (_get(value, "line"), _get(value, "character"))
    if all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**31 for v in point):
        return point
    return None


# -- several regions in one canvas: code actions, their commands, and canvas/fillRegions --------------------------


@server.feature(
    types.TEXT_DOCUMENT_CODE_ACTION,
    types.CodeActionOptions(code_action_kinds=[types.CodeActionKind.RefactorRewrite]),
)
def code_action(ls: CanvasServer, params: types.CodeActionParams) -> list[types.CodeAction]:
    """ "Fill holes" on a function or class with placeholders; "Rewrite selection" on a selection."""
    document = ls.documents.get(params.text_document.uri)
    if document is None:
        return []
    uri, span = params.text_document.uri, params.range
    actions = []
    try:
        scope = find_holes(document, document.index.offset(span.start.line, span.start.character))
    except PositionError:
        return []
    if scope is not None and scope.holes:
        count = len(scope.holes)
        title = f"Fill {count} hole{'s' * (count != 1)} with canvas-ls"
        arguments = [{"textDocument": {"uri": uri}, "position": _unstructure(ls, span.start)}]
        command = types.Command(title, FILL_HOLES_COMMAND, arguments=arguments)
        actions.append(types.CodeAction(title, kind=types.CodeActionKind.RefactorRewrite, command=command))
    if span.start != span.end:
        title = "Rewrite selection with canvas-ls"
        arguments = [{"textDocument": {"uri": uri}, "range": _unstructure(ls, span)}]
        command = types.Command(title, REWRITE_COMMAND, arguments=arguments)
        actions.append(types.CodeAction(title, kind=types.CodeActionKind.RefactorRewrite, command=command))
    return actions


@server.command(FILL_HOLES_COMMAND)
async def fill_holes_command(ls: CanvasServer, *arguments: Any) -> dict[str, Any]:
    """Fill the placeholders of the function or class at `position`, applied as one workspace edit."""
    given = argument(arguments, FillHolesArgument, FILL_HOLES_COMMAND)
    return await _fill_request(ls, FillRegionsParams(given.text_document, position=given.position, apply=True))


@server.command(REWRITE_COMMAND)
async def rewrite_command(ls: CanvasServer, *arguments: Any) -> dict[str, Any]:
    """Rewrite the selected `range` in place (strength: `fill.rewrite_strength`), applied as one workspace edit."""
    given = argument(arguments, RewriteArgument, REWRITE_COMMAND)
    region = RegionParams(given.range, ls.config.fill.rewrite_strength)
    return await _fill_request(ls, FillRegionsParams(given.text_document, regions=[region], apply=True))


@server.feature(FILL_REGIONS_METHOD)
async def fill_regions_request(ls: CanvasServer, params: FillRegionsParams) -> dict[str, Any]:
    """`canvas/fillRegions` {textDocument: {uri}, regions: [{range, strength?}] | position, apply?}: several regions
    (or the holes of the function or class at `position`) in one canvas. Returns the WorkspaceEdit (applied when
    `apply`), each region's answer or why it stayed as it was, and `error` when nothing could run."""
    return await _fill_request(ls, params)


async def _fill_request(ls: CanvasServer, params: FillRegionsParams) -> dict[str, Any]:
    uri, apply = params.text_document.uri, params.apply
    document = ls.documents.get(uri)
    if document is None:
        return _fill_failed(ls, f"{uri} is not open", apply)
    try:
        regions = _regions(document, params)
    except (PositionError, ValueError, TypeError) as exc:
        return _fill_failed(ls, str(exc), apply)
    index = document.index  # the text the fill reads: its regions are reported in it, even if it changes meanwhile
    cancel, lead = CancelFlag(), _lead(ls, document, regions)
    try:
        outcome = await fill_regions(document, regions, ls.backend, ls.config.fill, cancel, lead,
                                     ls.config.completion.workspace_cache)  # fmt: skip
    except asyncio.CancelledError:
        cancel.set()  # the client cancelled the request: the engine stops at its next step
        raise
    current = ls.documents.get(uri)
    stale = current is not document or document.version != outcome.version
    edit = None if stale else _workspace_edit(document, outcome)
    applied = False
    kept = outcome.kept(document.text) if edit is not None and apply else None  # before the editor's change
    if edit is not None and apply:
        response = await ls.workspace_apply_edit_async(types.ApplyWorkspaceEditParams(edit, label="canvas-ls fill"))
        applied = response.applied
    if kept is not None and applied:  # the statistics learn later whether the user kept it or undid it
        rewrite = all(a.region.strength < 1 for a in outcome.answers if a.edit is not None)
        _shown(ls, document, kept[0], kept[1], REWRITE if rewrite else FILL, outcome.elapsed_ms, kept[2])
    message = "the document changed while the fill ran: nothing applied" if stale else outcome.summary()
    left_out = stale or outcome.cancelled or any(answer.edit is None for answer in outcome.answers)
    kind = (
        types.MessageType.Error if outcome.error else types.MessageType.Warning if left_out else types.MessageType.Info
    )
    ls.log_to_client(message, kind)
    if apply and kind != types.MessageType.Info:  # the user should know which regions stayed as they were, and why
        ls.window_show_message(types.ShowMessageParams(type=kind, message=f"canvas-ls: {message}"))
    return {
        "version": outcome.version,
        "edit": None if edit is None else _unstructure(ls, edit),
        "applied": applied,
        "error": outcome.error,
        "cancelled": outcome.cancelled,
        "stale": stale,
        "message": message,
        "elapsedMs": round(outcome.elapsed_ms, 2),
        "regions": [
            {
                "range": _unstructure(ls, _span(index, a.region.start, a.region.end)),
                "strength": a.region.strength,
                "status": a.status,
                "reason": a.reason,
                "text": None if a.edit is None else a.edit.text,
            }
            for a in outcome.answers
        ],
        "context": outcome.context,
        "result": outcome.result,
    }


def _lead(ls: CanvasServer, document: Document, regions: list[Region]) -> Lead | None:
    """The snippets of other files chosen for the code around the first region, as a completion there gets."""
    if not regions:
        return None  # the fill says why it cannot run
    block = ls.completer.lead(document, min(region.start for region in regions))
    options = ls.config.completion
    return None if block is None else Lead(block, options.context_tokens, options.prefix_tokens)


def _regions(document: Document, params: FillRegionsParams) -> list[Region]:
    """The regions to fill: the given ranges, or the placeholders of the function or class at `position`."""
    index = document.index
    if params.regions is None:
        if params.position is None:
            raise ValueError("give 'regions' or a 'position' {line, character}")
        scope = find_holes(document, index.offset(params.position.line, params.position.character))
        if scope is None:
            raise ValueError("no function or class here to fill holes in")
        if not scope.holes:
            raise ValueError("no holes here: this function or class has no placeholder (..., pass # TODO, "
                             "raise NotImplementedError, todo!(), a TODO comment, an empty body)")  # fmt: skip
        return [Region(start, end) for start, end in scope.holes]
    regions = []
    for number, item in enumerate(params.regions, 1):
        start, end = item.range.start, item.range.end
        try:
            offsets = index.offset(start.line, start.character), index.offset(end.line, end.character)
        except PositionError as exc:
            raise ValueError(f"region {number} lies outside the document ({exc})") from exc
        regions.append(Region(*offsets, 1.0 if item.strength is None else item.strength))
    return regions


def _workspace_edit(document: Document, outcome: FillOutcome) -> types.WorkspaceEdit | None:
    """One edit of the document version the fill read (a client holding a newer one rejects it): one undo step."""
    edits = [types.TextEdit(_span(document.index, a.edit.start, a.edit.end), a.edit.text)
             for a in outcome.answers if a.edit is not None]  # fmt: skip
    if not edits:
        return None
    identifier = types.OptionalVersionedTextDocumentIdentifier(version=document.version, uri=document.uri)
    return types.WorkspaceEdit(document_changes=[types.TextDocumentEdit(identifier, edits)])


def _span(index: Any, start: int, end: int) -> types.Range:
    return types.Range(types.Position(*index.position(start)), types.Position(*index.position(end)))


def _fill_failed(ls: CanvasServer, message: str, apply: bool) -> dict[str, Any]:
    ls.log_to_client(f"nothing filled: {message}", types.MessageType.Error)
    if apply:
        ls.window_show_message(types.ShowMessageParams(type=types.MessageType.Error,
                                                       message=f"canvas-ls: nothing filled: {message}"))  # fmt: skip
    return {"edit": None, "applied": False, "error": message, "cancelled": False, "stale": False,
            "message": f"nothing filled: {message}", "regions": [], "context": [], "result": None}  # fmt: skip


def _unstructure(ls: CanvasServer, value: Any) -> Any:
    return unstructure(ls.protocol, value)


# -- a model of the user's own code: "Learn this workspace" --------------------------------------------------------


@server.command(LEARN_COMMAND)
async def learn_workspace_command(ls: CanvasServer, *arguments: Any) -> dict[str, Any]:
    """Tune the configured model on the repository of `folder` (a URI or path; default: the first workspace folder)
    in the background, at the lowest CPU priority; work-done progress while it runs (cancel: it stops, keeps what it
    learnt), a message when it ends. Returns at once: {workspace, minutes} or {error}."""
    given = arguments[0] if arguments else None
    folder = given if isinstance(given, str) else argument(arguments, LearnArgument, LEARN_COMMAND).folder
    if folder is None and ls.workspace.folders:
        folder = next(iter(ls.workspace.folders.values())).uri
    folder = folder or ls.workspace.root_uri or ""
    path = uri_path(folder) if folder.startswith("file:") else Path(folder).expanduser() if folder else None
    error = None
    if ls.config.engine.backend in ("openai", "remote"):
        error = "learning a workspace needs canvas-ls's own engine on this machine (engine.backend local or resident)"
    elif path is None or not path.is_dir():
        error = f"no folder to learn: {folder!r} is not a local folder (open a workspace folder, or pass one)"
    if error is not None or path is None:
        ls.window_show_message(types.ShowMessageParams(type=types.MessageType.Error, message=f"canvas-ls: {error}"))
        return {"error": error}
    root = repository_root(path)
    job = ls.learner.reserve(root)
    if job is None:
        return {"error": f"already learning {root}"}
    minutes = ls.config.engine.learn_minutes or WORKSPACE_MINUTES
    asyncio.get_running_loop().create_task(_learn(ls, job, minutes))
    return {"workspace": str(job.root), "minutes": minutes}


async def _learn(ls: CanvasServer, job: LearnJob, minutes: float) -> None:
    root = job.root
    token = f"canvas-ls/learn/{root}"
    progress = await ls.begin_progress(token, f"canvas-ls: learning {root.name}", "reading the repository",
                                       cancellable=True, percentage=0)  # fmt: skip
    if progress:  # the user cancelled: the run stops, keeps what it learnt and installs it
        cancelled = ls.work_done_progress.tokens.get(token)
        if cancelled is not None:
            cancelled.add_done_callback(lambda _: ls.learner.interrupt(root))

    def report(record: dict[str, Any]) -> None:
        step = record.get("progress")
        if progress and isinstance(step, dict):
            done = min(100, int(100 * step["elapsed_s"] / max(step["budget_s"], 1e-9)))
            text = f"step {step['step']}, loss {step['loss']:.3f}, {step['elapsed_s'] / 60:.1f} of {minutes:g} min"
            ls.work_done_progress.report(token, types.WorkDoneProgressReport(message=text, percentage=done))

    ls.log_to_client(f"learning {root} for {minutes:g} min at the lowest CPU priority")
    final = await ls.learner.learn(job, ls.config.engine.model, minutes, report)
    ls.backend.refresh()  # the model it installed answers from the next request on
    if isinstance(final, Learned):
        done = final.summary
        labels = {"editor_diffusion": "held-out loss where the editor asks", "diffusion": "on random spans"}
        loss = "".join(f"{label} {done[f'eval_before_{key}']:.3f} -> {done[f'eval_{key}']:.3f}; "
                       for key, label in labels.items()
                       if None not in (done.get(f"eval_before_{key}"), done.get(f"eval_{key}")))  # fmt: skip
        used = "its files now use this model" if ls.backend.enabled else "not used: engine.workspace_models is off"
        message = (f"learned {root.name}: {done.get('step')} steps in {done.get('elapsed', 0) / 60:.1f} min "
                   f"({done.get('stopped')}); {loss}{used}{_shown_while_typing(done.get('display'))}")  # fmt: skip
        kind = types.MessageType.Info
    else:
        message, kind = f"learning {root.name} failed: {final.reason}", types.MessageType.Error
    if progress:  # the progress ends before the message says how it went (in that order on the wire)
        ls.work_done_progress.end(token, types.WorkDoneProgressEnd(message=message))
    ls.log_to_client(message, kind)
    ls.window_show_message(types.ShowMessageParams(type=kind, message=f"canvas-ls: {message}"))


def _shown_while_typing(display: dict[str, Any] | None) -> str:
    """What a tuned model's own calibration says it will show while the user types (`train --workspace`)."""
    if not display:
        return ""
    if "error" in display:
        return f"; its display threshold stays the base's ({display['error']})"

    def answers(mode: str, where: str) -> str:
        policy = display["policy"][mode]
        said = f"whose {policy['score']} score is at least {policy['threshold']:.2f} on {where}"
        hidden = policy["threshold"] >= HIDDEN  # a kind of request its calibration stands behind none of
        return f"{said} (none do: nothing is shown there)" if hidden else said

    shown = f"; while typing it shows answers {answers('single_line', 'a begun line')}, and "
    shown += answers("multi_line", "a blank line")
    if display.get("held_out_precision") is None:
        return f"{shown} (none of the held-out lines reached it)"
    return (f"{shown}: {100 * display['held_out_coverage']:.0f}% of the held-out lines, "
            f"{100 * display['held_out_precision']:.0f}% of them good")  # fmt: skip


@server.feature(types.SHUTDOWN)
def shutdown(ls: CanvasServer, params: None) -> None:
    ls.acceptance.flush()  # the requests counted since the last write
    ls.completer.reset()  # every model call and speculation in flight stops
    ls.learner.interrupt_all()  # a run in progress keeps what it learnt and installs it
    ls.backend.shutdown()
