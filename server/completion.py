"""One completion request, top to bottom:

    document -> position -> enabled? -> context (tree-sitter) -> typing-through? -> cache? -> debounce
             -> engine (off the loop, cancellable) -> still current? -> edit (shape, range, syntax check)

Cheap exits come first and answer None (an empty list for the client), never an error. A newer request for the
same document cancels the older one (its denoising stops at the next step), and a result computed for a document
version that is no longer current is never returned.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from server.backend import BackendError, BackendNotReady, CancelFlag, LocalBackend, OpenAIBackend, ResidentBackend
from server.config import ServerConfig
from server.context import CompletionContext, Skip, build_context
from server.documents import Document
from server.edits import Edit, checked_edit
from server.positions import PositionError

log = logging.getLogger(__name__)


@dataclass
class Outcome:
    """What a request produced, with the why, for logs, benchmarks and tests."""

    edit: Edit | None
    source: str  # "model", "cache", "typing", or why there is nothing: "skip:...", "stale", "cancelled"...
    request_id: int
    elapsed_ms: float
    result: dict[str, Any] | None = None  # the engine's full result, when the model ran


@dataclass
class _Remembered:
    """The last completion shown in a document, for typing-through."""

    text: str  # the document text when it was computed
    offset: int
    completion: Edit


@dataclass
class Stats:
    requests: int = 0
    model_calls: int = 0
    cache_hits: int = 0
    typing_hits: int = 0
    errors: int = 0  # model calls that failed (the engine refused the request, went away, or broke)
    last_error: str | None = None
    by_source: dict[str, int] = field(default_factory=dict)
    # Per answered model call (the last 1,000): the backend call as the server waited on it (ms), and the engine's
    # own encode + denoise time within it (None from servers that do not say); the rest is transport and queueing.
    call_ms: deque[tuple[float, float | None]] = field(default_factory=lambda: deque(maxlen=1000))


class Completer:
    def __init__(self, backend: LocalBackend | ResidentBackend | OpenAIBackend, config: ServerConfig):
        self.backend = backend
        self.config = config
        self.cache: OrderedDict[str, str] = OrderedDict()  # context key -> model text (before shaping)
        self.remembered: dict[str, _Remembered] = {}
        self.in_flight: dict[str, CancelFlag] = {}  # uri -> cancel flag of its newest request
        self.ids = itertools.count(1)
        self.stats = Stats()

    async def complete(self, document: Document | None, line: int, character: int, invoked: bool = False) -> Outcome:
        """`invoked`: the user asked for a completion (a key, a command) rather than the editor on typing; the
        model must then write something (an empty answer would look like canvas-ls ignored the request)."""
        request_id = next(self.ids)
        started = time.perf_counter()
        outcome = await self._complete(document, line, character, request_id, invoked)
        outcome.elapsed_ms = (time.perf_counter() - started) * 1000
        self.stats.requests += 1
        self.stats.by_source[outcome.source] = self.stats.by_source.get(outcome.source, 0) + 1
        log.info("request %d %s: %s in %.1f ms", request_id, document.uri if document else "?", outcome.source,
                 outcome.elapsed_ms)  # fmt: skip
        return outcome

    async def _complete(self, document: Document | None, line: int, character: int, request_id: int,
                        invoked: bool) -> Outcome:  # fmt: skip
        def nothing(source: str) -> Outcome:
            return Outcome(None, source, request_id, 0.0)

        # 1. Document, position, language switch.
        if document is None:
            return nothing("skip:unknown document")
        try:
            offset = document.index.offset(line, character)
        except PositionError:
            return nothing("skip:position past the end")
        if not self.config.enabled(document.language):
            return nothing("skip:language disabled")

        # 2. Context from the syntax tree; cheap exits.
        context = build_context(document, offset, self.config.completion)
        if isinstance(context, Skip):
            return nothing(f"skip:{context.reason}")

        # 3. Typing through the completion on screen: answer with the rest, no model call.
        edit = self._typed_through(document, offset)
        if edit is not None:
            self.stats.typing_hits += 1
            return Outcome(edit, "typing", request_id, 0.0)

        # 4. Cache, keyed on the context the model would see.
        overrides = self._overrides(context, invoked)
        key = self._key(document, context, overrides)
        if key in self.cache:
            self.cache.move_to_end(key)
            self.stats.cache_hits += 1
            edit = checked_edit(document, context, self.cache[key], self.config.completion.max_lines)
            self._remember(document, offset, edit)
            return Outcome(edit, "cache", request_id, 0.0)

        # 5. Supersede the document's older request; debounce; call the model off the loop.
        cancel = CancelFlag()
        older = self.in_flight.get(document.uri)
        if older is not None:
            older.set()
        self.in_flight[document.uri] = cancel
        version = document.version
        try:
            if self.config.completion.debounce_ms > 0:
                await asyncio.sleep(self.config.completion.debounce_ms / 1000)
                if cancel.is_set():
                    return nothing("superseded")
            self.stats.model_calls += 1
            called = time.perf_counter()
            result = await self.backend.infill(context.prefix, context.suffix, overrides, cancel, document.uri)
        except BackendNotReady as exc:
            return nothing(f"not ready:{exc}")
        except BackendError as exc:
            log.error("request %d: %s", request_id, exc)
            self.stats.errors += 1
            self.stats.last_error = str(exc)
            return nothing(f"error:{exc}")
        finally:
            if self.in_flight.get(document.uri) is cancel:
                del self.in_flight[document.uri]
        if result is None:
            return nothing("cancelled")
        engine_ms = result["encode_ms"] + result["denoise_ms"] if "encode_ms" in result else None
        self.stats.call_ms.append(((time.perf_counter() - called) * 1000, engine_ms))

        # 6. Never answer for a document that has moved on.
        if document.version != version:
            return nothing("stale")
        self._store(key, result["text"])
        edit = checked_edit(document, context, result["text"], self.config.completion.max_lines)
        self._remember(document, offset, edit)
        return Outcome(edit, "model" if edit else "rejected", request_id, 0.0, result)

    # -- helpers -------------------------------------------------------------------------------------------------

    def _overrides(self, context: CompletionContext, invoked: bool) -> dict[str, Any]:
        options = self.config.completion
        return {
            "min_new_tokens": 1 if invoked else None,  # None: the model's own setting
            "gap_tokens": context.gap_tokens,
            "max_new_tokens": context.max_new_tokens,
            "max_prefix_tokens": options.prefix_tokens,
            "max_suffix_tokens": options.suffix_tokens,
            "max_steps": options.max_steps,
            "entropy_bound": options.entropy_bound,
            "single_line": context.mode == "single_line",
        }

    def _key(self, document: Document, context: CompletionContext, overrides: dict[str, Any]) -> str:
        digest = hashlib.sha1()
        for part in (document.language, context.mode, repr(overrides), context.prefix, "\0",
                     context.suffix):  # fmt: skip
            digest.update(part.encode("utf-8", "surrogatepass"))
        return digest.hexdigest()

    def _store(self, key: str, text: str) -> None:
        self.cache[key] = text
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
        self.remembered.pop(uri, None)
        cancel = self.in_flight.pop(uri, None)
        if cancel is not None:
            cancel.set()
