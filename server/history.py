"""A document's recent edits as the user made them, for next-edit suggestions (`server/nextedit.py`).

didChange sends changes as the editor applies them: a name retyped is a deletion and a few one-character insertions.
`EditHistory.record` coalesces them into user-level edits, as an editor's undo does: a change that continues the last
edit (typing on at its end, deleting back into or before it, replacing inside what it wrote) joins it; anything else
(a change elsewhere, a pause over `PAUSE_S`, a line break typed) starts a new one. Offsets of the older edits move
with later changes before them. Bounded: the last MAX_EDITS edits, an edit's texts kept whole up to MAX_EDIT_CHARS
(longer ones, a paste of a file, are kept as `huge` and never repeated); cleared when the document closes.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from ..engine.commits import differing

MAX_EDITS = 16
MAX_EDIT_CHARS = 4_000
PAUSE_S = 3.0  # a change after this long a pause starts a new edit


@dataclass(frozen=True)
class Change:
    """One change of a didChange: `removed` at offset `start` replaced by `inserted` (offsets in the text before it)."""

    start: int
    removed: str
    inserted: str

    @classmethod
    def between(cls, old: str, new: str) -> Change:
        """The one change that turns `old` into `new` (a client that sends whole texts): the differing middle."""
        head, old_end, new_end = differing(old, new)
        return cls(head, old[head:old_end], new[head:new_end])


@dataclass
class UserEdit:
    """A user-level edit: `removed` replaced by `inserted`, which now starts at `start` in the document."""

    start: int
    removed: str
    inserted: str
    at: float  # time.monotonic() of its last change
    version: int  # the document version after its last change
    huge: bool = False  # over MAX_EDIT_CHARS: its texts are cut, it is context only

    @property
    def end(self) -> int:
        """Where what it wrote ends in the document."""
        return self.start + len(self.inserted)

    def joins(self, change: Change, now: float) -> bool:
        if self.huge or now - self.at > PAUSE_S:
            return False
        if change.inserted.strip() == "" and "\n" in change.inserted:
            return False  # Enter: the line is done
        after = change.start + len(change.removed)
        return (self.start <= change.start and after <= self.end) or after == self.start or change.start == self.end

    def join(self, change: Change) -> None:
        """Take `change` (which `joins` it) in: the edit's replaced text and written text both grow or shrink."""
        after, offset = change.start + len(change.removed), change.start - self.start
        if offset >= 0 and after <= self.end:  # inside (or at the end of) what it wrote: typing on, backspace
            self.inserted = self.inserted[:offset] + change.inserted + self.inserted[offset + len(change.removed) :]
        elif after == self.start:  # deleting (or replacing) back from its start
            self.removed = change.removed + self.removed
            self.inserted = change.inserted + self.inserted
            self.start = change.start
        else:  # deleting (or replacing) forward from its end
            self.removed += change.removed
            self.inserted += change.inserted


class EditHistory:
    """The document's last user-level edits, oldest first."""

    def __init__(self) -> None:
        self.edits: deque[UserEdit] = deque(maxlen=MAX_EDITS)

    def record(self, change: Change, version: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if change.removed == change.inserted:
            return
        last = self.edits[-1] if self.edits else None
        if last is not None and last.joins(change, now):
            last.join(change)
            last.at, last.version = now, version
            if last.removed == last.inserted:  # typed back to what it was: no edit
                self.edits.pop()
            elif len(last.removed) + len(last.inserted) > MAX_EDIT_CHARS:
                last.huge = True
            self._shift(change, skip=last)
            return
        self._shift(change)
        huge = len(change.removed) + len(change.inserted) > MAX_EDIT_CHARS
        removed, inserted = (change.removed[:MAX_EDIT_CHARS], change.inserted[:MAX_EDIT_CHARS]) if huge else (
            change.removed, change.inserted)  # fmt: skip
        self.edits.append(UserEdit(change.start, removed, inserted, now, version, huge))

    def _shift(self, change: Change, skip: UserEdit | None = None) -> None:
        """Older edits after the change move by what it added; one it overlapped is context only from now on."""
        delta = len(change.inserted) - len(change.removed)
        after = change.start + len(change.removed)
        for edit in self.edits:
            if edit is skip:
                continue
            if edit.start >= after:
                edit.start += delta
            elif edit.end > change.start:
                edit.huge = True  # rewritten since: its offsets no longer say where it is

    @property
    def last(self) -> UserEdit | None:
        return self.edits[-1] if self.edits else None

    def clear(self) -> None:
        self.edits.clear()
