"""LSP positions <-> string offsets, and UTF-8 byte positions for tree-sitter.

LSP positions are 0-based (line, character) where `character` counts UTF-16 code units by default. A character
past the end of its line means the end of that line (as the LSP spec says); a line past the end of the text is an
error the caller reports. Text may hold lone surrogates (a client's rendering of undecodable bytes): encoding uses
`surrogatepass`, so every str has a byte form and offsets stay consistent.
"""

from __future__ import annotations

from bisect import bisect_right


class PositionError(ValueError):
    pass


def utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


def _width(char: str, encoding: str) -> int:
    """Code units of one character in the negotiated position encoding ("utf-16", "utf-8" or "utf-32")."""
    if encoding == "utf-16":
        return 2 if ord(char) > 0xFFFF else 1
    if encoding == "utf-8":
        return len(utf8(char))
    return 1


def _units_to_index(line: str, units: int, encoding: str) -> int:
    """Index into `line` (Python str, code points) of the offset `units` in code units, clamped to the line's end."""
    if encoding == "utf-32":
        return min(units, len(line))
    count = 0
    for index, char in enumerate(line):
        if count >= units:
            return index
        count += _width(char, encoding)
    return len(line)


class LineIndex:
    """Line starts of one text, computed once, for position <-> offset conversions."""

    def __init__(self, text: str, encoding: str = "utf-16"):
        self.text = text
        self.encoding = encoding
        self.starts = [0]
        position = text.find("\n")
        while position >= 0:
            self.starts.append(position + 1)
            position = text.find("\n", position + 1)

    def line_text(self, line: int) -> str:
        end = self.starts[line + 1] - 1 if line + 1 < len(self.starts) else len(self.text)
        return self.text[self.starts[line] : end].removesuffix("\r")

    def offset(self, line: int, character: int) -> int:
        if line < 0 or character < 0:
            raise PositionError(f"position {line}:{character} is negative")
        if line >= len(self.starts):
            raise PositionError(f"line {line} is past the end of the text ({len(self.starts)} lines, 0-based)")
        return self.starts[line] + _units_to_index(self.line_text(line), character, self.encoding)

    def line_of(self, offset: int) -> int:
        return bisect_right(self.starts, offset) - 1

    def point(self, offset: int) -> tuple[int, int]:
        """tree-sitter point (row, byte column) of a string offset."""
        line = self.line_of(offset)
        return line, len(utf8(self.text[self.starts[line] : offset]))

    def position(self, offset: int) -> tuple[int, int]:
        """LSP (line, character) of a string offset, in this index's encoding."""
        line = self.line_of(offset)
        return line, sum(_width(c, self.encoding) for c in self.text[self.starts[line] : offset])


def offset_at(text: str, line: int, character: int, encoding: str = "utf-16", strict: bool = False) -> int:
    """The offset in `text` of the LSP position (line, character in `encoding` code units). A character past the
    end of its line is the line's end (LSP's rule), or with `strict` (the command line) an error naming the line's
    length."""
    index = LineIndex(text, encoding)
    offset = index.offset(line, character)
    if strict:
        length = sum(_width(c, encoding) for c in index.line_text(line))
        if character > length:
            raise PositionError(f"character {character} is past the end of line {line}, which has {length} "
                                f"characters ({encoding} code units, 0-based positions 0-{length})")  # fmt: skip
    return offset
