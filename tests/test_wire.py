"""What a client sends, fuzzed: the frame reader on any bytes (in-process), and a real `canvas-ls serve` over stdio
fed arbitrary JSON bodies and every method it registers with mangled params. Every request id gets exactly one
answer, and the server keeps answering. Profiles: the default runs a few seconds a property; `--hypothesis-profile
=long` runs each for up to 10 minutes (tests/conftest.py)."""

from __future__ import annotations

import contextlib
import inspect
import json
from collections.abc import Iterator
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from lsprotocol import types
from pygls.protocol import JsonRPCProtocol

from canvas_ls.server import wire
from canvas_ls.server.wire import Frames, Malformed
from tests.conftest import fuzz
from tests.test_stdio_robustness import RawClient

# -- the adapter: pygls's private API that canvas-ls relies on, in one place -------------------------------------


def test_the_pygls_private_api_that_wire_uses_is_still_there() -> None:
    """If this fails, pygls changed what server/wire.py reaches into: adapt `wire.send`, `wire.unstructure` and
    `Dispatcher` (the protocol's shutdown flag), then this test."""
    from canvas_ls.server.lsp import server

    assert list(inspect.signature(JsonRPCProtocol._send_data).parameters) == ["self", "data"]
    assert hasattr(server.protocol, "_converter") and callable(server.protocol._converter.unstructure)
    assert server.protocol._shutdown is False
    assert list(inspect.signature(JsonRPCProtocol.structure_message).parameters) == ["self", "data"]
    with captured(server.protocol) as written:
        wire.send(server.protocol, {"jsonrpc": "2.0", "id": 7, "result": None})
    head, _, body = written[0].partition(b"\r\n\r\n")
    assert head.startswith(b"Content-Length: %d" % len(body)) and json.loads(body)["id"] == 7
    position = wire.unstructure(server.protocol, types.Position(1, 2))
    assert position == {"line": 1, "character": 2}


@contextlib.contextmanager
def captured(protocol: JsonRPCProtocol) -> Iterator[list[bytes]]:
    """What the protocol writes while the block runs (its writer put back after)."""
    written: list[bytes] = []

    class Sink:
        def write(self, data: bytes) -> None:
            written.append(data)

        def close(self) -> None:
            pass

    writer = protocol.writer
    protocol.set_writer(Sink())
    try:
        yield written
    finally:
        protocol.writer = writer


# -- the frame reader, in-process --------------------------------------------------------------------------------


def frame(body: bytes) -> bytes:
    return b"Content-Length: %d\r\n\r\n" % len(body) + body


BODIES = st.lists(st.builds(lambda n: json.dumps({"jsonrpc": "2.0", "id": n, "method": "x"}).encode(),
                            st.integers()), min_size=1, max_size=5)  # fmt: skip


def feed_in_chunks(frames: Frames, data: bytes, cuts: list[int]) -> list[bytes | Malformed]:
    out, last = [], 0
    for cut in sorted(c % (len(data) + 1) for c in cuts):
        out += frames.feed(data[last:cut])
        last = max(last, cut)
    return out + frames.feed(data[last:])


@fuzz(300)
@given(BODIES, st.lists(st.integers(0, 10_000), max_size=8))
def test_frames_split_anywhere_read_the_same(bodies: list[bytes], cuts: list[int]) -> None:
    data = b"".join(frame(body) for body in bodies)
    assert feed_in_chunks(Frames(), data, cuts) == bodies


GARBAGE = st.one_of(
    st.binary(max_size=300),
    st.lists(st.sampled_from([b"Content-Length: ", b"content-length:", b"12", b"-3", b"99999999999", b"\r\n",
                              b"\n", b"\r\n\r\n", b"{", b'"', b"}", b"\xff", b"Content-Type: x", b" ", b"abc"]),
             max_size=30).map(b"".join),
)  # fmt: skip


@fuzz(500)
@given(GARBAGE, BODIES, st.lists(st.integers(0, 10_000), max_size=6))
def test_after_any_garbage_the_next_frames_are_read(garbage: bytes, bodies: list[bytes], cuts: list[int]) -> None:
    """Resynchronisation: whatever came before, the frames after it arrive whole (the garbage costs its own
    bytes, reported as Malformed or as bodies the dispatcher answers with a parse error)."""
    out = feed_in_chunks(Frames(), garbage + b"".join(frame(body) for body in bodies), cuts)
    assert out[-len(bodies) :] == bodies


@fuzz(200)
@given(st.binary(max_size=2000), st.lists(st.integers(0, 10_000), max_size=6))
def test_any_bytes_are_read_without_error_and_memory_stays_bounded(data: bytes, cuts: list[int]) -> None:
    frames = Frames(max_body=500)
    for item in feed_in_chunks(frames, data, cuts):
        assert isinstance(item, bytes | Malformed)
    assert len(frames.buffer) <= max(wire.MAX_HEADER_BYTES, 500 + 40) + len(data)


