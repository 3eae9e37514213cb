"""One completion request, top to bottom:

    document -> position -> enabled? -> context (tree-sitter; snippets of other files) -> typing-through? -> cache?
             -> debounce
             -> engine (off the loop, cancellable) -> still current? -> confident enough? -> edit (shape, range,
             syntax check)

Cheap exits come first and answer None (an empty list for the client), never an error. A newer request for the
same document cancels the older one (its denoising stops at the next step), and a result computed for a document
version that is no longer current is never returned.

After a suggestion is shown, the completion that follows it once accepted is computed in the background
(speculation, as llama.vim does): the document with the suggestion applied, the cursor after it. Accepting the
suggestion (or typing it out) then finds that answer in the cache, or joins it while it runs. A speculation never
delays a real request: any real model call cancels the speculations in flight (the resident engine also runs real
requests first), and a change that makes one useless drops it.

Before a request, the editor may say where the cursor went (`prefetch`: Neovim on entering insert mode or moving the
cursor in it, while its own 200 ms debounce runs): the completion there starts at once, as a real request would, and
the request that follows finds its answer in the cache, or joins it while it runs. A prefetch for another place, or
the request for one, supersedes it like any older request.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from ..engine.supersession import Supersession
from .backend import Answer, CancelFlag, Cancelled, CompletionRequest, Failed, Identity, Settings
from .config import CompletionOptions, ServerConfig
from .context import CompletionContext, Skip, build_context
from .crossfile import Block, CrossFile
from .display import Cut, Hidden, decide
from .documents import Document, DocumentStore
from .edits import Edit, checked_edit
from .personal import Thresholds
from .positions import PositionError
from .silence import Why
from .workspaces import RoutedBackend

log = logging.getLogger(__name__)


class Source(StrEnum):
    """Where a request's outcome came from, or why it shows nothing (`Outcome.reason` says more)."""

    MODEL = "model"  # the model answered it now
    CACHE = "cache"  # an answer computed before for the same context and model
    PREFETCHED = "prefetched"  # ...by the prefetch started where the cursor went
    SPECULATED = "speculated"  # ...by the speculation started when the suggestion before it was shown
    TYPING = "typing"  # the rest of the suggestion on screen, which the user is typing out
    SKIP = "skip"  # no request here (unknown document, position, disabled language, inside a word...)
    RUNNING = "running"  # a prefetch for what is being computed already
    STALE = "stale"  # the document, or the model that answers it, changed while it ran
    SUPERSEDED = "superseded"  # a newer keystroke's request replaced it
    CANCELLED = "cancelled"  # the editor or a newer request cancelled it while it ran
    NOT_READY = "not ready"  # the model is loading or failed to load
    ERROR = "error"  # the engine refused the request, went away or failed
    HIDDEN = "hidden"  # the model does not stand behind its answer enough to show it while typing
    REJECTED = "rejected"  # the answer left nothing to show (empty, or only text that would break the code)


# A prefetch's outcomes after which the request for its place is answered at once (from the cache, or typed through).
PREFETCH_READY = frozenset({Source.PREFETCHED, Source.CACHE, Source.TYPING})


def request_settings(context: CompletionContext, options: CompletionOptions, invoked: bool) -> Settings:
    """The engine settings of a completion request at `context` (`bench calibrate` asks the same)."""
    return Settings(
        min_new_tokens=1 if invoked else None,  # None: the model's own setting
        gap_tokens=context.gap_tokens,
        max_new_tokens=context.max_new_tokens,
        max_prefix_tokens=options.prefix_tokens + context.lead_tokens,
        max_suffix_tokens=options.suffix_tokens,
        max_steps=options.max_steps,
        entropy_bound=options.entropy_bound,
        suffix_refresh=options.suffix_refresh,
        single_line=context.mode == "single_line",
        workspace_cache=options.workspace_cache,
    )


