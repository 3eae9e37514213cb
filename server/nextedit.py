"""Next-edit suggestions: after the user edits, the edits that should follow, at the cursor or away from it.

    the document's recent edits (`server/history.py`) -> each predictor -> suggestions at or above its confidence
    -> edits, the ones at the cursor's line first, then the nearest below it, above it, in the other documents

Two predictors, one interface (`Suggestion`s with a confidence):
- `repeat` (no model): the last edit's substitution at the other places its old text still stands. A renamed
  identifier is renamed wherever it stands as a name (not inside strings or comments), in this document and in the
  other open documents of its language; an edit of a call's arguments is widened to the call on its line (an added
  argument: `f(a)` -> `f(a, b)`), any other to the word before it (`timeout=30` -> `timeout=60`), and repeated where
  that text stands.
- `canvas` (where `repeat` shows nothing): the window around the cursor rewritten in one canvas (a span rewrite of
  `Engine.fill`: the model starts from the window's text with a share of its tokens renoised and rewrites what it
  doubts), the recent edits before it as comment lines; when the last edit changed a function's parameters, the
  lines of its calls are more windows of the same canvas (`sites`), the code between them kept. An unchanged window
  is no suggestion; otherwise its changed span is one edit, dropped when it adds syntax errors.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..engine.commits import recent_edits_comment
from ..engine.regions import Hole
from ..engine.supersession import Supersession
from .backend import Answer, Backend, CancelFlag, Cancelled, Failed, FillRequest, Gap, Settings
from .config import NextEditOptions
from .context import is_word, node_at, prefix_window
from .display import reaches
from .documents import Document
from .edits import Edit, adds_syntax_errors
from .history import Change, UserEdit
from .languages import GRAMMARS

IDENTIFIER = re.compile(r"[^\W\d]\w*\Z")
OPENERS, CLOSERS = "([{", ")]}"
SUFFIX_CHARS = 2_000  # the text after the window the canvas sees
MAX_WINDOW_CHARS = 12_000  # a window over this (minified code, one huge line) is not rewritten
MAX_SPAN_CHARS = 6_000  # the cursor's window and the call sites rewritten with it, and the code between them
# The canvas of a window's rewrite: its gap slots (the window's tokens and half again) and its positions in all,
# above the engine's defaults for holes (a window is a long hole).
CANVAS_BUDGET = {"fill_tokens": 4096, "max_canvas_tokens": 8192}
LEFT_AS_IT_WAS = "left as it was"  # one window's reason, read as none while another window says why
# `repeat`'s confidence by the kind of pattern, in the document (one tenth less in the other documents): about the
# share of its suggestions that were the next hunk exactly in `bench edits` (2026-12-05, this repository's newest
# 120 commits): renames 5 of 6, text patterns 1 of 13 (under the default threshold: not shown), dotted names 1 of 1
# (too few to say more than "shown").
CONFIDENCE = {"rename": 0.85, "dotted": 0.6, "text": 0.2}


@dataclass(frozen=True)
class Suggestion:
    uri: str
    start: int  # offsets in that document
    end: int
    text: str
    confidence: float
    predictor: str  # "repeat" or "canvas"
    away: bool  # not on the cursor's line (the editor shows it as a jump)


@dataclass(frozen=True)
class Pattern:
    """The last edit as a substitution to repeat: `old` -> `new`, of a kind of `CONFIDENCE`: "rename" (both are
    identifiers), "dotted" (a part of a dotted name renamed) or "text"."""

    old: str
    new: str
    kind: str


def pattern(document: Document, edit: UserEdit) -> Pattern | None:
    """The last edit widened to whole words. A renamed identifier is a rename, unless it is part of a dotted name
    (`pkg.engine.calibrate`, `self.size`): then the whole dotted name is the text to repeat. Otherwise an edit that
    added or removed an argument (a comma or bracket) widens to the call or bracket it sits in on its line, any other
    to the word before it. None for what is not worth repeating: multi-line edits, edits over their size cap, text
    with no name in it, a name added to or taken from an import (other imports need not follow)."""
    text = document.text
    if edit.huge or text[edit.start : edit.end] != edit.inserted:
        return None
    left, right = _word_start(text, edit.start), _word_end(text, edit.end)
    old = text[left : edit.start] + edit.removed + text[edit.end : right]
    new = text[left:right]
    renamed = bool(IDENTIFIER.match(old) and IDENTIFIER.match(new))
    dotted_left, dotted_right = _dotted_start(text, left), _dotted_end(text, right)
    if renamed and (dotted_left, dotted_right) == (left, right):
        return Pattern(old, new, "rename")
    if renamed:  # a part of a dotted name: the dotted name is what stands elsewhere
        old = text[dotted_left:left] + old + text[right:dotted_right]
        return Pattern(old, text[dotted_left:dotted_right], "dotted")
    if "\n" in old or "\n" in new or _in_import(document, edit.start):
        return None
    line_start = text.rfind("\n", 0, left) + 1
    line_end = len(text) if text.find("\n", right) < 0 else text.find("\n", right)
    opening = closing = None
    if any(char in ",()[]{}" for char in edit.removed + edit.inserted):  # the arguments changed: the whole call
        opening = _unclosed(text, line_start, left)
        closing = _closing(text, right, line_end, opening) if opening is not None else None
    if opening is not None and closing is not None:
        left, right = _word_start(text, opening), closing + 1  # the call: its name, its brackets
    else:
        while left > line_start and not text[left - 1].isspace() and not is_word(text[left - 1]):
            left -= 1  # "=" of `timeout=30`, "." of `self.size`
        left = _word_start(text, left)
    old = text[left : edit.start] + edit.removed + text[edit.end : right]
    if not re.search(r"[^\W\d]", old) or len(old.strip()) < 3:
        return None
    return Pattern(old, text[left:right], "text")


def repeat(document: Document, offset: int, others: list[Document], options: NextEditOptions) -> list[Suggestion]:
    """The last edit's substitution at the other places its old text stands (`pattern`), nearest first."""
    last = document.history.last
    found = pattern(document, last) if last is not None else None
    if found is None or found.old == found.new:
        return []
    left = r"(?<!\w)" if is_word(found.old[0]) else ""
    right = r"(?!\w)" if is_word(found.old[-1]) else ""
    regex = re.compile(left + re.escape(found.old) + right)
    line = document.index.line_of(offset)
    suggestions: list[Suggestion] = []
    for number, other in enumerate([document, *others[: options.max_documents]]):
        confidence = round(CONFIDENCE[found.kind] - (0.1 if number else 0.0), 4)
        for match in regex.finditer(other.text):
            if found.kind == "rename" and not _a_name(other, match.start(), match.end()):
                continue
            away = other is not document or other.index.line_of(match.start()) != line
            suggestions.append(Suggestion(other.uri, match.start(), match.end(), found.new, confidence, "repeat", away))
    return sorted(suggestions, key=lambda s: _distance(s, document, offset))[: options.max_sites]


