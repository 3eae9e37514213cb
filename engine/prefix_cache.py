"""Encoder KV of recent prefixes, matched on token ids, so a keystroke re-encodes only the changed tail.

A keystroke changes the last token or two of the prefix (BPE re-merges "retu" into "return"), so each request leaves
a *cursor snapshot* `MARK` tokens before its prefix's end: the next keystroke's ids extend it, and that request
encodes only what was typed and the `MARK` tokens after it. A cursor snapshot replaces the one it extends (the same
place, typed on). Beside them, *grid snapshots* at lengths rounded down to `GRID` tokens, at least `TAIL` behind the
cursor, serve what a cursor snapshot cannot: a deletion, a jump back to a place typed at before.

Every snapshot is cut from the request's own encode (`crop`): the tail is encoded in one forward and the snapshots
are copies of its cache without their last tokens. A sliding-window layer would have dropped the oldest tokens of
its window by then, so the caches handed here record their past until cropped (transformers'
`activate_past_recording`, `encoding.py`). What is reused is what a fresh encode computes (the encoder is causal:
a token's keys and values depend on the tokens before it only), to the float rounding of how tokens were grouped
into calls; int8-dynamic weights quantise each call's activations with one scale, so there the grouping moves keys
and values a little more, and may move an answer's late tokens (as batching requests together does). Memory is
bounded by bytes and by the number of snapshots, least recently used out first.

The count bound is what holds for a small model: a snapshot of the shipped model's 1k-token prefix is ~0.3 MB, so a
byte budget alone (256 MB) let the cache grow to ~800 snapshots, each request scanning them all, and the engine's
resident memory grew by the whole budget over a long session (`bench soak`). An editor's working set is the places
typed at lately; `MAX_SNAPSHOTS` of them. For a large model the byte budget binds first (DiffusionGemma 26B-A4B:
~0.25 MB of KV per token).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# Grid snapshots: multiples of GRID, at least TAIL tokens behind the end of the prefix. Before cursor snapshots, a
# keystroke re-encoded TAIL + GRID / 2 tokens on average (with a 0.5B model on 2 Zen 2 cores, GRID 16 re-encoded 23.5
# tokens where 64 re-encoded 47; 2026-12-06); now they serve edits a cursor snapshot does not extend.
GRID = 16
TAIL = 16
# The cursor snapshot's distance from the prefix's end: a keystroke re-tokenizes the word being typed (BPE merges
# within a pre-token), rarely more than the last few tokens; the ids must match exactly, else a grid snapshot serves.
MARK = 4
MAX_SNAPSHOTS = 64


@dataclass
class _Snapshot:
    ids: tuple[int, ...]
    cache: Any  # a DynamicCache holding exactly `ids`
    nbytes: int
    cursor: bool = False  # a cursor snapshot (replaced by the next one at the same place)


def cache_bytes(cache: Any) -> int:
    total = 0
    for layer in getattr(cache, "layers", []):
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if tensor is not None and hasattr(tensor, "numel"):
                total += tensor.numel() * tensor.element_size()
    return total


EncodeRows = Callable[[list[Any], list[Sequence[int]], list[int]], None]
Crop = Callable[[Any, int], Any]


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
        self, id_lists: Sequence[Sequence[int]], new_cache: Callable[[], Any], encode_rows: EncodeRows, crop: Crop
    ) -> list[tuple[Any, int]]:
        """Caches holding `id_lists`, each built from the longest stored snapshot its ids extend, with how many
        tokens came from that snapshot (not re-encoded). `new_cache()` makes an empty cache; `encode_rows(caches,
        id_lists, starts)` appends id_lists[r] to caches[r] at positions starts[r]..., all rows in one call;
        `crop(cache, n)` is a copy of a cache without its last n tokens: each row's own copy of its snapshot (n = 0),
        and its grid and cursor snapshots."""
        held = []
        for ids in map(tuple, id_lists):
            base = self._longest(ids, len(ids) - 1)  # at least one token encoded
            if base is None:
                self.misses += 1
                held.append((ids, new_cache(), 0))
            else:
                self.hits += 1
                self._snapshots.move_to_end(base.ids)
                held.append((ids, crop(base.cache, 0), len(base.ids)))
        rows = [(ids, cache, reused) for ids, cache, reused in held if reused < len(ids)]
        if rows:
            encode_rows([cache for _, cache, _ in rows], [ids[reused:] for ids, _, reused in rows],
                        [reused for _, _, reused in rows])  # fmt: skip
        for ids, cache, reused in held:
            grid = (max(0, len(ids) - TAIL) // GRID) * GRID
            if grid > reused and ids[:grid] not in self._snapshots:
                self._store(ids[:grid], crop(cache, len(ids) - grid))
            mark = len(ids) - MARK
            if mark > max(grid, reused) and mark >= GRID:  # a few tokens: not worth a copy
                self._store(ids[:mark], crop(cache, MARK), cursor=True)
        return [(cache, reused) for _, cache, reused in held]

    def _longest(self, ids: tuple[int, ...], limit: int) -> _Snapshot | None:
        best = None
        for snapshot in self._snapshots.values():
            n = len(snapshot.ids)
            if 0 < n <= limit and ids[:n] == snapshot.ids and (best is None or n > len(best.ids)):
                best = snapshot
        return best

    def _store(self, ids: tuple[int, ...], cache: Any, cursor: bool = False) -> None:
        """Keep `cache` (the caller's own copy, holding exactly `ids`) as a snapshot; a cursor snapshot replaces the
        cursor snapshots it extends."""
        if not ids:
            return
        snapshot = _Snapshot(ids, cache, cache_bytes(cache), cursor)
        if snapshot.nbytes > self.max_bytes:
            return
        if cursor:
            for old in [s.ids for s in self._snapshots.values() if s.cursor and ids[: len(s.ids)] == s.ids]:
                del self._snapshots[old]
        self._snapshots[ids] = snapshot
        self._snapshots.move_to_end(ids)
        while self.nbytes > self.max_bytes or len(self._snapshots) > self.max_snapshots:
            self._snapshots.popitem(last=False)
