"""The clamped suffix head's keys and values kept between steps: the steps in between run the gap alone.

A canvas is [G gap slots | S suffix-head tokens, clamped]. Each step's decoder forward recomputes all G + S slots,
yet the S clamped tokens never change: only what they attend to (the gap) does. With `suffix_refresh` N > 1, a
step computes the whole canvas every N steps (a canvas's first step among them) and records, per layer, the keys
and values its clamped slots produced; the steps between run the G gap slots alone, attending to the prefix's
encoder cache and those recorded keys and values, as if they were cached context at their own positions (the keys
carry their rotary positions already). The gap still sees the suffix head every step; the suffix head sees the gap
as it was at the last full step. That is an approximation (the dual cache of Fast-dLLM, Wu et al. 2025, refreshed
per block there): answers may differ from every-step forwards, so N = 1 (exact) is the default and a model's
`canvas_ls.json` or a request may ask for more. A step of 16 gap slots instead of 32 reads the same weights and
does half the arithmetic, which is what a CPU's compute-bound step costs.

Recording happens in the decoder's attention layers, where transformers' `append_to_cache` receives each layer's
canvas keys and values (normalised, rotated) to concatenate after the encoder cache: `recording_kv` wraps it on each
layer for one forward, which runs eager (a compiled graph does not call back into Python), and takes the wrappers
off after it. Only then: a graph traced with a wrapper in place guards on that very function object, which no other
process has, so a graph saved by the compiling child would serve no step of the engine (measured: every step eager).
The gap-only steps run as any other step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .encoding import KVLayer


class ExtendedCache:
    """A job's encoder cache with its clamped slots' recorded keys and values after it: what a gap-only step reads
    (`layers[i].keys/values`, as `BatchedKV` reads a DynamicCache)."""

    def __init__(self, cache: Any, recorded: list[tuple[torch.Tensor, torch.Tensor]]):
        self.layers = [KVLayer(torch.cat([layer.keys, keys], dim=2), torch.cat([layer.values, values], dim=2))
                       for layer, (keys, values) in zip(cache.layers, recorded, strict=True)]  # fmt: skip


@contextmanager
def recording_kv(model: Any) -> Iterator[dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """Within the block, each decoder forward of `model` leaves {layer index: (keys, values)} of its canvas, [B, H,
    Lc, D] each, in the dict it yields; after it, the layers are as they were (their class's `append_to_cache`)."""
    recorded: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    attentions = [layer.self_attn for layer in model.model.decoder.layers]
    for attention in attentions:
        attention.append_to_cache = _recording(attention.append_to_cache, attention.layer_idx, recorded)
    try:
        yield recorded
    finally:
        for attention in attentions:
            del attention.append_to_cache


def _recording(append: Any, index: int, recorded: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> Any:
    def append_to_cache(cache: Any, key_states: torch.Tensor, value_states: torch.Tensor) -> Any:
        recorded[index] = (key_states, value_states)
        return append(cache, key_states, value_states)

    return append_to_cache


def clamped_slots(recording: dict[int, tuple[torch.Tensor, torch.Tensor]], row: int, start: int, end: int
                  ) -> list[tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
    """Row `row`'s recorded keys and values of canvas slots [start, end), per layer in order, copied out of the
    batch's tensors (those are freed after the step)."""
    return [(keys[row : row + 1, :, start:end].clone(), values[row : row + 1, :, start:end].clone())
            for _, (keys, values) in sorted(recording.items())]  # fmt: skip