def _distance(suggestion: Suggestion, document: Document, offset: int) -> tuple[int, int, int]:
    """Order: this document (its cursor line, then below the cursor, then above), then the others."""
    if suggestion.uri != document.uri:
        return (3, 0, suggestion.start)
    if not suggestion.away:
        return (0, 0, suggestion.start)
    return (1, suggestion.start - offset, 0) if suggestion.start >= offset else (2, offset - suggestion.start, 0)


@dataclass(frozen=True)
class Window:
    """The lines around the cursor that the canvas rewrites: offsets [start, end) of `text`."""

    start: int
    end: int
    text: str


def window(document: Document, offset: int, lines: int) -> Window:
    index = document.index
    line = index.line_of(offset)
    first, last = max(0, line - lines), min(len(index.starts) - 1, line + lines)
    start = index.starts[first]
    end = index.starts[last + 1] if last + 1 < len(index.starts) else len(document.text)
    return Window(start, end, document.text[start:end])


def edits_block(document: Document, count: int) -> str:
    """The document's last `count` edits as comment lines, newest last: what the canvas is conditioned on."""
    edits = [edit for edit in document.history.edits if not edit.huge][-count:] if count else []
    return recent_edits_comment(document.language, [(edit.removed, edit.inserted) for edit in edits])