def test_bad_lengths_are_reported_and_the_reader_goes_on() -> None:
    frames = Frames(max_body=1000)
    out = frames.feed(b"Content-Length: -5\r\n\r\nContent-Length: 5000\r\n\r\n" + frame(b"{}"))
    assert out == [Malformed("Content-Length b'-5' is not a number"),
                   Malformed("Content-Length 5000 is over the limit of 1000 bytes"), b"{}"]  # fmt: skip
    # a repeated header: the last one counts; garbage in front of a header on its line is not its value
    assert frames.feed(b"Content-Length: 9\r\nxxContent-Length: 2\r\n\r\n{}") == [b"{}"]
    # a body cut short by the next frame's header
    assert frames.feed(b"Content-Length: 50\r\n\r\n{" + frame(b"[]")) == [
        Malformed("a frame shorter than its Content-Length (the next frame's header came first)"), b"[]"]  # fmt: skip


def test_garbage_without_line_ends_is_not_buffered() -> None:
    frames = Frames()
    assert frames.feed(b"x" * (1 << 20)) == []
    assert len(frames.buffer) <= wire.MAX_HEADER_BYTES
    assert frames.feed(frame(b"{}")) == [b"{}"]


# -- a real server over stdio --------------------------------------------------------------------------------------


class Ids:
    next = 1000


def exchange(client: RawClient, body: bytes, request: Any) -> list[dict[str, Any]]:
    """Send `body`, then a canvas/stats sentinel; every message up to both answers. The server must be alive, the
    sentinel answered, and `request` (the id the body carries, if any) answered exactly once."""
    Ids.next += 1
    sentinel = f"sentinel-{Ids.next}"
    client.frame(body)
    client.send({"id": sentinel, "method": "canvas/stats", "params": {"brief": True}})
    seen: list[dict[str, Any]] = []
    while not any(m.get("id") == sentinel for m in seen) or (
        request is not None and not any(m.get("id") == request and "method" not in m for m in seen)
    ):
        message = client.read(timeout=30)
        assert message is not None, f"no answer within 30 s after {body[:300]!r}: {seen}"
        seen.append(message)
    assert client.process.poll() is None
    answers = [m for m in seen if "method" not in m and m.get("id") == request]
    assert request is None or len(answers) == 1, answers
    return seen


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
ENVELOPE_KEYS = st.sampled_from(["jsonrpc", "id", "method", "params", "result", "error"])


@st.composite
def bodies(draw: st.DrawFn) -> tuple[bytes, Any]:
    """Any JSON value, or an object with the envelope's keys holding anything; the request id it carries."""
    if draw(st.booleans()):
        value = draw(JSON)
    else:
        value = draw(st.dictionaries(ENVELOPE_KEYS, JSON | st.sampled_from(["2.0", "canvas/stats", "exit"])))
        if value.get("method") in ("exit", "shutdown"):
            value["method"] = "canvas/unknown"  # the one message that ends the server by design (tested apart)
    request = None
    if isinstance(value, dict) and isinstance(value.get("method"), str) and wire.valid_id(value.get("id")):
        request = value["id"]
    return json.dumps(value).encode(), request


@fuzz(400)
@given(bodies())
def test_any_json_body_is_answered_or_dropped_and_the_server_goes_on(
    shared: RawClient, body: tuple[bytes, Any]
) -> None:
    exchange(shared, *body)


