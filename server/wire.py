"""The wire: bytes from the client in, one guarded dispatch per message, JSON-RPC errors out.

Everything the editor sends passes through `Frames` (bytes -> bodies) and `Dispatcher.receive` (body -> pygls), and
every message ends in exactly one of: handled by pygls (which answers a request, also when its handler raises);
answered here with the error JSON-RPC names for it (-32700 parse error, -32600 invalid request, -32602 invalid
params, -32603 internal error, -32002 server not initialized); or, for what nothing can answer (a notification,
a response), dropped and logged. No byte sequence raises out of here.

This is also the one module that touches pygls's private API (`JsonRPCProtocol._send_data`, `._converter`,
`._shutdown`): tests/test_wire.py fails when pygls changes them.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any

import attrs
from lsprotocol import types
from pygls.exceptions import JsonRpcInvalidParams
from pygls.protocol import JsonRPCProtocol

from .protocol import PARAMS, structure

log = logging.getLogger(__name__)

# The largest body read (a document of this size is far past what the engine reads); a longer frame is dropped.
MAX_BODY_BYTES = 256 << 20
# Header bytes kept while waiting for a line end (garbage without newlines must not grow the buffer).
MAX_HEADER_BYTES = 64 << 10
HEADER = re.compile(rb"content-length:[ \t]*([^\r\n]*)\r?\n", re.IGNORECASE)
# A complete `Content-Length` header inside a body that is still arriving: no JSON text holds a raw line end after
# these words (JSON strings cannot hold one, and the words are no JSON outside a string), so the body before it was
# cut short and the header begins the next frame.
HEADER_IN_BODY = re.compile(rb"content-length:[ \t]*\d+[ \t]*\r?\n", re.IGNORECASE)
SERVER_NOT_INITIALIZED = -32002


@dataclass(frozen=True)
class Malformed:
    """What the frame reader dropped, and why (answered with a parse error, id null)."""

    reason: str


class Frames:
    """`Content-Length: N`, further headers, a blank line, N bytes of body: fed any bytes, yields the bodies and
    what it dropped. A header is recognised wherever it starts in a line; a bad or oversized length drops that
    header; a body cut short by the next frame's header is dropped and the next frame read. Memory is bounded by
    the longest body allowed, whatever arrives."""

    def __init__(self, max_body: int = MAX_BODY_BYTES) -> None:
        self.max_body = max_body
        self.buffer = bytearray()
        self.length: int | None = None  # the current header's length, once read
        self.in_body = False  # the blank line after the headers has been read
        self.scanned = 0  # body bytes already searched for a header

    def feed(self, data: bytes) -> list[bytes | Malformed]:
        self.buffer += data
        out: list[bytes | Malformed] = []
        while True:
            item = self._body() if self.in_body else self._header_line()
            if item is None:
                return out
            if item is not True:
                out.append(item)

    def _header_line(self) -> Malformed | bool | None:
        end = self.buffer.find(b"\n")
        if end < 0:
            if len(self.buffer) > MAX_HEADER_BYTES:  # keep only what may still begin a header
                del self.buffer[: -len(b"content-length:")]
            return None
        line = bytes(self.buffer[: end + 1])
        del self.buffer[: end + 1]
        at = line.lower().rfind(b"content-length:")  # the last: garbage before it in the line is not its value
        header = HEADER.match(line, at) if at >= 0 else None
        if header is not None:
            value = header.group(1).strip()
            self.length = None
            if not value.isdigit():
                return Malformed(f"Content-Length {value[:40]!r} is not a number")
            if int(value) > self.max_body:
                return Malformed(f"Content-Length {int(value)} is over the limit of {self.max_body} bytes")
            self.length = int(value)
            return True
        if not line.strip() and self.length is not None:
            self.in_body, self.scanned = True, 0
        return True  # another header (Content-Type), stray text, or a blank line without a length

    def _body(self) -> bytes | Malformed | None:
        assert self.length is not None
        cut = HEADER_IN_BODY.search(self.buffer, max(0, self.scanned - 40), min(len(self.buffer), self.length + 40))
        if cut is not None and cut.start() < self.length:
            del self.buffer[: cut.start()]
            self.in_body, self.length = False, None
            return Malformed("a frame shorter than its Content-Length (the next frame's header came first)")
        if len(self.buffer) < self.length or (
            len(self.buffer) < self.length + 40
            and _may_begin_header(self.buffer[max(0, self.length - 40) : self.length])
        ):  # the whole body, and enough after it to see whether a header begins inside it
            self.scanned = min(len(self.buffer), self.length)
            return None
        body = bytes(self.buffer[: self.length])
        del self.buffer[: self.length]
        self.in_body, self.length = False, None
        return body


def _may_begin_header(tail: bytes | bytearray) -> bool:
    """Whether the end of a body could be the start of a header (no JSON message ends so: it ends with } or ])."""
    low, word = bytes(tail).lower(), b"content-length:"
    for at in range(len(low)):
        rest = low[at:]
        if word.startswith(rest) or (rest.startswith(word) and re.fullmatch(rb"[ \t]*\d*[ \t]*\r?", rest[len(word) :])):
            return True
    return False


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse(body: bytes) -> Any:
    """The JSON value of a body; ValueError (with the reason) for anything that is not strict UTF-8 JSON."""
    try:
        return json.loads(body.decode("utf-8"), parse_constant=_no_constant)
    except UnicodeDecodeError as exc:
        raise ValueError(f"the body is not UTF-8 ({exc.reason} at byte {exc.start})") from exc
    except RecursionError as exc:
        raise ValueError("the body is nested too deeply") from exc


def valid_id(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))


def request_id(message: Any) -> Any:
    """The id of a request (a message with a method and a valid id); None for anything else."""
    if isinstance(message, dict) and isinstance(message.get("method"), str) and valid_id(message.get("id")):
        return message["id"]
    return None


class Dispatcher:
    """Checks each message's envelope, types it with pygls's converter and hands it to pygls's protocol, answering
    here what pygls would not answer (or would crash on)."""

    def __init__(self, protocol: JsonRPCProtocol) -> None:
        self.protocol = protocol
        self.initialized = False  # `initialize` has been received

    def receive(self, item: bytes | Malformed) -> None:
        """One frame from `Frames`. Never raises."""
        if isinstance(item, Malformed):
            self.reply_error(None, types.ErrorCodes.ParseError, f"Parse error: {item.reason}")
            return
        try:
            message = parse(item)
        except ValueError as exc:
            self.reply_error(None, types.ErrorCodes.ParseError, f"Parse error: {exc}")
            return
        request = request_id(message)
        try:
            self._dispatch(message, request)
        except Exception as exc:  # a bug of ours or of pygls's: the request still gets its answer
            log.exception("a message could not be handled")
            if request is not None:
                self.reply_error(request, types.ErrorCodes.InternalError, f"Internal error: {_first_line(exc)}")

    def _dispatch(self, message: Any, request: Any) -> None:
        if not isinstance(message, dict):
            kind = "a batch (LSP has none)" if isinstance(message, list) else f"a {type(message).__name__}"
            self.reply_error(
                None, types.ErrorCodes.InvalidRequest, f"Invalid request: a message is an object, not {kind}"
            )
            return
        method = message.get("method")
        if method is None and ("result" in message or "error" in message):
            self._response(message)
            return
        reason = None
        if not isinstance(method, str):
            reason = "it has no method" if method is None else "its method is not a string"
        elif "id" in message and request is None:
            reason = "its id is neither a number nor a string"
        if reason is not None:
            self.reply_error(None, types.ErrorCodes.InvalidRequest, f"Invalid request: {reason}")
            return
        if message.get("jsonrpc") != "2.0":
            self._refuse(request, method, types.ErrorCodes.InvalidRequest, 'Invalid request: "jsonrpc" is not "2.0"')
            return
        params = message.get("params")
        if params is not None and not isinstance(params, dict | list):
            self._refuse(request, method, types.ErrorCodes.InvalidParams,
                         f"Invalid params for {method}: params must be an object or an array")  # fmt: skip
            return
        if method == types.INITIALIZE:
            self.initialized = True
        elif not self.initialized and method != types.EXIT:
            self._refuse(request, method, SERVER_NOT_INITIALIZED, f"Server not initialized: {method} before initialize")
            return
        features = self.protocol.fm
        if (
            method not in features.features
            and method not in features.builtin_features
            and method != types.CANCEL_REQUEST
        ):
            if request is not None:
                self.reply_error(request, types.ErrorCodes.MethodNotFound, f"Method not found: {method[:200]}")
            else:  # an unknown notification is ignored (for `$/` ones, the spec says so)
                log.info("ignored notification %s: not handled here", method[:100])
            return
        if request is not None and self.protocol._shutdown:
            self._refuse(request, method, types.ErrorCodes.InvalidRequest, f"Invalid request: {method} after shutdown")
            return
        try:
            typed = self.protocol.structure_message(message)
        except Exception as exc:
            cause = exc.__cause__ or exc
            self._refuse(request, method, types.ErrorCodes.InvalidParams,
                         f"Invalid params for {method}: {_first_line(cause)}")  # fmt: skip
            return
        if method in PARAMS:  # canvas-ls's own methods: their params typed (`protocol.py`), strictly
            try:
                typed = attrs.evolve(typed, params=structure(params, PARAMS[method], method))
            except JsonRpcInvalidParams as exc:
                self._refuse(request, method, types.ErrorCodes.InvalidParams, str(exc))
                return
        self.protocol.handle_message(typed)

    def _response(self, message: dict[str, Any]) -> None:
        """A client's answer to a request of ours: to pygls when it is well formed, else dropped (nothing answers a
        response)."""
        if message.get("jsonrpc") != "2.0" or not valid_id(message.get("id")):
            log.warning("dropped a malformed response: %.200s", json.dumps(message))
            return
        try:
            self.protocol.handle_message(self.protocol.structure_message(message))
        except Exception as exc:
            log.warning("dropped a response that fits no LSP type: %s", _first_line(exc))

    def _refuse(self, request: Any, method: str, code: int, reason: str) -> None:
        if request is None:
            log.warning("dropped notification %s: %s", method[:100], reason)
        else:
            self.reply_error(request, code, reason)

    def reply_error(self, msg_id: Any, code: int, message: str) -> None:
        """A JSON-RPC error response (id null when the request's id could not be read)."""
        send(self.protocol, {"jsonrpc": "2.0", "id": msg_id, "error": {"code": int(code), "message": message[:1000]}})


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def send(protocol: JsonRPCProtocol, data: dict[str, Any]) -> None:
    """Write one message as it is (pygls's writer, its framing)."""
    protocol._send_data(data)


def unstructure(protocol: JsonRPCProtocol, value: Any) -> Any:
    """An lsprotocol value as JSON data, by pygls's own converter (its field names and omissions)."""
    return protocol._converter.unstructure(value)