@dataclass(frozen=True)
class Unchanged:
    """The canvas suggests nothing, and why (the window is blank or too long, the model left it as it was, its
    answer did not end, or it adds syntax errors)."""

    reason: str


Rewrite = list[Suggestion] | Unchanged | Failed | Cancelled


async def rewrite(document: Document, offset: int, backend: Backend, options: NextEditOptions,
                  cancel: CancelFlag, prefix_tokens: int) -> Rewrite:  # fmt: skip
    """The windows `sites` picks rewritten by the model in one canvas (the code between them kept as it is): a
    Suggestion per window it changed, or `Unchanged` with why there is none; the backend's `Failed` or
    `Cancelled` as it is."""
    windows = sites(document, offset, options)
    if not any(around.text.strip() for around in windows):
        return Unchanged("the window around the cursor is blank")
    if len(windows[0].text) > MAX_WINDOW_CHARS:
        return Unchanged(f"the window around the cursor is over {MAX_WINDOW_CHARS} characters")
    ordered = sorted(windows, key=lambda around: around.start)
    parts: list[str | Hole] = [edits_block(document, options.history_edits)
                               + prefix_window(document, ordered[0].start, prefix_tokens)]  # fmt: skip
    for around, following in zip(ordered, [*ordered[1:], None], strict=True):
        parts.append(Hole(around.text, options.strength))
        parts.append(document.text[around.end : following.start if following else around.end + SUFFIX_CHARS])
    settings = Settings(max_steps=options.max_steps, workspace_cache=0.0, **CANVAS_BUDGET)
    reply = await backend.fill(FillRequest(tuple(parts), settings, document.uri), cancel)
    if not isinstance(reply, Answer):
        return reply
    found: list[Suggestion] = []
    reasons: list[str] = []
    line = document.index.line_of(offset)
    for around, gap in zip(ordered, reply.gaps, strict=True):
        changed = _changed(document, around, gap)
        if isinstance(changed, str):
            reasons.append(changed)
            continue
        edit, confidence = changed
        away = not (document.index.line_of(edit.start) <= line <= document.index.line_of(edit.end))
        found.append(Suggestion(document.uri, edit.start, edit.end, edit.text, round(confidence, 4), "canvas", away))
    if found:
        return sorted(found, key=lambda suggestion: _distance(suggestion, document, offset))
    rest = [reason for reason in reasons if reason != LEFT_AS_IT_WAS]
    return Unchanged(rest[0] if rest else "the model left the window as it was")


def _changed(document: Document, around: Window, gap: Gap) -> tuple[Edit, float] | str:
    """One window's rewrite as an edit of the document and its confidence, or why it is none."""
    if gap.text == around.text:
        return LEFT_AS_IT_WAS
    if not gap.ended:
        return "the model's rewrite did not end within its budget"
    change = Change.between(around.text, gap.text)
    if not change.inserted and change.start + len(change.removed) >= len(around.text.rstrip("\n")):
        return "the model's rewrite ended before the window did"  # its end came early: the rest is not a deletion
    start = around.start + change.start
    edit = Edit(start, start + len(change.removed), change.inserted)
    if adds_syntax_errors(document, edit):
        return "the model's rewrite adds syntax errors"
    return edit, changed_confidence(gap, change.start, change.start + len(change.inserted))


