from __future__ import annotations

import pytest

from canvas_ls.server.positions import PositionError, offset_at

TEXT = "ab\n😀x\r\nlast"


@pytest.mark.parametrize(
    ("line", "character", "offset"),
    [
        (0, 0, 0),
        (0, 2, 2),
        (0, 99, 2),  # past the end of the line: the end of the line (LSP spec)
        (1, 2, 4),  # the emoji is two UTF-16 units, one Python character
        (1, 3, 5),
        (1, 9, 5),  # the CR of a CRLF line ending is not part of the line
        (2, 4, 11),
    ],
)
def test_offsets_count_utf16_units(line: int, character: int, offset: int) -> None:
    assert offset_at(TEXT, line, character) == offset


def test_line_past_the_end_is_an_error() -> None:
    with pytest.raises(PositionError, match="line 3 is past the end of the text"):
        offset_at(TEXT, 3, 0)
