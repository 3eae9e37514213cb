"""Encoder KV of recent prefixes, matched on token ids, so a keystroke re-encodes only the changed tail.

A keystroke changes the last token or two of the prefix (BPE re-merges "retu" into "return"), and sliding-window
cache layers cannot be cropped back once tokens have slid out. So the cache keeps *snapshots* taken a safe distance
behind the cursor, at a length rounded down to `GRID` tokens: while the user types, the snapshot stays the same,
each request copies it and encodes only the few tokens after it. Memory is bounded by bytes and by the number of
snapshots, least recently used out first.

The count bound is what holds for a small model: a snapshot of the shipped model's 1k-token prefix is ~0.3 MB, so a
byte budget alone (256 MB) let the cache grow to ~800 snapshots, each request scanning them all, and the engine's
resident memory grew by the whole budget over a long session (`bench soak`). An editor's working set is the places
typed at lately (a snapshot every `GRID` tokens of progress at each); `MAX_SNAPSHOTS` of them. For a large model the
byte budget binds first (DiffusionGemma 26B-A4B: ~0.25 MB of KV per token).
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# Snapshot lengths are multiples of GRID and at least TAIL tokens behind the end of the prefix. A keystroke
# re-encodes TAIL + GRID / 2 tokens on average: with a 0.5B model on 2 Zen 2 cores (int8-dynamic, 4.9 ms a token),
# GRID 16 re-encoded 23.5 tokens where 64 re-encoded 47, and a warm 16-token completion took 1,401-1,406 ms against
# 1,552-1,569 (`bench ar`'s typing, alternated, 2026-12-06); a snapshot copy per 16 tokens of progress costs ~3 ms.
GRID = 16
TAIL = 16
MAX_SNAPSHOTS = 64


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


EncodeRows = Callable[[list[Any], list[Sequence[int]], list[int]], None]


@dataclass
class _Plan:
    ids: tuple[int, ...]
    target: int  # the grid point this request's snapshot moves up to
    cache: Any
    reused: int  # tokens that came from a snapshot
    whole: bool = False  # encoded in one go, the snapshot cut from the result afterwards

    @property
    def position(self) -> int:
        """Where the tail encode starts."""
        return self.reused if self.whole else max(self.target, self.reused)


class PrefixCache:
    def __init__(self, max_bytes: int, max_snapshots: int = MAX_SNAPSHOTS):
        self.max_bytes, self.max_snapshots = max_bytes, max_snapshots
        self._snapshots: OrderedDict[tuple[int, ...], _Snapshot] = OrderedDict()
        self.hits = 0
        self.misses = 0

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self._snapshots.values())

    def encode_many(
        self,
        id_lists: Sequence[Sequence[int]],
        new_cache: Callable[[], Any],
        encode_rows: EncodeRows,
        crop: Callable[[Any, int], Any] | None = None,
        crop_limit: int = 0,
    ) -> list[tuple[Any, int]]:
        """Caches holding `id_lists`, each built from the longest stored snapshot its ids extend, with how many
        tokens came from that snapshot (not re-encoded). `new_cache()` makes an empty cache; `encode_rows(caches,
        id_lists, starts)` appends id_lists[r] to caches[r] at positions starts[r]..., rows together. At most two
        calls: one that moves the rows' snapshots up to their grid points (then kept), one for the tails after them.

        With `crop(cache, n)` (a copy of the cache without its last n tokens), a prefix of at most `crop_limit`
        tokens is encoded in one go and its snapshot cut from the result: one forward instead of two for a new
        short document. (Sliding-window layers cannot give back tokens they dropped, hence the limit.)"""
        plans = []
        for ids in map(tuple, id_lists):
            target = (max(0, len(ids) - TAIL) // GRID) * GRID  # where this request's snapshot sits
            base = self._longest(ids, target)
            if base is None:
                self.misses += 1
                plans.append(_Plan(ids, target, new_cache(), 0))
            else:
                self.hits += 1
                self._snapshots.move_to_end(base.ids)
                plans.append(_Plan(ids, target, copy.deepcopy(base.cache), len(base.ids)))
        grow = [p for p in plans if p.target > p.reused]
        for plan in grow:  # short enough: encoded whole with the tails below, its snapshot cut from the result
            plan.whole = crop is not None and len(plan.ids) <= crop_limit
        cut = [p for p in grow if p.whole]
        grow = [p for p in grow if not p.whole]
        if grow:
            encode_rows([p.cache for p in grow], [p.ids[p.reused : p.target] for p in grow], [p.reused for p in grow])
            for plan in grow:
                self._store(plan.ids[: plan.target], copy.deepcopy(plan.cache))
        tails = [p for p in plans if p.position < len(p.ids)]
        if tails:
            encode_rows([p.cache for p in tails], [p.ids[p.position :] for p in tails], [p.position for p in tails])
        for plan in cut:
            self._store(plan.ids[: plan.target], crop(plan.cache, len(plan.ids) - plan.target))
        return [(p.cache, p.reused) for p in plans]

    def _longest(self, ids: tuple[int, ...], limit: int) -> _Snapshot | None:
        best = None
        for snapshot in self._snapshots.values():
            n = len(snapshot.ids)
            if 0 < n <= limit and ids[:n] == snapshot.ids and (best is None or n > len(best.ids)):
                best = snapshot
        return best

    def _store(self, ids: tuple[int, ...], cache: Any) -> None:
        """Keep `cache` (the caller's own copy, holding exactly `ids`) as a snapshot."""
        if not ids:
            return
        snapshot = _Snapshot(ids, cache, cache_bytes(cache))
        if snapshot.nbytes > self.max_bytes:
            return
        self._snapshots[ids] = snapshot
        self._snapshots.move_to_end(ids)
        while self.nbytes > self.max_bytes or len(self._snapshots) > self.max_snapshots:
            self._snapshots.popitem(last=False)