def sites(document: Document, offset: int, options: NextEditOptions) -> list[Window]:
    """The windows the canvas rewrites: the cursor's first; then, when the last edit changed a function's parameters
    (`f(a)` -> `f(a, b)`), the lines of that function's calls in the document, nearest the cursor first, while the
    canvas spans at most MAX_SPAN_CHARS and holds at most `options.canvas_sites` windows. Overlapping ones merge."""
    windows = [window(document, offset, options.window_lines)]
    last = document.history.last
    name = None
    if last is not None and options.canvas_sites > 1:  # where it began or ended (`(r)` -> `(r, pi)`: in the list)
        name = changed_signature(document, last.start) or changed_signature(document, max(last.start, last.end - 1))
    if name is None:
        return windows
    index = document.index
    calls = [call for call in _calls(document, name) if not windows[0].start <= call[0] < windows[0].end]
    calls.sort(key=lambda call: abs(call[0] - offset))
    for _, (first_line, last_line) in calls:
        if len(windows) >= options.canvas_sites:
            break
        start = index.starts[first_line]
        end = index.starts[last_line + 1] if last_line + 1 < len(index.starts) else len(document.text)
        if max(end, *(w.end for w in windows)) - min(start, *(w.start for w in windows)) > MAX_SPAN_CHARS:
            continue
        touching = [w for w in windows if start <= w.end and w.start <= end]  # overlapping or adjacent: one window
        start, end = min([start, *(w.start for w in touching)]), max([end, *(w.end for w in touching)])
        merged = Window(start, end, document.text[start:end])
        cursors = windows[0] in touching  # the cursor's window stays first
        windows = [w for w in windows if w not in touching]
        if cursors:
            windows.insert(0, merged)
        else:
            windows.append(merged)
    return windows


def changed_signature(document: Document, offset: int) -> str | None:
    """The name of the function whose parameter list holds `offset` (a definition's `parameters` field in the syntax
    tree: Python, JavaScript, TypeScript, Go, Rust, C...), or None."""
    node = node_at(document, offset)
    while node is not None and node.parent is not None:
        parent = node.parent
        parameters = parent.child_by_field_name("parameters")
        if parameters is not None and parameters.start_byte <= node.start_byte and node.end_byte <= parameters.end_byte:
            name = parent.child_by_field_name("name") or parent.child_by_field_name("declarator")
            if name is not None and "identifier" in name.type and name.text is not None:
                return name.text.decode("utf-8", "replace")
            return None
        node = parent
    return None


def _calls(document: Document, name: str) -> list[tuple[int, tuple[int, int]]]:
    """Where `name` is called in the document (`name(...)`, `obj.name(...)`: a node whose `function` field ends with
    the name): the name's offset and the call's first and last lines."""
    if document.tree is None:
        return []
    found = []
    for match in re.finditer(r"(?<!\w)" + re.escape(name) + r"(?!\w)", document.text):
        node = node_at(document, match.start(), match.end())
        while node is not None and node.parent is not None:
            function = node.parent.child_by_field_name("function")
            if function is not None and (function.start_byte, function.end_byte) == (node.start_byte, node.end_byte):
                call = node.parent
                found.append((match.start(), (call.start_point[0], call.end_point[0])))
                break
            if node.parent.end_byte != node.end_byte:
                break
            node = node.parent  # `obj.name`: the attribute whose last part it is
    return found


def changed_confidence(gap: Gap, start: int, end: int) -> float:
    """The least confidence of the tokens that wrote the rewrite's changed text [start, end) (offsets of the gap's
    text; a deletion: the tokens on either side of it): the tokens it copied say nothing of the change."""
    at, scores = -len(gap.healed), []
    for text, confidence in zip(gap.token_texts, gap.confidence, strict=False):
        following = at + len(text)
        if (following > start and at < end) if end > start else (at <= start <= following):
            scores.append(confidence)
        at = following
    return min(scores or gap.confidence, default=1.0)


def _dotted_start(text: str, offset: int) -> int:
    """Back over `name.` parts before `offset` (a word's start)."""
    while offset > 1 and text[offset - 1] == "." and is_word(text[offset - 2]):
        offset = _word_start(text, offset - 1)
    return offset


def _dotted_end(text: str, offset: int) -> int:
    """On over `.name` parts after `offset` (a word's end)."""
    while offset + 1 < len(text) and text[offset] == "." and is_word(text[offset + 1]):
        offset = _word_end(text, offset + 1)
    return offset


