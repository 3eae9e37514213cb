"""LSP positions <-> string offsets.

LSP positions are 0-based (line, character) where `character` counts UTF-16 code units by default. A character
past the end of its line means the end of that line (as the LSP spec says); a line past the end of the text is an
error the caller reports.
"""

from __future__ import annotations


class PositionError(ValueError):
    pass


def _utf16_to_index(line: str, units: int) -> int:
    """Index into `line` (Python str, code points) of the UTF-16 offset `units`, clamped to the line's end."""
    count = 0
    for index, char in enumerate(line):
        if count >= units:
            return index
        count += 2 if ord(char) > 0xFFFF else 1
    return len(line)


def offset_at(text: str, line: int, character: int) -> int:
    """The offset in `text` of the LSP position (line, character in UTF-16 units)."""
    if line < 0 or character < 0:
        raise PositionError(f"position {line}:{character} is negative")
    lines = text.split("\n")
    if line >= len(lines):
        raise PositionError(f"line {line} is past the end of the text ({len(lines)} lines, 0-based)")
    start = sum(len(lines[i]) + 1 for i in range(line))
    content = lines[line].removesuffix("\r")
    return start + _utf16_to_index(content, character)