@dataclass
class Outcome:
    """What a request produced, with the why, for logs, benchmarks and tests."""

    edit: Edit | None
    source: Source
    request_id: int
    elapsed_ms: float
    answer: Answer | None = None  # the model's answer, when the model ran for this request
    detail: str | None = None  # what the user should know: why the answer was hidden or cut
    reason: str | None = None  # the skip's, the error's, the stale answer's or the loading model's why
    why: Why | None = None  # nothing shown to the user: which reason of the closed list (`silence.py`)
    identity: Identity | None = None  # the model whose answer this is (the route resolved for the request)
    score: float | None = None  # the shown answer's confidence score, where judged
    calibrated: float | None = None  # the model's own threshold for this kind of request (`personal.py` starts there)

    @property
    def result(self) -> Mapping[str, Any] | None:
        """The backend's whole answer as JSON (`canvas/fill`), made only when asked for: not on the keystroke path."""
        return None if self.answer is None else self.answer.details

    @property
    def label(self) -> str:
        """The source with its reason ("error:the engine answered 401: ..."), as logs, `canvas/fill` and
        `canvas/stats` show it."""
        return str(self.source) if self.reason is None else f"{self.source}:{self.reason}"


@dataclass
class _Remembered:
    """The last completion shown in a document, for typing-through."""

    text: str  # the document text when it was computed
    offset: int
    completion: Edit


@dataclass
class _Speculation:
    """The completion that follows a shown suggestion, computed before the suggestion is accepted."""

    key: str  # the cache key of the request at the end of the accepted suggestion
    before: str  # the document text when the suggestion was shown
    edit: Edit  # the suggestion
    after: str  # the text once it is accepted
    cancel: CancelFlag = field(default_factory=CancelFlag)
    task: asyncio.Task[None] | None = None  # the one computing it (joined by a request that wants it)
    done: bool = False  # its answer is in the cache

    def still_useful(self, text: str) -> bool:
        """Whether the document is the accepted text, or on its way there (the suggestion partly typed out)."""
        if text == self.after:
            return True
        prefix, rest = self.before[: self.edit.start], self.before[self.edit.start :]
        if len(text) < len(prefix) + len(rest) or not text.startswith(prefix) or not text.endswith(rest):
            return False
        return self.edit.text.startswith(text[len(prefix) : len(text) - len(rest)])


@dataclass
class Stats:
    requests: int = 0
    model_calls: int = 0
    cache_hits: int = 0
    typing_hits: int = 0
    errors: int = 0  # model calls that failed (the engine refused the request, went away, or broke)
    last_error: str | None = None
    by_source: dict[str, int] = field(default_factory=dict)
    speculated: int = 0  # next suggestions computed ahead (started)
    speculation_used: int = 0  # ...that answered a request
    speculation_wasted: int = 0  # ...dropped unused (cancelled by a real request or a change, or never asked for)
    heads: int = 0  # answers cut to their confident head
    prefetched: int = 0  # completions started where the editor said the cursor went, before it asked
    prefetch_used: int = 0  # ...that answered the request which followed
    shown: int = 0  # requests that showed a suggestion
    silent: dict[Why, int] = field(default_factory=dict)  # requests that showed nothing, by reason
    # The last requests (newest last): uri, outcome, whether the user asked for it (`canvas/status`)
    recent: deque[tuple[str, Outcome, bool]] = field(default_factory=lambda: deque(maxlen=20))
    # Per answered model call (the last 1,000): the backend call as the server waited on it (ms), and the engine's
    # own encode + denoise time within it (None from servers that do not say); the rest is transport and queueing.
    call_ms: deque[tuple[float, float | None]] = field(default_factory=lambda: deque(maxlen=1000))