def _in_import(document: Document, offset: int) -> bool:
    """Whether `offset` is inside the file's imports (the grammar's import nodes: `import`, `use`, `#include`...)."""
    grammar = GRAMMARS.get(document.language)
    node = node_at(document, offset) if grammar is not None else None
    while node is not None:
        if node.type in grammar.imports:
            return True
        node = node.parent
    return False


def _a_name(document: Document, start: int, end: int) -> bool:
    """Whether text[start:end] is a name in the syntax tree (an identifier node, not words in a string or comment);
    True where there is no grammar."""
    if document.tree is None:
        return True
    node = node_at(document, start, end)
    return node is not None and "identifier" in node.type


def _word_start(text: str, offset: int) -> int:
    while offset > 0 and is_word(text[offset - 1]):
        offset -= 1
    return offset


def _word_end(text: str, offset: int) -> int:
    while offset < len(text) and is_word(text[offset]):
        offset += 1
    return offset


def _unclosed(text: str, start: int, end: int) -> int | None:
    """The innermost bracket opened in text[start:end] and not closed there."""
    depth = 0
    for position in range(end - 1, start - 1, -1):
        if text[position] in CLOSERS:
            depth += 1
        elif text[position] in OPENERS:
            if depth == 0:
                return position
            depth -= 1
    return None


def _closing(text: str, start: int, end: int, opening: int) -> int | None:
    """Where the bracket at `opening` closes, searching text[start:end]."""
    want, depth = CLOSERS[OPENERS.index(text[opening])], 0
    for position in range(start, end):
        if text[position] in OPENERS:
            depth += 1
        elif text[position] in CLOSERS:
            if depth == 0:
                return position if text[position] == want else None
            depth -= 1
    return None


def _shown(found: list[Suggestion], options: NextEditOptions) -> list[Suggestion]:
    return [s for s in found if reaches(s.confidence, options.min_confidence.get(s.predictor, 0.0))]


@dataclass
class Outcome:
    """What a `canvas/nextEdit` request produced: the suggestions to show, and why there are none when so."""

    version: int
    suggestions: list[Suggestion]
    reason: str | None = None  # "no recent edit", "superseded", "stale", the engine's error...
    failed: bool = False  # the model failed (the reason is its error, for the user to see)


class NextEdits:
    """The server's next-edit requests: one running per document (a newer one cancels the older between denoising
    steps), each answered for the document version it read."""

    def __init__(self) -> None:
        self.in_flight: Supersession[CancelFlag] = Supersession()
        self.requests = 0
        self.shown: dict[str, int] = {"repeat": 0, "canvas": 0}

    async def suggest(self, document: Document, offset: int, others: list[Document], backend: Backend,
                      options: NextEditOptions, prefix_tokens: int) -> Outcome:  # fmt: skip
        self.requests += 1
        version = document.version
        if document.history.last is None:
            return Outcome(version, [], "no recent edit in this document")
        found: list[Suggestion] = []
        if "repeat" in options.predictors:
            found += repeat(document, offset, others, options)
        reason, failed = None, False
        if "canvas" in options.predictors and not _shown(found, options):  # the model where `repeat` shows nothing
            with self.in_flight.running(document.uri, CancelFlag()) as cancel:
                answer = await rewrite(document, offset, backend, options, cancel, prefix_tokens)
            match answer:
                case list():
                    found += answer
                case Cancelled():
                    return Outcome(version, [], "superseded by a newer request")
                case Failed(why, loading):
                    reason, failed = why, not loading
                case Unchanged(why):
                    reason = why
        if document.version != version:
            return Outcome(version, [], "the document changed while the suggestion was computed")
        shown = _shown(found, options)
        for suggestion in shown:
            self.shown[suggestion.predictor] += 1
        if not shown and reason is None:
            reason = "nothing to change" if not found else "below the confidence threshold"
        return Outcome(version, shown, reason, failed and not shown)

    def forget(self, uri: str) -> None:
        """The document closed: its running request stops."""
        self.in_flight.cancel(uri)
