"""canvas-ls's own LSP methods and commands: their params typed in lsprotocol's style (attrs classes, camelCase on the
wire, lsprotocol's `Position`, `Range` and document identifiers inside), structured strictly. A request whose params
do not fit is answered -32602 by the dispatcher (`wire.Dispatcher`) before any handler runs, with the field and why
("expected int @ $.position.line"); a command's argument likewise (`argument`).

    canvas/fill          FillParams         {textDocument: {uri}, position}
    canvas/prefetch      PrefetchParams     {textDocument: {uri, version?}, position, wait?}
    canvas/nextEdit      NextEditParams     {textDocument: {uri, version?}, position}
    canvas/fillRegions   FillRegionsParams  {textDocument: {uri}, regions?: [{range, strength?}], position?, apply?}
    canvas-ls.fillHoles  FillHolesArgument  {textDocument: {uri}, position}
    canvas-ls.rewriteSelection  RewriteArgument  {textDocument: {uri}, range}
    canvas-ls.learnWorkspace  LearnArgument {folder?} (or the folder as a string)
    canvas-ls.accepted   AcceptedArguments  [shown, chars?] (in order: what the inline item's command carries)
"""

from __future__ import annotations

import re
from typing import Any, TypeVar

import attrs
import cattrs
from cattrs.cols import is_sequence, list_structure_factory
from lsprotocol import converters, types
from pygls.exceptions import JsonRpcInvalidParams

FILL_METHOD = "canvas/fill"
PREFETCH_METHOD = "canvas/prefetch"
NEXT_EDIT_METHOD = "canvas/nextEdit"
FILL_REGIONS_METHOD = "canvas/fillRegions"
FILL_HOLES_COMMAND = "canvas-ls.fillHoles"
REWRITE_COMMAND = "canvas-ls.rewriteSelection"
LEARN_COMMAND = "canvas-ls.learnWorkspace"

T = TypeVar("T")


@attrs.define(frozen=True)
class FillParams:
    text_document: types.TextDocumentIdentifier
    position: types.Position


FillHolesArgument = FillParams  # the holes of the function or class at a position: the same two fields


@attrs.define(frozen=True)
class NextEditParams:
    text_document: types.OptionalVersionedTextDocumentIdentifier  # a version: stale unless the document's
    position: types.Position


@attrs.define(frozen=True)
class PrefetchParams(NextEditParams):
    wait: bool = False  # answer once the completion is done ({ready}), not at once


@attrs.define(frozen=True)
class RegionParams:
    range: types.Range
    strength: float | None = None  # a rewrite's share of tokens renoised; None: a hole filled anew


@attrs.define(frozen=True)
class FillRegionsParams:
    text_document: types.TextDocumentIdentifier
    regions: list[RegionParams] | None = None
    position: types.Position | None = None  # instead of regions: the holes of the function or class there
    apply: bool = False


@attrs.define(frozen=True)
class RewriteArgument:
    text_document: types.TextDocumentIdentifier
    range: types.Range


@attrs.define(frozen=True)
class LearnArgument:
    folder: str | None = None  # a URI or a path; None: the first workspace folder


@attrs.define(frozen=True)
class AcceptedArguments:
    shown: int  # the suggestion's id (the inline item's command carries it)
    chars: int | None = None  # the characters a partial accept took; None: all of it


PARAMS: dict[str, type] = {
    FILL_METHOD: FillParams,
    PREFETCH_METHOD: PrefetchParams,
    NEXT_EDIT_METHOD: NextEditParams,
    FILL_REGIONS_METHOD: FillRegionsParams,
}


def _strict(kind: type) -> Any:
    """A scalar taken as it is (never converted: "3" is no int, 1 no string, true no number)."""

    def structure(value: Any, _: Any) -> Any:
        if isinstance(value, bool) != (kind is bool) or not isinstance(value, float | int if kind is float else kind):
            raise TypeError(f"expected {kind.__name__}, got {type(value).__name__}")
        return float(value) if kind is float else value

    return structure


def _strict_list(kind: Any, converter: cattrs.Converter) -> Any:
    """A list taken only from a JSON array (a string is no list of its characters)."""
    items = list_structure_factory(kind, converter)

    def structure(value: Any, _: Any) -> Any:
        if not isinstance(value, list):
            raise TypeError(f"expected list, got {type(value).__name__}")
        return items(value, kind)

    return structure


def _converter() -> cattrs.Converter:
    converter = converters.get_converter()
    for kind in (bool, int, float, str):
        converter.register_structure_hook(kind, _strict(kind))
    converter.register_structure_hook_factory(is_sequence, _strict_list)
    return converter


CONVERTER = _converter()


def structure(value: Any, cls: type[T], what: str) -> T:
    """`value` as `cls`, or JsonRpcInvalidParams naming each field that does not fit and why."""
    try:
        return CONVERTER.structure(value if value is not None else {}, cls)
    except Exception as exc:  # cattrs' grouped errors, or a validator's
        raise JsonRpcInvalidParams(f"Invalid params for {what}: {'; '.join(_why(exc))}") from None


def argument(arguments: tuple[Any, ...], cls: type[T], command: str) -> T:
    """A command's one argument (absent: empty) as `cls`."""
    value = arguments[0] if arguments else {}
    if not isinstance(value, dict):
        raise JsonRpcInvalidParams(f"{command} takes one object argument, not {type(value).__name__}")
    return structure(value, cls, command)


def positional(arguments: tuple[Any, ...], cls: type[T], command: str) -> T:
    """A command's arguments given in order (`cls`'s fields, the first first), as `cls`."""
    names = [field.name for field in attrs.fields(cls)]
    if len(arguments) > len(names):
        raise JsonRpcInvalidParams(f"{command} takes [{', '.join(names)}], not {len(arguments)} arguments")
    return structure(dict(zip(names, arguments, strict=False)), cls, command)


def _why(exc: Exception) -> list[str]:
    if not isinstance(exc, cattrs.BaseValidationError):
        return [str(exc)]

    def text(error: BaseException, kind: Any) -> str:
        if isinstance(error, TypeError | ValueError) and not isinstance(error, cattrs.ForbiddenExtraKeysError):
            return str(error).rstrip(".")  # ours (`_strict`) and lsprotocol's validators ("should be in range")
        return cattrs.v.format_exception(error, kind)

    return [_wire_names(line) for line in cattrs.transform_error(exc, format_exception=text)]


def _wire_names(line: str) -> str:
    """cattrs' path in the wire's names: "@ $.text_document.uri" -> "@ $.textDocument.uri"."""
    message, at, path = line.rpartition(" @ $")
    return f"{message}{at}{re.sub(r'_([a-z])', lambda m: m.group(1).upper(), path)}" if at else line
