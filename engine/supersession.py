"""One running request per key (a document): a newer one cancels the older. The language server's completions and
next edits and the resident engine's requests all supersede this way. No torch."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Generic, TypeVar

Flag = TypeVar("Flag", bound=threading.Event)


class Supersession(Generic[Flag]):
    """The running request of each key: its cancel flag and what it computes (`what`, e.g. a cache key)."""

    def __init__(self) -> None:
        self._running: dict[str, tuple[str, Flag]] = {}

    @contextlib.contextmanager
    def running(self, key: str, flag: Flag, what: str = "") -> Iterator[Flag]:
        """`flag`'s request runs for `key` for the block: the older one's flag is set now; the entry goes at the end
        unless a newer request replaced it meanwhile."""
        older = self._running.get(key)
        if older is not None:
            older[1].set()
        self._running[key] = (what, flag)
        try:
            yield flag
        finally:
            if self._running.get(key, ("", None))[1] is flag:
                del self._running[key]

    def what(self, key: str) -> str | None:
        """What the request running for `key` computes; None when none runs."""
        running = self._running.get(key)
        return None if running is None else running[0]

    def cancel(self, key: str) -> None:
        """Stop the request running for `key` (the document closed)."""
        running = self._running.pop(key, None)
        if running is not None:
            running[1].set()

    def cancel_all(self) -> None:
        for key in list(self._running):
            self.cancel(key)

    def __len__(self) -> int:
        return len(self._running)

    def __contains__(self, key: str) -> bool:
        return key in self._running