# Each method the server registers, with valid params built from lsprotocol's types (or the custom method's
# documented shape): the fuzzer drops fields, gives them other types and adds fields.
URI = "file:///fuzz/a.py"
TEXT = types.TextDocumentIdentifier(URI)
POSITION = types.Position(1, 4)
SPAN = types.Range(types.Position(0, 0), types.Position(1, 2))
VALID: dict[str, Any] = {
    types.INITIALIZED: types.InitializedParams(),
    types.WORKSPACE_DID_CHANGE_CONFIGURATION: types.DidChangeConfigurationParams(
        settings={"completion": {"debounce_ms": 0}}),
    types.TEXT_DOCUMENT_DID_OPEN: types.DidOpenTextDocumentParams(
        types.TextDocumentItem(URI, "python", 1, "def f(x):\n    return x\n")),
    types.TEXT_DOCUMENT_DID_CHANGE: types.DidChangeTextDocumentParams(
        types.VersionedTextDocumentIdentifier(version=2, uri=URI),
        [types.TextDocumentContentChangePartial(range=SPAN, text="y")]),
    types.TEXT_DOCUMENT_DID_CLOSE: types.DidCloseTextDocumentParams(TEXT),
    types.TEXT_DOCUMENT_INLINE_COMPLETION: types.InlineCompletionParams(
        context=types.InlineCompletionContext(types.InlineCompletionTriggerKind.Invoked),
        text_document=TEXT, position=POSITION),
    types.TEXT_DOCUMENT_COMPLETION: types.CompletionParams(TEXT, POSITION),
    types.TEXT_DOCUMENT_CODE_ACTION: types.CodeActionParams(TEXT, SPAN, types.CodeActionContext([])),
    types.WORKSPACE_EXECUTE_COMMAND: types.ExecuteCommandParams(
        "canvas-ls.rewriteSelection", [{"textDocument": {"uri": URI}, "range": {"start": {"line": 0, "character": 0},
                                                                             "end": {"line": 1, "character": 0}}}]),
    types.SET_TRACE: types.SetTraceParams(types.TraceValue.Off),
    types.WINDOW_WORK_DONE_PROGRESS_CANCEL: types.WorkDoneProgressCancelParams("canvas-ls/x"),
    types.WORKSPACE_DID_CHANGE_WORKSPACE_FOLDERS: types.DidChangeWorkspaceFoldersParams(
        types.WorkspaceFoldersChangeEvent([], [])),
    types.CANCEL_REQUEST: types.CancelParams(id=5),
    "canvas/fill": {"textDocument": {"uri": URI}, "position": {"line": 1, "character": 4}},
    "canvas/prefetch": {"textDocument": {"uri": URI, "version": 2}, "position": {"line": 1, "character": 4}},
    "canvas/stats": {"brief": True},
    "canvas/status": {},
    "canvas/nextEdit": {"textDocument": {"uri": URI, "version": 2}, "position": {"line": 1, "character": 4}},
    "canvas/fillRegions": {"textDocument": {"uri": URI}, "regions": [{"range": {"start": {"line": 0, "character": 0},
                                                                               "end": {"line": 1, "character": 2}}}]},
}  # fmt: skip
# Tested apart: they end the session (exit), refuse everything after them (shutdown), or change the backend
# (initialize's options); notebook sync is pygls's own.
APART = {types.EXIT, types.SHUTDOWN, types.INITIALIZE, types.NOTEBOOK_DOCUMENT_DID_OPEN,
         types.NOTEBOOK_DOCUMENT_DID_CHANGE, types.NOTEBOOK_DOCUMENT_DID_CLOSE}  # fmt: skip


def test_every_registered_method_is_fuzzed() -> None:
    from canvas_ls.server.lsp import server

    registered = set(server.protocol.fm.features) | set(server.protocol.fm.builtin_features)
    assert registered - APART - {types.CANCEL_REQUEST} == set(VALID) - {types.CANCEL_REQUEST}


@st.composite
def mangled(draw: st.DrawFn, value: Any, depth: int = 0) -> Any:
    """`value` with fields dropped, replaced by other JSON, and extra fields added, at any depth."""
    choice = draw(st.integers(0, 9))
    if choice == 0:
        return draw(JSON)
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if draw(st.integers(0, 5)) == 0:
                continue  # dropped
            out[key] = draw(mangled(item, depth + 1))
        if draw(st.integers(0, 4)) == 0:
            out[draw(st.text(max_size=6))] = draw(JSON)
        return out
    if isinstance(value, list):
        return [draw(mangled(item, depth + 1)) for item in value]
    if choice == 1 and isinstance(value, int) and not isinstance(value, bool):
        return draw(st.sampled_from([-1, 2**31, 2**63, 10**30, 0]))
    if choice == 1 and isinstance(value, str):
        return draw(st.sampled_from(["", "\ud800", "😀" * 50, "file:///", "x" * 10_000]))
    return value


@st.composite
def method_calls(draw: st.DrawFn) -> tuple[bytes, Any]:
    method = draw(st.sampled_from(sorted(VALID)))
    base = VALID[method]
    params = base if isinstance(base, dict) else wire.unstructure(_converter_protocol(), base)
    message: dict[str, Any] = {"jsonrpc": "2.0", "method": method, "params": draw(mangled(params))}
    notification = method in {types.INITIALIZED, types.WORKSPACE_DID_CHANGE_CONFIGURATION, types.SET_TRACE,
                              types.WINDOW_WORK_DONE_PROGRESS_CANCEL, types.WORKSPACE_DID_CHANGE_WORKSPACE_FOLDERS,
                              types.CANCEL_REQUEST} or method.startswith("textDocument/did")  # fmt: skip
    if not notification:
        Ids.next += 1
        message["id"] = Ids.next
    return json.dumps(message).encode(), message.get("id")


def _converter_protocol() -> JsonRPCProtocol:
    from canvas_ls.server.lsp import server

    return server.protocol


@fuzz(600)
@given(method_calls())
def test_every_method_with_mangled_params_is_answered_once(shared: RawClient, call: tuple[bytes, Any]) -> None:
    seen = exchange(shared, *call)
    for message in seen:
        if "error" in message:  # the codes the spec names for the client's mistakes; never -32603 (our bug)
            assert message["error"]["code"] in (-32700, -32600, -32601, -32602, -32800, -32002), message