class Completer:
    def __init__(self, backend: RoutedBackend, config: ServerConfig,
                 documents: DocumentStore | None = None):  # fmt: skip
        self.backend = backend
        self.config = config
        self.documents = documents  # the other files, for context from them
        self.cross_file = CrossFile()
        # context key -> the model's answer (text, and its tokens' texts and confidences), before shaping
        self.cache: OrderedDict[str, Answer] = OrderedDict()
        self.remembered: dict[str, _Remembered] = {}
        self.in_flight: Supersession[CancelFlag] = Supersession()  # uri -> its newest model call (key, cancel flag)
        self.ids = itertools.count(1)
        self.stats = Stats()
        self.speculations: dict[str, _Speculation] = {}  # uri -> the next suggestion computed ahead
        self.prefetches: dict[str, tuple[str, asyncio.Task[Outcome]]] = {}  # uri -> the last prefetch's key, task
        self.thresholds: Thresholds | None = None  # learned from the user's accepts (`personal.py`)

    @property
    def last(self) -> tuple[str, Outcome] | None:
        """The last request's uri and outcome (`canvas/stats`)."""
        return self.stats.recent[-1][:2] if self.stats.recent else None

    async def complete(self, document: Document | None, line: int, character: int, invoked: bool = False) -> Outcome:
        """`invoked`: the user asked for a completion (a key, a command) rather than the editor on typing; the
        model must then write something (an empty answer would look like canvas-ls ignored the request)."""
        request_id = next(self.ids)
        started = time.perf_counter()
        outcome = await self._complete(document, line, character, request_id, invoked)
        outcome.elapsed_ms = (time.perf_counter() - started) * 1000
        stats = self.stats
        stats.requests += 1
        stats.by_source[outcome.label] = stats.by_source.get(outcome.label, 0) + 1
        if outcome.edit is not None:
            stats.shown += 1
        elif outcome.why is not None:
            stats.silent[outcome.why] = stats.silent.get(outcome.why, 0) + 1
        else:  # every path that shows nothing names its reason (tests/test_silence.py); this one did not
            log.warning("request %d showed nothing without a reason (%s)", request_id, outcome.label)
        if document is not None:
            stats.recent.append((document.uri, outcome, invoked))
        log.info("request %d %s: %s in %.1f ms", request_id, document.uri if document else "?", outcome.label,
                 outcome.elapsed_ms)  # fmt: skip
        if outcome.edit is not None and log.isEnabledFor(logging.DEBUG):  # what was offered (editor e2e tests)
            log.debug("request %d offered %s at offsets %d-%d", request_id, json.dumps(outcome.edit.text),
                      outcome.edit.start, outcome.edit.end)  # fmt: skip
        return outcome

    def prefetch(self, document: Document, line: int, character: int) -> asyncio.Task[Outcome]:
        """Start the completion at (line, character) now, before the editor asks for it there (as it will while
        typing): the answer goes to the cache, for the request to find or join. The task's outcome says whether that
        request would now be answered at once (`PREFETCH_READY`)."""
        task = asyncio.get_running_loop().create_task(self._complete(document, line, character, 0, False, True))
        task.add_done_callback(_log_failure)
        return task

    async def _complete(self, document: Document | None, line: int, character: int, request_id: int,
                        invoked: bool, prefetch: bool = False) -> Outcome:  # fmt: skip
        # One function on purpose (~100 lines): the request path read top to bottom in its numbered steps, each a
        # cheap exit before the next costs more (ARCHITECTURE.md's request path follows it).
        def nothing(source: Source, why: Why | None, reason: str | None = None) -> Outcome:
            return Outcome(None, source, request_id, 0.0, reason=reason, why=why)

        # 1. Document, position, language switch.
        if document is None:
            return nothing(Source.SKIP, Why.NOT_OPEN, "unknown document")
        try:
            offset = document.index.offset(line, character)
        except PositionError:
            return nothing(Source.SKIP, Why.PAST_END, "position past the end")
        if not self.config.enabled(document.language):
            return nothing(Source.SKIP, Why.LANGUAGE_OFF, "language disabled")

        # 2. Context from the syntax tree; cheap exits.
        context = self._context(document, offset)
        if isinstance(context, Skip):
            return nothing(Source.SKIP, context.why, context.reason)

        # 3. Typing through the completion on screen: answer with the rest, no model call (nor a prefetch).
        edit = self._typed_through(document, offset)
        if edit is not None:
            if not prefetch:
                self.stats.typing_hits += 1
            return Outcome(edit, Source.TYPING, request_id, 0.0)

        # 4. Cache, keyed on the context the model would see and on which model answers it (resolved once, from
        #    memory). The same completion already under way, started where the cursor went (a prefetch) or after an
        #    accepted suggestion (a speculation), is joined.
        request = CompletionRequest(context.prefix, context.suffix, request_settings(context, self.config.completion,
                                                                                  invoked), document.uri)  # fmt: skip
        route = self.backend.resolve(document.uri)
        key = self._key(document, context, request.settings, route.identity)
        if prefetch and not self._claim_prefetch(document.uri, key):
            return nothing(Source.CACHE if key in self.cache else Source.RUNNING, None)  # answered, or being answered
        early = None if prefetch else self._early(document.uri, key)
        if early is not None and not early[1].done():
            version = document.version
            await asyncio.shield(early[1])
            if document.version != version:
                return nothing(Source.STALE, Why.CHANGED)  # the document moved on while it ran
        if key in self.cache:
            self.cache.move_to_end(key)
            self.stats.cache_hits += 1
            source = Source.CACHE
            if early is not None:
                source = early[0]
                if source is Source.PREFETCHED:
                    self.stats.prefetch_used += 1
                else:
                    self.speculations.pop(document.uri, None)
                    self.stats.speculation_used += 1
            outcome = self._answer(document, context, offset, self.cache[key], invoked, source, request_id,
                                   route.identity)  # fmt: skip
            self._speculate(document, outcome.edit)
            return outcome

        # 5. Supersede the document's older request; debounce; call the model off the loop.
        version = document.version
        with self.in_flight.running(document.uri, CancelFlag(), key) as cancel:
            if self.config.completion.debounce_ms > 0:
                await asyncio.sleep(self.config.completion.debounce_ms / 1000)
                if cancel.is_set():
                    return nothing(Source.SUPERSEDED, Why.SUPERSEDED)
            self._drop_speculations(running_only=True)  # real requests first
            self.stats.model_calls += 1
            called = time.perf_counter()
            reply = await self.backend.infill(request, cancel, route)
        match reply:
            case Cancelled():
                return nothing(Source.CANCELLED, Why.CANCELLED)
            case Failed(reason, loading=True, why=why):
                return nothing(Source.NOT_READY, why, reason)
            case Failed(reason, why=why):
                log.error("request %d: %s", request_id, reason)
                self.stats.errors += 1
                self.stats.last_error = reason
                return nothing(Source.ERROR, why, reason)
        self.stats.call_ms.append(((time.perf_counter() - called) * 1000, reply.engine_ms))

        # 6. Never answer for a document that has moved on, nor with a model that is no longer the one that answers
        #    it (the configuration changed, a workspace model loaded): such an answer is neither shown nor cached.
        if document.version != version:
            return nothing(Source.STALE, Why.CHANGED)
        if not self._current(document.uri, route.identity):
            return nothing(Source.STALE, Why.CHANGED, "the model changed while it answered")
        self._store(key, reply.cached())
        if prefetch:
            return Outcome(None, Source.PREFETCHED, request_id, 0.0, answer=reply)
        outcome = self._answer(document, context, offset, reply, invoked, Source.MODEL, request_id, route.identity)
        outcome.answer = reply
        self._speculate(document, outcome.edit)
        return outcome

    # -- helpers -------------------------------------------------------------------------------------------------

    def _answer(self, document: Document, context: CompletionContext, offset: int, answer: Answer,
                invoked: bool, source: Source, request_id: int, identity: Identity | None) -> Outcome:  # fmt: skip
        """The model's answer as the edit to show (shaped and syntax-checked): whole when the user asked for it or
        the model stands behind it (at the threshold learned from the user's accepts, where there is one), else its
        confident head, else nothing."""
        options = self.config.completion
        edit = checked_edit(document, context, answer.text, options.max_lines)
        model = identity.model if identity is not None else ""
        learned = (self.thresholds.threshold(document.language, model, answer.min_confidence)
                   if self.thresholds is not None else None)  # fmt: skip
        decision = decide(answer, edit, document.text, invoked, options,
                          lambda head: checked_edit(document, context, head, options.max_lines), learned)  # fmt: skip
        match decision:
            case Hidden(reason, why):
                self._remember(document, offset, None)
                source = Source.HIDDEN if why is Why.LOW_CONFIDENCE else Source.REJECTED
                return Outcome(None, source, request_id, 0.0, detail=reason, why=why, identity=identity)
            case Cut(edit, why):
                self.stats.heads += 1
                self._remember(document, offset, edit)
                return Outcome(edit, source, request_id, 0.0, detail=why, identity=identity)
        self._remember(document, offset, decision.edit)
        return Outcome(decision.edit, source, request_id, 0.0, identity=identity, score=decision.score,
                       calibrated=answer.min_confidence)  # fmt: skip

    def _context(self, document: Document, offset: int) -> CompletionContext | Skip:
        """The windows around the cursor, the prefix led by snippets of the other files of its language."""
        context = build_context(document, offset, self.config.completion)
        block = None if isinstance(context, Skip) else self.lead(document, offset)
        if block is None:
            return context
        return replace(context, prefix=block.text + context.prefix, lead_tokens=self.config.completion.context_tokens)

    def lead(self, document: Document, offset: int) -> Block | None:
        """The snippets of the other files of its language that lead a prompt at `offset` (completions and fills);
        None when `completion.context_tokens` is 0 or nothing there relates to the code around `offset`."""
        budget = self.config.completion.context_tokens
        if self.documents is None or budget <= 0:
            return None
        block = self.cross_file.block(document, offset, self.documents.others(document), budget)
        return block if block is not None and block.text else None

    @staticmethod
    def _key(document: Document, context: CompletionContext, settings: Settings, identity: Identity | None) -> str:
        """The cache's key: the context, the settings, and which model answers this document now (`Route.identity`:
        a switched model, a reloaded folder, a workspace model that has finished loading must never be answered for
        by what another model said). Memory only: no file system, no clock."""
        digest = hashlib.sha1()
        for part in (document.language, context.mode, repr(settings), str(identity), context.prefix, "\0",
                     context.suffix):  # fmt: skip
            digest.update(part.encode("utf-8", "surrogatepass"))
        return digest.hexdigest()

    def _current(self, uri: str, identity: Identity | None) -> bool:
        """Whether the model that answered (`identity`, resolved when the request started) still answers `uri`."""
        return identity is not None and self.backend.resolve(uri).identity == identity

    def reset(self) -> None:
        """The configuration changed: every answer computed ahead or cached goes (their keys name the old identity
        anyway; this frees them and stops the work in flight)."""
        self._drop_speculations(running_only=False)
        self.in_flight.cancel_all()
        self.cache.clear()
        self.remembered.clear()

    # -- the suggestion where the cursor went, started before the editor asks ---------------------------------------

    def _claim_prefetch(self, uri: str, key: str) -> bool:
        """Register the running prefetch as the one computing `key` for `uri`; False when nothing is left to do: the
        answer is cached, or being computed (a model call in flight for it, or the speculation after an accepted
        suggestion)."""
        ahead = self.speculations.get(uri)
        if key in self.cache or self.in_flight.what(uri) == key or (ahead and ahead.key == key):
            return False
        self.prefetches[uri] = (key, asyncio.current_task())  # type: ignore[assignment]
        self.stats.prefetched += 1
        return True

    def _early(self, uri: str, key: str) -> tuple[Source, asyncio.Task[Any]] | None:
        """For a request: the computation of its very answer started before it (its source, "prefetched" or
        "speculated", and its task), if any; a prefetch is taken (it answers one request)."""
        prefetched = self.prefetches.get(uri)
        if prefetched is not None and prefetched[0] == key:
            del self.prefetches[uri]
            return Source.PREFETCHED, prefetched[1]
        ahead = self.speculations.get(uri)
        if ahead is not None and ahead.key == key and ahead.task is not None:
            return Source.SPECULATED, ahead.task
        return None

    # -- the next suggestion, computed ahead ---------------------------------------------------------------------

    def _speculate(self, document: Document, edit: Edit | None) -> None:
        """Compute the completion that follows `edit` once it is accepted, in the background."""
        if edit is not None and self.config.completion.speculate:
            asyncio.get_running_loop().create_task(self._compute_ahead(document, document.version, edit))

    async def _compute_ahead(self, document: Document, version: int, edit: Edit) -> None:
        await asyncio.sleep(0)  # let the answer that shows `edit` go out first: what follows is not on its path
        if document.version != version:
            return  # the document moved on before the speculation started
        accepted = document.edited(edit.start, edit.end, edit.text)
        context = self._context(accepted, edit.start + len(edit.text))
        key = request = None
        route = self.backend.resolve(document.uri)
        if not isinstance(context, Skip):
            request = CompletionRequest(context.prefix, context.suffix,
                                        request_settings(context, self.config.completion, invoked=False),
                                        document.uri, background=True)  # fmt: skip
            key = self._key(accepted, context, request.settings, route.identity)
        running = self.speculations.get(document.uri)
        if running is not None and running.key == key:
            return  # the same suggestion again: its speculation stands
        self._drop(document.uri)
        if key is None or request is None or key in self.cache:
            return
        ahead = _Speculation(key, document.text, edit, accepted.text, task=asyncio.current_task())
        self.speculations[document.uri] = ahead
        self.stats.speculated += 1
        reply = await self.backend.infill(request, ahead.cancel, route)
        if isinstance(reply, Failed):  # real requests report the engine's errors
            log.info("speculation for %s: %s", document.uri, reply.reason)
        elif isinstance(reply, Answer) and not ahead.cancel.is_set() and self._current(document.uri, route.identity):
            self._store(ahead.key, reply.cached())
            ahead.done = True

    def changed(self, document: Document) -> None:
        """After a change: drop the speculation the change made useless."""
        ahead = self.speculations.get(document.uri)
        if ahead is not None and not ahead.still_useful(document.text):
            self._drop(document.uri)

    def _drop(self, uri: str) -> None:
        ahead = self.speculations.pop(uri, None)
        if ahead is not None:
            ahead.cancel.set()
            self.stats.speculation_wasted += 1

    def _drop_speculations(self, running_only: bool) -> None:
        for uri, ahead in list(self.speculations.items()):
            if not (running_only and ahead.done):
                self._drop(uri)

    def _store(self, key: str, answer: Answer) -> None:
        self.cache[key] = answer
        self.cache.move_to_end(key)
        while len(self.cache) > self.config.cache_size:
            self.cache.popitem(last=False)

    def _remember(self, document: Document, offset: int, edit: Edit | None) -> None:
        if edit is None or edit.start != offset:
            self.remembered.pop(document.uri, None)
            return
        self.remembered[document.uri] = _Remembered(document.text, offset, edit)

    def _typed_through(self, document: Document, offset: int) -> Edit | None:
        """When the user typed the start of the last completion, the rest of it, at the new cursor."""
        last = self.remembered.get(document.uri)
        if last is None or offset <= last.offset:
            return None
        typed_len = offset - last.offset
        text = document.text
        typed = text[last.offset : offset]
        shown = last.completion.text
        if typed_len >= len(shown) or not shown.startswith(typed):
            return None
        replaced = last.completion.end - last.completion.start
        if text[: last.offset] != last.text[: last.offset] or text[offset:] != last.text[last.offset :]:
            return None  # something else changed
        return Edit(offset, offset + replaced, shown[typed_len:])

    def forget(self, uri: str) -> None:
        self._drop(uri)
        self.prefetches.pop(uri, None)
        self.cross_file.forget(uri)
        self.remembered.pop(uri, None)
        self.in_flight.cancel(uri)


def _log_failure(task: asyncio.Task[Outcome]) -> None:
    """A background completion's unexpected exception, logged (nobody awaits it)."""
    if not task.cancelled() and task.exception() is not None:
        log.error("prefetch failed", exc_info=task.exception())
