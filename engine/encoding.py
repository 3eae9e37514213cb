"""The encoder side of a canvas: prefixes into KV caches, several at once grouped by length (`encode_rows`), reusing
the prefix cache's snapshots (`encode_prefixes`: only a prefix's new tail is encoded)."""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from transformers import DynamicCache

from .prefix_cache import PrefixCache


@torch.inference_mode()
def encode(model: Any, ids: torch.Tensor, cache: DynamicCache, start: int) -> None:
    """Run the causal encoder over `ids` ([1, n]) at positions start..start+n-1, appending to `cache`."""
    positions = torch.arange(start, start + ids.shape[1], device=ids.device).unsqueeze(0)
    model.model.encoder(input_ids=ids, position_ids=positions, cache=cache, use_cache=True)


@dataclass
class EncodedPrefix:
    cache: DynamicCache  # the encoder KV of the whole prefix
    reused: int  # tokens that came from a prefix-cache snapshot
    seconds: float  # the encode's wall time (shared by the prefixes encoded together)


def encode_prefixes(model: Any, id_lists: list[Sequence[int]], prefix_cache: PrefixCache | None) -> list[EncodedPrefix]:
    """Encode several prefixes together (each reusing a snapshot when the cache holds one)."""
    started = time.perf_counter()
    config = model.config.get_text_config(decoder=True)
    if prefix_cache is not None:
        held = prefix_cache.encode_many(id_lists, partial(_recording_cache, config), partial(encode_rows, model),
                                        _cropped)  # fmt: skip
        for cache, _ in held:
            _settle(cache)
    else:
        held = [(DynamicCache(config=config), 0) for _ in id_lists]
        encode_rows(model, [cache for cache, _ in held], list(id_lists), [0] * len(id_lists))
    seconds = time.perf_counter() - started
    return [EncodedPrefix(cache, reused, seconds) for cache, reused in held]


def _recording_cache(config: Any) -> DynamicCache:
    """A cache whose sliding-window layers keep the tokens that slide out until cropped, so that the prefix cache's
    snapshots can be cut from it after an encode (`PrefixCache.encode_many`); snapshots copied from it record too."""
    cache = DynamicCache(config=config)
    cache.activate_past_recording()
    return cache


def _cropped(cache: DynamicCache, remove: int) -> DynamicCache:
    """A copy of a recording cache without its last `remove` tokens, its sliding layers back to their window (0: a
    copy to encode on). The copy has layers of its own over the same tensors: transformers' dynamic layers never
    write a tensor they hold, they replace it (an encode concatenates, a crop slices), so neither cache can change
    the other's; what a crop keeps of a longer tensor is copied out (`_compact`)."""
    copied = copy.copy(cache)
    copied.layers = [copy.copy(layer) for layer in cache.layers]
    copied.crop(-remove)
    for layer in copied.layers:
        _compact(layer)
    return copied


def _settle(cache: DynamicCache) -> None:
    """A recording cache as the decoder and later encodes read it: its sliding layers back to their window, and
    recording no more."""
    for layer in cache.layers:
        if getattr(layer, "record_past", False):
            if layer.is_initialized:
                layer.crop(0)
                _compact(layer)
            layer.record_past = False


def _compact(layer: Any) -> None:
    """A cropped layer's keys and values are views of the longer tensors it held: copies of what they show, so that
    the tokens cropped off are freed (and a snapshot's bytes are what `cache_bytes` counts)."""
    if layer.is_initialized and layer.keys.untyped_storage().nbytes() > layer.keys.nbytes:
        layer.keys, layer.values = layer.keys.clone(), layer.values.clone()


@torch.inference_mode()
def encode_rows(model: Any, caches: list[DynamicCache], id_lists: list[Sequence[int]], starts: list[int]) -> None:
    """Append id_lists[r] to caches[r] at positions starts[r]..., rows of similar lengths in one encoder forward: the
    resident engine encodes the prefixes of requests that arrive together at once (one forward's fixed cost, not
    one each).

    Rows differ in cached and new lengths, so each row's cache is left-padded and so are its new tokens; the
    masks are built from positions (causal, and the sliding window for sliding layers), exactly what each row's
    own forward would see. Padding queries attend only to themselves (no all-masked rows, no NaN). After the
    forward each row's new keys and values are appended to its own cache, which crops its sliding layers itself.
    """
    rows = sorted(((c, list(ids), s) for c, ids, s in zip(caches, id_lists, starts, strict=True) if len(ids)),
                  key=lambda row: len(row[1]))  # fmt: skip
    # Rows of similar lengths go together: padding 20 new tokens up to 2,000 would cost more than it saves.
    group: list[tuple[DynamicCache, list[int], int]] = []
    for row in rows:
        if group and len(row[1]) > PAD_RATIO * len(group[0][1]) + PAD_SLACK:
            _encode_group(model, group)
            group = []
        group.append(row)
    if group:
        _encode_group(model, group)


