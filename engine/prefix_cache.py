"""Encoder KV of recent prefixes, matched on token ids, so a keystroke re-encodes only the changed tail.

A keystroke changes the last token or two of the prefix (BPE re-merges "retu" into "return"), and sliding-window
cache layers cannot be cropped back once tokens have slid out. So the cache keeps *snapshots* taken a safe distance
behind the cursor, at a length rounded down to `GRID` tokens: while the user types, the snapshot stays the same,
each request copies it and encodes only the few tokens after it. Memory is bounded by bytes, least recently used
out first.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# Snapshot lengths are multiples of GRID and at least TAIL tokens behind the end of the prefix.
GRID = 64
TAIL = 16


@dataclass
class _Snapshot:
    ids: tuple[int, ...]
    cache: Any  # a DynamicCache holding exactly `ids`
    nbytes: int


def cache_bytes(cache: Any) -> int:
    total = 0
    for layer in getattr(cache, "layers", []):
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if tensor is not None and hasattr(tensor, "numel"):
                total += tensor.numel() * tensor.element_size()
    return total


class PrefixCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._snapshots: OrderedDict[tuple[int, ...], _Snapshot] = OrderedDict()
        self.hits = 0
        self.misses = 0

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self._snapshots.values())

    def encode(self, ids: Sequence[int], new_cache: Callable[[], Any],
               encode: Callable[[Any, Sequence[int], int], None]) -> tuple[Any, int]:  # fmt: skip
        """A cache holding `ids`, built from the longest stored snapshot they extend.

        `new_cache()` makes an empty cache; `encode(cache, ids, start)` appends ids at positions start...
        Returns the cache and how many tokens came from a snapshot (not re-encoded).
        """
        ids = tuple(ids)
        target = (max(0, len(ids) - TAIL) // GRID) * GRID  # where this request's snapshot sits
        base = self._longest(ids, target)
        if base is None:
            self.misses += 1
            cache, reused = new_cache(), 0
        else:
            self.hits += 1
            self._snapshots.move_to_end(base.ids)
            cache, reused = copy.deepcopy(base.cache), len(base.ids)
        if target > reused:  # move the snapshot up to this request's grid point, and keep it
            encode(cache, ids[reused:target], reused)
            self._store(ids[:target], cache)
            position = target
        else:
            position = reused
        if position < len(ids):
            encode(cache, ids[position:], position)
        return cache, reused

    def _longest(self, ids: tuple[int, ...], limit: int) -> _Snapshot | None:
        best = None
        for snapshot in self._snapshots.values():
            n = len(snapshot.ids)
            if 0 < n <= limit and ids[:n] == snapshot.ids and (best is None or n > len(best.ids)):
                best = snapshot
        return best

    def _store(self, ids: tuple[int, ...], cache: Any) -> None:
        if not ids:
            return
        snapshot = _Snapshot(ids, copy.deepcopy(cache), cache_bytes(cache))
        if snapshot.nbytes > self.max_bytes:
            return
        self._snapshots[ids] = snapshot
        self._snapshots.move_to_end(ids)
        while self.nbytes > self.max_bytes:
            self._snapshots.popitem(last=False)
