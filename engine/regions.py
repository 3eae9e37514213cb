"""Holes and regions of a text, for fills of several holes in one canvas: pure text, no torch (the language server
imports it to lay out its requests).

    Hole            a hole (strength 1) or a span to rewrite (its current text, strength < 1)
    Region          offsets [start, end) of a text, and a strength
    regions_to_parts(text, regions) -> [text, Hole, text, ..., Hole, text]
    split_parts(parts)              -> (prefix, middle, suffix): what `Engine.fill` takes
    parts_to_json / parts_from_json -> the resident engine's `/v1/fill` segments
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Hole:
    """A hole in `Engine.fill`'s middle. A plain hole (strength 1) starts from noise; a span rewrite starts from
    the span's current `text` with a share `strength` (0 < strength < 1) of its tokens renoised (SDEdit for text)."""

    text: str = ""
    strength: float = 1.0


class FillError(ValueError):
    """A fill the engine cannot lay out: no hole, too many, a canvas over its budget, a bad strength, regions that
    overlap or fall outside the text."""


@dataclass(frozen=True)
class Region:
    """A span of a text to fill: offsets [start, end); strength 1 is a hole (its current text is dropped), below 1
    a rewrite of the current text."""

    start: int
    end: int
    strength: float = 1.0


def regions_to_parts(text: str, regions: list[Region]) -> list[str | Hole]:
    """The text cut at `regions` into [text, Hole, text, ..., Hole, text] (document order). Reversed, out-of-range
    and overlapping regions are a FillError naming the region (numbered from 1 in the order given)."""
    for number, region in enumerate(regions, 1):
        if region.start > region.end:
            raise FillError(f"region {number} is reversed (its end comes before its start)")
        if region.start < 0 or region.end > len(text):
            raise FillError(f"region {number} lies outside the document")
    ordered = sorted(enumerate(regions, 1), key=lambda item: (item[1].start, item[1].end))
    for (first, a), (second, b) in itertools.pairwise(ordered):
        if b.start < a.end or (a.start == a.end == b.start == b.end):
            raise FillError(f"regions {min(first, second)} and {max(first, second)} overlap")
    parts: list[str | Hole] = []
    position = 0
    for _, region in ordered:
        parts += [text[position : region.start], Hole(text[region.start : region.end], region.strength)]
        position = region.end
    return [*parts, text[position:]]


def split_parts(parts: list[str | Hole]) -> tuple[str, list[str | Hole], str]:
    """[text..., Hole, ..., Hole, text...] -> (prefix, middle, suffix): the text before the first hole, the holes
    and the text between them, the text after the last one."""
    holes = [i for i, part in enumerate(parts) if isinstance(part, Hole)]
    if not holes:
        raise FillError("nothing to fill: no hole given")
    prefix = "".join(p for p in parts[: holes[0]] if isinstance(p, str))
    suffix = "".join(p for p in parts[holes[-1] + 1 :] if isinstance(p, str))
    return prefix, list(parts[holes[0] : holes[-1] + 1]), suffix


def parts_to_json(parts: list[str | Hole]) -> list[dict[str, Any]]:
    """`/v1/fill` segments: {"text": ...}, {"hole": true} or {"rewrite": current text, "strength": s}."""
    return [
        {"text": part} if isinstance(part, str)
        else {"hole": True} if part.strength >= 1
        else {"rewrite": part.text, "strength": part.strength}
        for part in parts
    ]  # fmt: skip


def parts_from_json(segments: list[Any]) -> list[str | Hole]:
    """The inverse of `parts_to_json`; a malformed segment is a FillError saying what a segment looks like."""
    parts: list[str | Hole] = []
    for segment in segments:
        keys = set(segment) if isinstance(segment, dict) else set()
        if keys == {"text"} and isinstance(segment["text"], str):
            parts.append(segment["text"])
        elif keys == {"hole"} and segment["hole"] is True:
            parts.append(Hole())
        elif keys in ({"rewrite"}, {"rewrite", "strength"}) and isinstance(segment["rewrite"], str):
            strength = segment.get("strength", 0.5)
            if isinstance(strength, bool) or not isinstance(strength, int | float):
                raise FillError("a rewrite's 'strength' must be a number")
            parts.append(Hole(segment["rewrite"], float(strength)))
        else:
            raise FillError('each segment is {"text": str}, {"hole": true} or {"rewrite": str, "strength": number}')
    return parts
