"""Prefix KV reuse: a keystroke re-encodes only the tail, and the answer is the one a fresh encode gives."""

from __future__ import annotations

from pathlib import Path

import pytest

from canvas_ls.engine import Engine
from canvas_ls.engine.prefix_cache import GRID, TAIL, PrefixCache


class ListCache(list):
    """A stand-in cache: the token ids it holds, in order."""


def encoder(log: list[tuple[int, int]]):
    """An `encode_rows` for ListCaches that logs each row's (start, end)."""

    def encode_rows(caches: list[ListCache], id_lists, starts: list[int]) -> None:
        for cache, ids, start in zip(caches, id_lists, starts, strict=True):
            assert len(cache) == start
            cache.extend(ids)
            log.append((start, start + len(ids)))

    return encode_rows


def encode_one(cache: PrefixCache, ids: list[int], log: list[tuple[int, int]]) -> tuple[ListCache, int]:
    return cache.encode_many([ids], ListCache, encoder(log))[0]


def test_a_keystroke_reencodes_only_the_tail() -> None:
    cache = PrefixCache(max_bytes=1 << 20)
    log: list[tuple[int, int]] = []
    ids = list(range(300))
    held, reused = encode_one(cache, ids, log)
    snapshot = ((300 - TAIL) // GRID) * GRID
    assert held == ids and reused == 0 and log == [(0, snapshot), (snapshot, 300)]

    log.clear()
    typed = [*ids[:-1], 999, 1000]  # the last token re-merged, one more after it
    held, reused = encode_one(cache, typed, log)
    assert held == typed and reused == snapshot and log == [(snapshot, 301)]
    assert cache.hits == 1 and cache.misses == 1


def cropped(cache: ListCache, remove: int) -> ListCache:
    return ListCache(cache[:-remove] if remove else cache)


def test_a_short_new_prefix_is_encoded_in_one_go_and_its_snapshot_cut_from_it() -> None:
    cache = PrefixCache(max_bytes=1 << 20)
    log: list[tuple[int, int]] = []
    rows = encoder(log)
    ids = list(range(300))
    [(held, reused)] = cache.encode_many([ids], ListCache, rows, cropped, crop_limit=511)
    assert held == ids and reused == 0 and log == [(0, 300)]  # one forward, not two
    log.clear()
    [(held, reused)] = cache.encode_many([[*ids, 7]], ListCache, rows, cropped, crop_limit=511)
    snapshot = ((300 - TAIL) // GRID) * GRID
    assert reused == snapshot and log == [(snapshot, 301)]  # the snapshot cut from the first encode serves
    log.clear()
    long = list(range(1000, 1600))  # past the limit (a sliding window would have dropped tokens): two phases
    cache.encode_many([long], ListCache, rows, cropped, crop_limit=511)
    assert log == [(0, ((600 - TAIL) // GRID) * GRID), (((600 - TAIL) // GRID) * GRID, 600)]


def test_snapshots_are_bounded_in_number_least_recently_used_out_first() -> None:
    cache = PrefixCache(max_bytes=1 << 30, max_snapshots=3)
    documents = [[d * 1000 + i for i in range(200)] for d in range(5)]
    for ids in documents[:3]:
        encode_one(cache, ids, [])
    encode_one(cache, [*documents[0], 1], [])  # the first place typed at again: used most recently
    for ids in documents[3:]:
        encode_one(cache, ids, [])
    log: list[tuple[int, int]] = []
    assert encode_one(cache, [*documents[0], 2], log)[1] > 0  # kept
    assert encode_one(cache, [*documents[1], 2], log)[1] == 0  # dropped: the least recently used
    assert len(cache._snapshots) == 3


def test_an_edit_before_the_snapshot_misses() -> None:
    cache = PrefixCache(max_bytes=1 << 20)
    encode_one(cache, list(range(300)), [])
    log: list[tuple[int, int]] = []
    edited = [7, *range(1, 300)]
    held, reused = encode_one(cache, edited, log)
    assert held == edited and reused == 0 and log[0][0] == 0


@pytest.mark.parametrize("lines", [12, 40])  # ~130 tokens: snapshot cut from one encode; ~450: past the window
def test_reuse_gives_the_fresh_answer(tiny_model_dir: Path, lines: int) -> None:
    body = "".join(f"    total += values[{i}] * {i}\n" for i in range(lines))
    prefix = "def weighted(values):\n    total = 0\n" + body + "    return tot"
    suffix = "\n"
    settings = {"gap_tokens": 8, "max_new_tokens": 8, "max_steps": 4}
    cached = Engine.load(str(tiny_model_dir), "cpu", dtype="float32")
    fresh = Engine.load(str(tiny_model_dir), "cpu", prefix_cache_mb=0, dtype="float32")
    first = cached.infill(prefix, suffix, settings)
    second = cached.infill(prefix + "a", suffix, settings)  # a keystroke
    assert first.prefix_reused_tokens == 0
    assert 0 < second.prefix_reused_tokens >= second.prefix_tokens - TAIL - GRID
    assert second.tokens == fresh.infill(prefix + "a", suffix, settings).tokens
    assert cached.prefix_cache.nbytes > 0
    # Per request, reuse can be turned off: the same engine then encodes the whole prefix, same answer.
    unreused = cached.infill(prefix + "a", suffix, {**settings, "reuse_prefix": False})
    assert unreused.prefix_reused_tokens == 0 and unreused.tokens == second.tokens


def test_memory_stays_bounded(tiny_model_dir: Path) -> None:
    engine = Engine.load(str(tiny_model_dir), "cpu", prefix_cache_mb=1)
    engine.prefix_cache.max_bytes = 60_000  # a few snapshots of the tiny model
    for n in range(12):
        engine.infill(f"# file {n}\n" + "x = 1\n" * 120, "", {"gap_tokens": 4, "max_new_tokens": 4, "max_steps": 2})
        assert engine.prefix_cache.nbytes <= 60_000