# A batched encode takes rows whose new lengths are within PAD_RATIO x + PAD_SLACK of the shortest one.
PAD_RATIO, PAD_SLACK = 2, 32


def _encode_group(model: Any, rows: list[tuple[DynamicCache, list[int], int]]) -> None:
    device = model.device
    if len(rows) == 1:
        cache, ids, start = rows[0]
        encode(model, torch.tensor([ids], dtype=torch.long, device=device), cache, start)
        return
    config = model.config.get_text_config()
    width = max(len(ids) for _, ids, _ in rows)
    new_pad = torch.tensor([width - len(ids) for _, ids, _ in rows], device=device)  # [B]
    input_ids = torch.tensor([[0] * (width - len(ids)) + ids for _, ids, _ in rows], device=device)  # [B, N]
    ends = torch.tensor([start + len(ids) for _, ids, start in rows], device=device)
    positions = (ends[:, None] - width + torch.arange(width, device=device)[None, :]).clamp_(min=0)  # [B, N]
    query_ok = torch.arange(width, device=device)[None, :] >= new_pad[:, None]  # [B, N] real tokens
    appending = _AppendingRows([c for c, _, _ in rows], config.layer_types, device)
    masks = {}
    for kind, cached in appending.cached.items():  # cached: [B] entries each row's cache holds for this kind
        past = int(cached.max())
        past_positions = torch.tensor([s for _, _, s in rows], device=device)[:, None] - past + torch.arange(
            past, device=device)[None, :]  # fmt: skip
        past_ok = torch.arange(past, device=device)[None, :] >= (past - cached)[:, None]  # left padding off
        key_positions = torch.cat([past_positions, positions], dim=1)  # [B, P + N]
        key_ok = torch.cat([past_ok, query_ok], dim=1)
        allowed = key_ok[:, None, :] & (key_positions[:, None, :] <= positions[:, :, None])  # [B, N, P + N]
        if kind == "sliding_attention":
            allowed &= key_positions[:, None, :] > positions[:, :, None] - config.sliding_window
        own = torch.zeros_like(allowed)
        own[:, :, past:] = torch.eye(width, dtype=torch.bool, device=device)
        masks[kind] = torch.where(query_ok[:, :, None], allowed, own)[:, None]  # [B, 1, N, P + N]
    model.model.encoder(input_ids=input_ids, position_ids=positions, cache=appending,
                        attention_mask=masks)  # fmt: skip
    appending.commit(new_pad.tolist())


class _AppendingRows:
    """The cache an encoder forward over several rows reads and writes: each layer returns the rows' own cached
    keys (left-padded to one length) followed by the new ones; `commit` appends the new ones to each row's cache.
    """

    is_compileable = False

    def __init__(self, caches: list[DynamicCache], layer_types: list[str], device: torch.device):
        self.caches, self.layer_types = caches, layer_types
        self.new: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.cached: dict[str, torch.Tensor] = {}  # layer type -> [B] entries held per row (on the model's device)
        for index, kind in enumerate(layer_types):
            held = [self._held(cache, index) for cache in caches]
            self.cached.setdefault(kind, torch.tensor(held, device=device))

    @staticmethod
    def _held(cache: DynamicCache, index: int) -> int:
        layer = cache.layers[index] if index < len(cache.layers) else None
        keys = getattr(layer, "keys", None) if layer is not None and layer.is_initialized else None
        return 0 if keys is None or keys.numel() == 0 else keys.shape[2]

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        self.new[layer_idx] = (keys, values)
        width = int(self.cached[self.layer_types[layer_idx]].max())
        if width == 0:
            return keys, values
        empty = keys.new_zeros((1, keys.shape[1], 0, keys.shape[3]))
        held = self.cached[self.layer_types[layer_idx]].tolist()
        past_keys = [c.layers[layer_idx].keys if n else empty for c, n in zip(self.caches, held, strict=True)]
        past_values = [c.layers[layer_idx].values if n else empty for c, n in zip(self.caches, held, strict=True)]
        return (torch.cat([left_pad(past_keys, width), keys], dim=2),
                torch.cat([left_pad(past_values, width), values], dim=2))  # fmt: skip

    def commit(self, pads: list[int]) -> None:
        for layer_idx, (keys, values) in sorted(self.new.items()):
            for row, (cache, pad) in enumerate(zip(self.caches, pads, strict=True)):
                cache.update(keys[row : row + 1, :, pad:], values[row : row + 1, :, pad:], layer_idx)


@dataclass
class KVLayer:
    """One layer's keys and values, [B, H, L, D] each, as the decoder reads a cache's (`cache.layers[i]`)."""

    keys: torch.Tensor
    values: torch.Tensor


def left_pad(tensors: list[torch.Tensor], width: int) -> torch.Tensor:
    return torch.cat([torch.nn.functional.pad(t, (0, 0, width - t.shape[2], 0)) for t in tensors], dim=0)
