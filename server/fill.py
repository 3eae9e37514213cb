"""Several regions of a document filled in one request, top to bottom:

    document -> regions (the placeholders tree-sitter finds, a selection, or a client's ranges) -> checked (in the
    document, apart, not a hole inside a string or comment) -> [snippets of other files before the prefix, as for
    a completion (`Lead`)] -> engine (one canvas, off the loop, cancellable) -> per region: empty? truncated? adds
    syntax errors? -> edits, and why each region left out stayed as it was

The edits are for the document version the fill read; the caller drops them when the document changed meanwhile.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from itertools import pairwise
from typing import Any

from ..engine.regions import FillError, Region, regions_to_parts
from .backend import Backend, CancelFlag, Cancelled, Failed, FillRequest, Gap
from .config import FillOptions
from .context import prefix_window
from .crossfile import Block
from .documents import Document
from .edits import Edit, adds_syntax_errors
from .holes import inside_string_or_comment

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Lead:
    """Snippets of the other files (`server/crossfile.py`) placed before a fill's prefix. The document before the
    first region is then cut to a completion's prefix window (`prefix_tokens`), so that the engine's cut of an
    over-long prefix (it keeps the end) never drops the block."""

    block: Block
    tokens: int  # the block's budget (`completion.context_tokens`)
    prefix_tokens: int  # the window of the document before the first region (`completion.prefix_tokens`)


@dataclass
class RegionAnswer:
    region: Region
    edit: Edit | None  # None: the region stays as it is (see `reason`)
    status: str  # "filled", or why not: "empty", "truncated", "syntax"
    reason: str = ""


@dataclass
class FillOutcome:
    version: int  # the document version the answers were computed on
    answers: list[RegionAnswer]  # in the order the regions were given
    error: str | None = None  # the fill did not run: why (bad regions, engine refused or failed)
    cancelled: bool = False
    result: Mapping[str, Any] | None = None  # the engine's whole result
    elapsed_ms: float = 0.0
    context: list[str] = field(default_factory=list)  # "path:line" of each snippet of another file the model saw

    def kept(self, text: str) -> tuple[int, str, str] | None:
        """Where its edits, applied to `text` (the text it read), leave the filled span: its start, its text and
        what follows it, in the text as edited (what the statistics check later: `acceptance.Pending`); None when
        nothing was filled."""
        edits = sorted((answer.edit for answer in self.answers if answer.edit is not None), key=lambda e: e.start)
        if not edits:
            return None
        start = edits[0].start
        span = "".join(text[left.end : right.start] + right.text for left, right in pairwise(edits))
        return start, edits[0].text + span, text[edits[-1].end :]

    def summary(self) -> str:
        """One line for the user: what was filled and why the rest was not."""
        if self.error is not None:
            return f"nothing filled: {self.error}"
        if self.cancelled:
            return "fill cancelled: nothing applied"
        filled = sum(1 for answer in self.answers if answer.edit is not None)
        left = [f"{i + 1} ({answer.reason})" for i, answer in enumerate(self.answers) if answer.edit is None]
        line = f"filled {filled} of {len(self.answers)} region{'s' * (len(self.answers) != 1)}"
        return line + (f"; left as they were: {', '.join(left)}" if left else "")


REASONS = {
    "empty": "the model wrote nothing there",
    "truncated": "the answer did not end within its token budget",
    "syntax": "the answer would add syntax errors",
}


async def fill_regions(document: Document, regions: list[Region], backend: Backend, options: FillOptions,
                       cancel: CancelFlag, lead: Lead | None = None,
                       workspace_cache: float | None = None) -> FillOutcome:  # fmt: skip
    started = time.perf_counter()
    version, text = document.version, document.text
    settings, context = options.settings(workspace_cache), []
    try:
        parts = regions_to_parts(text, regions)
        for number, region in enumerate(regions, 1):
            if region.strength >= 1 and inside_string_or_comment(document, region.start, region.end):
                raise FillError(f"region {number} is inside a string or comment, where this language has no hole")
    except FillError as exc:
        return FillOutcome(version, [], error=str(exc))
    if lead is not None:
        parts[0] = lead.block.text + prefix_window(document, len(parts[0]), lead.prefix_tokens)
        settings = replace(settings, max_prefix_tokens=lead.prefix_tokens + lead.tokens)
        context = [f"{snippet.path}:{snippet.line + 1}" for snippet in lead.block.snippets]
    reply = await backend.fill(FillRequest(tuple(parts), settings, document.uri), cancel)
    elapsed = (time.perf_counter() - started) * 1000
    if isinstance(reply, Failed):
        return FillOutcome(version, [], error=reply.reason)
    if isinstance(reply, Cancelled):
        return FillOutcome(version, [], cancelled=True, elapsed_ms=elapsed)
    ordered = sorted(range(len(regions)), key=lambda i: (regions[i].start, regions[i].end))
    answers: list[RegionAnswer | None] = [None] * len(regions)
    for index, gap in zip(ordered, reply.gaps, strict=True):
        answers[index] = _answer(document, regions[index], gap)
    log.info("fill %s v%d: %d regions, %d steps, %.0f ms", document.uri, version, len(regions), reply.steps,
             elapsed)  # fmt: skip
    return FillOutcome(version, [a for a in answers if a is not None], result=reply.details, elapsed_ms=elapsed,
                       context=context)  # fmt: skip


def _answer(document: Document, region: Region, gap: Gap) -> RegionAnswer:
    text = gap.text
    if not gap.ended:
        return RegionAnswer(region, None, "truncated", REASONS["truncated"])
    if not text.strip():
        return RegionAnswer(region, None, "empty", REASONS["empty"])
    edit = Edit(region.start, region.end, text)
    if adds_syntax_errors(document, edit):
        return RegionAnswer(region, None, "syntax", REASONS["syntax"])
    return RegionAnswer(region, edit, "filled")
