"""Prefix KV reuse: a keystroke re-encodes only the tail, and the answer is the one a fresh encode gives."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from canvas_ls.engine import Engine
from canvas_ls.engine.encoding import encode_prefixes
from canvas_ls.engine.prefix_cache import GRID, MARK, TAIL, PrefixCache


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


def cropped(cache: ListCache, remove: int) -> ListCache:
    return ListCache(cache[:-remove] if remove else cache)


def encode_one(cache: PrefixCache, ids: list[int], log: list[tuple[int, int]]) -> tuple[ListCache, int]:
    return cache.encode_many([ids], ListCache, encoder(log), cropped)[0]


def test_a_keystroke_reencodes_what_was_typed_and_the_last_few_tokens() -> None:
    cache = PrefixCache(max_bytes=1 << 20)
    log: list[tuple[int, int]] = []
    ids = list(range(300))
    held, reused = encode_one(cache, ids, log)
    grid = ((300 - TAIL) // GRID) * GRID
    assert held == ids and reused == 0 and log == [(0, 300)]  # one forward, its snapshots cut from it
    assert list(cache._snapshots) == [tuple(ids[:grid]), tuple(ids[: 300 - MARK])]

    log.clear()
    typed = [*ids[:-1], 999, 1000]  # the last token re-merged, one more after it
    held, reused = encode_one(cache, typed, log)
    assert held == typed and reused == 300 - MARK and log == [(300 - MARK, 301)]
    # the cursor snapshot moved with the cursor; the grid one stays
    assert list(cache._snapshots) == [tuple(ids[:grid]), tuple(typed[: 301 - MARK])]
    assert cache.hits == 1 and cache.misses == 1

    log.clear()
    deleted = ids[:290]  # backspaced past the cursor snapshot: the grid snapshot serves
    held, reused = encode_one(cache, deleted, log)
    assert held == deleted and reused == grid and log == [(grid, 290)]
    assert set(cache._snapshots) == {tuple(ids[:grid]), tuple(typed[: 301 - MARK]), tuple(ids[: 290 - MARK])}

    encode_one(cache, list(range(5000, 5000 + GRID + MARK - 1)), log)  # too short to be worth a snapshot's copy
    assert len(cache._snapshots) == 3


def test_prefixes_encoded_together_each_get_their_snapshots() -> None:
    cache = PrefixCache(max_bytes=1 << 20)
    log: list[tuple[int, int]] = []
    first, second = list(range(100)), list(range(1000, 1040))
    cache.encode_many([first, second], ListCache, encoder(log), cropped)
    assert log == [(0, 100), (0, 40)]
    log.clear()
    rows = cache.encode_many([[*first, 5], [*second, 6]], ListCache, encoder(log), cropped)
    assert [reused for _, reused in rows] == [100 - MARK, 40 - MARK]
    assert log == [(100 - MARK, 101), (40 - MARK, 41)]


def test_snapshots_are_bounded_in_number_least_recently_used_out_first() -> None:
    cache = PrefixCache(max_bytes=1 << 30, max_snapshots=6)  # two per document: a grid and a cursor snapshot
    documents = [[d * 1000 + i for i in range(200)] for d in range(5)]
    for ids in documents[:3]:
        encode_one(cache, ids, [])
    encode_one(cache, [*documents[0], 1], [])  # the first place typed at again: used most recently
    for ids in documents[3:]:
        encode_one(cache, ids, [])
    log: list[tuple[int, int]] = []
    assert encode_one(cache, [*documents[0], 2], log)[1] > 0  # kept
    assert encode_one(cache, [*documents[1], 2], log)[1] == 0  # dropped: the least recently used
    assert len(cache._snapshots) == 6


def test_an_edit_before_the_snapshots_misses() -> None:
    cache = PrefixCache(max_bytes=1 << 20)
    encode_one(cache, list(range(300)), [])
    log: list[tuple[int, int]] = []
    edited = [7, *range(1, 300)]
    held, reused = encode_one(cache, edited, log)
    assert held == edited and reused == 0 and log == [(0, 300)]


@pytest.mark.parametrize("lines", [12, 40])  # ~130 tokens; ~450: past the tiny model's window (256)
def test_reuse_gives_the_fresh_answer(tiny_model_dir: Path, lines: int) -> None:
    body = "".join(f"    total += values[{i}] * {i}\n" for i in range(lines))
    prefix = "def weighted(values):\n    total = 0\n" + body + "    return tot"
    suffix = "\n"
    settings = {"gap_tokens": 8, "max_new_tokens": 8, "max_steps": 4}
    cached = Engine.load(str(tiny_model_dir), "cpu", dtype="float32")
    fresh = Engine.load(str(tiny_model_dir), "cpu", prefix_cache_mb=0, dtype="float32")
    first = cached.infill(prefix, suffix, settings)
    assert first.prefix_reused_tokens == 0
    previous = first
    for typed in ("a", "al", "al +"):  # keystrokes: each request starts from the last one's cursor snapshot
        now = cached.infill(prefix + typed, suffix, settings)
        assert now.prefix_reused_tokens == previous.prefix_tokens - MARK
        assert now.tokens == fresh.infill(prefix + typed, suffix, settings).tokens
        previous = now
    assert cached.prefix_cache.nbytes > 0
    # Per request, reuse can be turned off: the same engine then encodes the whole prefix, same answer.
    unreused = cached.infill(prefix + "al +", suffix, {**settings, "reuse_prefix": False})
    assert unreused.prefix_reused_tokens == 0 and unreused.tokens == previous.tokens


def test_a_reused_cache_holds_the_keys_and_values_a_fresh_encode_makes(tiny_model_dir: Path) -> None:
    """Past the sliding window: the snapshots are cut from caches that recorded the tokens that slid out, and the
    caches handed to the decoder are back to their window, recording no more."""
    engine = Engine.load(str(tiny_model_dir), "cpu", dtype="float32")
    model, tokenizer = engine.loaded.model, engine.tokenizer
    window = model.config.get_text_config().sliding_window
    text = "".join(f"x{i} = values[{i}] * {i}\n" for i in range(60))
    others = ["".join(f"y{i} = weights[{i}] + {i}\n" for i in range(60)), "".join(f"z{i} = {i}\n" for i in range(90))]
    cache = PrefixCache(max_bytes=1 << 30)
    # a new document, then typing on (asked twice at the end: a snapshot serves again after a request encoded on its
    # copy); then that one typed on beside two new ones (those two rows of one batched forward: `encode_rows`)
    for texts in ([text[:-20]], [text[:-12]], [text[:-11]], [text], [text], [text + "z", *others]):
        id_lists = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        for ids, reused_cache in zip(id_lists, encode_prefixes(model, id_lists, cache), strict=True):
            assert len(ids) > window + MARK
            (fresh_cache,) = encode_prefixes(model, [ids], None)
            for kind, reused, fresh in zip(model.config.get_text_config().layer_types, reused_cache.cache.layers,
                                           fresh_cache.cache.layers, strict=True):  # fmt: skip
                assert reused.keys.shape == fresh.keys.shape
                assert reused.keys.shape[2] == (window - 1 if kind == "sliding_attention" else len(ids))
                assert torch.allclose(reused.keys, fresh.keys, atol=1e-5)
                assert torch.allclose(reused.values, fresh.values, atol=1e-5)
                assert not getattr(reused, "record_past", False)
                assert reused.keys.untyped_storage().nbytes() == reused.keys.nbytes  # the cropped tokens freed
    assert cache.hits == 5
    for snapshot in cache._snapshots.values():  # what a snapshot holds is what its bytes count
        assert snapshot.nbytes == sum(layer.keys.untyped_storage().nbytes() + layer.values.untyped_storage().nbytes()
                                      for layer in snapshot.cache.layers)  # fmt: skip


def test_memory_stays_bounded(tiny_model_dir: Path) -> None:
    engine = Engine.load(str(tiny_model_dir), "cpu", prefix_cache_mb=1)
    engine.prefix_cache.max_bytes = 60_000  # a few snapshots of the tiny model
    for n in range(12):
        engine.infill(f"# file {n}\n" + "x = 1\n" * 120, "", {"gap_tokens": 4, "max_new_tokens": 4, "max_steps": 2})
        assert engine.prefix_cache.nbytes <= 60_000
