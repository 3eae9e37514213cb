"""Malformed JSON-RPC on stdio, byte for byte: `canvas-ls serve` answers what the protocol has answers for, drops
what it cannot read, and keeps answering the messages after it."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest


class RawClient:
    def __init__(self) -> None:
        command = [sys.executable, "-m", "canvas_ls.server.cli", "serve", "--log-level", "ERROR"]
        pipe = subprocess.PIPE
        self.process = subprocess.Popen(command, stdin=pipe, stdout=pipe, stderr=subprocess.DEVNULL)
        self.buffer = b""

    def raw(self, data: bytes) -> None:
        self.process.stdin.write(data)
        self.process.stdin.flush()

    def frame(self, body: bytes) -> None:
        self.raw(b"Content-Length: %d\r\n\r\n" % len(body) + body)

    def send(self, message: dict[str, Any]) -> None:
        self.frame(json.dumps({"jsonrpc": "2.0", **message}).encode())

    def read(self, timeout: float = 30) -> dict[str, Any] | None:
        """The next message from the server, or None when none comes within `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            head, separator, rest = self.buffer.partition(b"\r\n\r\n")
            if separator:
                length = int(next(line for line in head.split(b"\r\n") if line.startswith(b"Content-Length")).split(
                    b":")[1])  # fmt: skip
                if len(rest) >= length:
                    self.buffer = rest[length:]
                    return json.loads(rest[:length])
            ready, _, _ = select.select([self.process.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return None
            chunk = os.read(self.process.stdout.fileno(), 1 << 16)
            assert chunk, "the server closed its output"
            self.buffer += chunk

    def stats(self, msg_id: int) -> None:
        self.send({"id": msg_id, "method": "canvas/stats", "params": {"brief": True}})
        answer = self.read()
        assert answer is not None and answer.get("id") == msg_id and "requests" in answer["result"], answer


def start() -> RawClient:
    """`canvas-ls serve`, initialized, with a backend that loads nothing: an OpenAI-compatible server at a port
    where none listens (each completion fails at once, with a message)."""
    client = RawClient()
    options = {"engine": {"backend": "openai", "url": "http://127.0.0.1:9"}}
    client.send({"id": 0, "method": "initialize", "params": {"capabilities": {}, "initializationOptions": options}})
    assert client.read()["id"] == 0
    return client


@pytest.fixture
def server() -> Iterator[RawClient]:
    client = start()
    yield client
    if client.process.poll() is None:
        client.process.kill()
        client.process.wait()


def test_protocol_errors_are_answered_and_the_server_goes_on(server: RawClient) -> None:
    server.frame(b"{not json")
    answer = server.read()
    assert answer["id"] is None and answer["error"]["code"] == -32700  # parse error, id null
    server.send({"id": 1, "method": "no/such/method", "params": {}})
    assert server.read()["error"]["code"] == -32601  # method not found, under its id
    server.send({"id": 2, "method": "textDocument/inlineCompletion", "params": "not an object"})
    answer = server.read()
    assert (answer["id"], answer["error"]["code"]) == (2, -32602)  # invalid params: the request is not left hanging
    server.send({"id": 3, "method": "textDocument/inlineCompletion",
                 "params": {"textDocument": {"uri": 5}, "position": {"line": "x", "character": None}}})  # fmt: skip
    assert server.read()["error"]["code"] == -32602
    server.stats(4)


def parse_error(server: RawClient) -> str:
    answer = server.read()
    assert answer is not None and answer["id"] is None and answer["error"]["code"] == -32700, answer
    return answer["error"]["message"]


def test_malformed_frames_cost_one_message_not_the_session(server: RawClient) -> None:
    server.raw(b"Content-Length: many\r\n\r\n{}")  # a length that is not a number: the header is dropped
    assert "Content-Length b'many' is not a number" in parse_error(server)
    server.stats(1)
    server.raw(b'Content-Length: 120\r\n\r\n{"jsonrpc": "2.0"')  # a body shorter than its length: the next
    for msg_id in (2, 3, 4, 5):  # frame's header ends it, and that frame is read
        server.send({"id": msg_id, "method": "canvas/stats", "params": {"brief": True}})
    assert "shorter than its Content-Length" in parse_error(server)
    assert [server.read()["id"] for _ in range(4)] == [2, 3, 4, 5]
    server.raw(b"\r\n\r\nContent-Type: application/vscode-jsonrpc; charset=utf-8\r\n")  # stray blank lines, headers
    server.stats(6)


def test_a_100_mb_message_is_read_and_answered(server: RawClient) -> None:
    server.send({"id": 1, "method": "canvas/stats", "params": {"junk": "x" * (100 << 20)}})
    answer = server.read(timeout=120)
    assert answer is not None and answer["id"] == 1
    server.stats(2)


def test_stdin_closed_mid_frame_ends_the_server_cleanly(server: RawClient) -> None:
    server.raw(b'Content-Length: 500\r\n\r\n{"jsonrpc":')
    server.process.stdin.close()
    assert server.process.wait(timeout=30) == 0


def error(server: RawClient, body: bytes, msg_id: Any = None) -> tuple[int, str]:
    """The error answer to one frame (under `msg_id`), then proof that the server goes on."""
    server.frame(body)
    answer = server.read()
    assert answer is not None and answer["id"] == msg_id and "error" in answer, answer
    server.stats(999)
    return answer["error"]["code"], answer["error"]["message"]


# One named case per class of bad input: the JSON-RPC code and the words of the answer.
@pytest.mark.parametrize(
    ("body", "code", "words"),
    [
        (b"[1, 2]", -32600, "not a batch (LSP has none)"),
        (b"[]", -32600, "not a batch"),
        (b'"initialize"', -32600, "not a str"),
        (b"42", -32600, "not a int"),
        (b"null", -32600, "not a NoneType"),
        (b"{}", -32600, "it has no method"),
        (b'{"jsonrpc": "2.0", "id": 1}', -32600, "it has no method"),
        (b'{"jsonrpc": "2.0", "id": 1, "method": 7}', -32600, "its method is not a string"),
        (b'{"jsonrpc": "2.0", "id": {"a": 1}, "method": "canvas/stats"}', -32600, "its id is neither"),
        (b'{"jsonrpc": "2.0", "id": 1.5, "method": "canvas/stats"}', -32600, "its id is neither"),
        (b'{"jsonrpc": "2.0", "id": true, "method": "canvas/stats"}', -32600, "its id is neither"),
        (b"[" * 10_000 + b"]" * 10_000, -32700, "nested too deeply"),
        (b'{"a":' * 10_000 + b"1" + b"}" * 10_000, -32700, "nested too deeply"),
        (b'{"jsonrpc": "2.0", "id": 1, "method": "canvas/stats", "params": {"a": "\xff"}}', -32700, "not UTF-8"),
        (b'{"jsonrpc": "2.0", "id": NaN, "method": "canvas/stats"}', -32700, "NaN is not JSON"),
        (b'{"jsonrpc": "2.0", "id": 1, "method": "canvas/stats", "params": Infinity}', -32700, "Infinity is not JSON"),
        (b'{"jsonrpc": "2.0", "id": 1, "method": "canvas/stats"', -32700, "Parse error: Expecting"),
    ],
    ids=lambda value: value[:40].decode(errors="replace") if isinstance(value, bytes) else None,
)
def test_a_message_that_is_no_request_gets_the_error_the_spec_names(shared: RawClient, body: bytes, code: int,
                                                                    words: str) -> None:  # fmt: skip
    found, message = error(shared, body)
    assert found == code and words in message, message


@pytest.mark.parametrize(
    ("message", "code", "words"),
    [
        ({"jsonrpc": "1.0", "method": "canvas/stats"}, -32600, '"jsonrpc" is not "2.0"'),
        ({"method": "canvas/stats"}, -32600, '"jsonrpc" is not "2.0"'),
        ({"jsonrpc": "2.0", "method": "no/such/method"}, -32601, "no/such/method"),
        ({"jsonrpc": "2.0", "method": "canvas/stats", "params": "text"}, -32602, "params must be an object"),
        ({"jsonrpc": "2.0", "method": "textDocument/inlineCompletion", "params": {"position": 3}}, -32602,
         "Invalid params for textDocument/inlineCompletion"),
        ({"jsonrpc": "2.0", "method": "initialize", "params": None}, -32602, "Invalid params for initialize"),
        ({"jsonrpc": "2.0", "method": "workspace/executeCommand",
          "params": {"command": "canvas-ls.fillHoles", "arguments": [5]}}, -32602, "takes one object argument"),
        ({"jsonrpc": "2.0", "method": "workspace/executeCommand",
          "params": {"command": "canvas-ls.learnWorkspace", "arguments": [{"folder": 5}]}}, -32602,
         "Invalid params for canvas-ls.learnWorkspace: expected str, got int @ $.folder"),
        ({"jsonrpc": "2.0", "method": "workspace/executeCommand",
          "params": {"command": "canvas-ls.rewriteSelection", "arguments": [{"textDocument": {"uri": "file:///a"}}]}},
         -32602, "Invalid params for canvas-ls.rewriteSelection: required field missing @ $.range"),
        ({"jsonrpc": "2.0", "method": "workspace/executeCommand",
          "params": {"command": "canvas-ls.accepted", "arguments": [True, "4"]}}, -32602,
         "Invalid params for canvas-ls.accepted: expected int, got bool @ $.shown; expected int, got str @ $.chars"),
        ({"jsonrpc": "2.0", "method": "workspace/executeCommand",
          "params": {"command": "canvas-ls.accepted", "arguments": [1, 2, 3]}}, -32602,
         "canvas-ls.accepted takes [shown, chars], not 3 arguments"),
        ({"jsonrpc": "2.0", "method": "canvas/fill", "params": {"position": {"line": "x"}}}, -32602,
         "Invalid params for canvas/fill: required field missing @ $.textDocument; expected int, got str @ "
         "$.position.line; required field missing @ $.position.character"),
    ],
    ids=lambda value: str(value.get("params", value.get("method")))[:40] if isinstance(value, dict) else None,
)  # fmt: skip
def test_a_bad_request_is_answered_under_its_id(shared: RawClient, message: dict[str, Any], code: int,
                                               words: str) -> None:  # fmt: skip
    found, text = error(shared, json.dumps({**message, "id": 41}).encode(), 41)
    assert found == code and words in text, text


def test_a_lone_surrogate_and_a_huge_id_are_answered() -> None:
    client = start()
    try:
        client.frame(b'{"jsonrpc": "2.0", "id": 10000000000000000000000, "method": "canvas/stats",'
                     b' "params": {"a": "\\ud800"}}')  # fmt: skip
        answer = client.read()
        assert answer["id"] == 10**22 and "requests" in answer["result"]
    finally:
        client.process.kill()


def test_requests_before_initialize_and_after_shutdown_are_refused() -> None:
    client = RawClient()
    try:
        client.send({"id": 1, "method": "canvas/stats", "params": {}})
        answer = client.read()
        assert answer["error"]["code"] == -32002 and "before initialize" in answer["error"]["message"]
        options = {"engine": {"backend": "openai", "url": "http://127.0.0.1:9"}}
        client.send({"id": 2, "method": "initialize", "params": {"capabilities": {}, "initializationOptions": options}})
        assert client.read()["id"] == 2
        client.send({"id": 3, "method": "shutdown"})
        assert client.read() == {"jsonrpc": "2.0", "id": 3, "result": None}
        client.send({"id": 4, "method": "canvas/stats", "params": {}})
        answer = client.read()
        assert answer["error"] == {"code": -32600, "message": "Invalid request: canvas/stats after shutdown"}
        client.send({"method": "exit"})
        assert client.process.wait(timeout=30) == 0
    finally:
        client.process.kill()


def test_a_cancelled_request_is_answered_with_request_cancelled(server: RawClient) -> None:
    """A completion cancelled while it waits out its debounce: -32800 under its id (pygls's answer)."""
    text = "def f(x):\n    return x\n"
    server.send({"method": "textDocument/didOpen", "params": {"textDocument": {
        "uri": "file:///c.py", "languageId": "python", "version": 1, "text": text}}})  # fmt: skip
    server.send({"method": "workspace/didChangeConfiguration",
                 "params": {"settings": {"completion": {"debounce_ms": 5000}}}})  # fmt: skip
    server.send(
        {
            "id": 7,
            "method": "textDocument/inlineCompletion",
            "params": {
                "textDocument": {"uri": "file:///c.py"},
                "position": {"line": 1, "character": 4},
                "context": {"triggerKind": 2},
            },
        }
    )  # fmt: skip (automatic: debounced)
    server.send({"method": "$/cancelRequest", "params": {"id": 7}})
    answer = server.read()
    while answer is not None and answer.get("id") != 7:
        answer = server.read()
    assert answer["error"]["code"] == -32800, answer
    server.stats(8)


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (b"Content-Length: -12\r\n\r\n{}", "Content-Length b'-12' is not a number"),
        (b"Content-Length: 99999999999999\r\n\r\n{}", "Content-Length 99999999999999 is over the limit"),
        (b"Content-Length: \r\n\r\n{}", "Content-Length b'' is not a number"),
    ],
)
def test_a_bad_content_length_is_a_parse_error_and_the_next_frame_is_read(server: RawClient, raw: bytes,
                                                                         words: str) -> None:  # fmt: skip
    server.raw(raw)
    assert words in parse_error(server)
    server.stats(1)


def test_frames_without_a_length_or_with_two_are_read_as_the_spec_allows(server: RawClient) -> None:
    server.raw(b'{"jsonrpc": "2.0", "id": 1, "method": "canvas/stats"}\r\n\r\n')  # no header: nothing to read
    body = json.dumps({"jsonrpc": "2.0", "id": 2, "method": "canvas/stats", "params": {"brief": True}}).encode()
    server.raw(b"Content-Length: 3\r\nContent-Length: %d\r\n\r\n" % len(body) + body)  # the last one counts
    assert server.read()["id"] == 2


def test_settings_out_of_range_are_refused_and_the_current_ones_kept(server: RawClient) -> None:
    """A debounce of 2**31 ms would have left every completion waiting for 24 days (found by `bench soak --fault`)."""
    server.send({"method": "workspace/didChangeConfiguration",
                 "params": {"settings": {"completion": {"debounce_ms": 2**31}}}})  # fmt: skip
    shown = server.read()
    assert shown["method"] == "window/showMessage", shown
    assert shown["params"]["message"] == ("Invalid canvas-ls options, keeping the current ones: completion.debounce_ms "
                                          "must be in [0, 10000], got 2147483648 @ $.completion")  # fmt: skip
    server.send({"method": "textDocument/didOpen", "params": {"textDocument": {
        "uri": "file:///d.py", "languageId": "python", "version": 1, "text": "x = 1\n"}}})  # fmt: skip
    server.send({"id": 5, "method": "textDocument/inlineCompletion", "params": {
        "textDocument": {"uri": "file:///d.py"}, "position": {"line": 1, "character": 0},
        "context": {"triggerKind": 2}}})  # fmt: skip
    answer = server.read(timeout=10)
    while answer is not None and answer.get("id") != 5:
        answer = server.read(timeout=10)
    assert answer == {"jsonrpc": "2.0", "id": 5, "result": {"items": []}}  # at once: the backend fails, no wait


@pytest.mark.parametrize(
    ("position", "why"),
    [
        ({"line": -1, "character": 0}, "Position.line should be in range [0:2147483647], but was -1 @ $.position"),
        ({"line": 0, "character": 10**30},
         f"Position.character should be in range [0:2147483647], but was {10**30} @ $.position"),
        ({"line": 2**31}, "required field missing @ $.position.character"),
    ],
)  # fmt: skip
def test_a_position_out_of_the_lsp_range_is_invalid_params(shared: RawClient, position: dict[str, int],
                                                           why: str) -> None:  # fmt: skip
    """Found by `bench soak --fault`: canvas/fill built an lsprotocol Position from it, which raised (-32603)."""
    code, text = error(shared, json.dumps({"jsonrpc": "2.0", "id": 8, "method": "canvas/fill", "params": {
        "textDocument": {"uri": "file:///x.py"}, "position": position}}).encode(), 8)  # fmt: skip
    assert (code, text) == (-32602, f"Invalid params for canvas/fill: {why}")


def test_a_request_within_the_debounce_supersedes_the_one_before(server: RawClient) -> None:
    """Typing fast: a completion asked for while the previous one waits out its debounce ends that one ("superseded",
    no model call); the newer one goes on to the model (here a server that does not answer: its error)."""
    server.send({"method": "workspace/didChangeConfiguration",
                 "params": {"settings": {"completion": {"debounce_ms": 400}}}})  # fmt: skip
    server.send({"method": "textDocument/didOpen", "params": {"textDocument": {
        "uri": "file:///e.py", "languageId": "python", "version": 1, "text": "def f(x):\n    return x\n"}}},
    )  # fmt: skip
    where = {"textDocument": {"uri": "file:///e.py"}, "position": {"line": 1, "character": 12}}  # after "return x"
    server.send({"id": 1, "method": "canvas/fill", "params": where})
    server.send({"id": 2, "method": "canvas/fill", "params": {**where, "position": {"line": 2, "character": 0}}})
    answers = {}
    while len(answers) < 2:
        message = server.read()
        assert message is not None
        if message.get("id") in (1, 2):
            answers[message["id"]] = message["result"]["source"]
    assert answers == {1: "superseded", 2: "error:http://127.0.0.1:9 is unreachable: All connection attempts failed"}


def test_a_document_opened_with_an_empty_uri_does_not_break_the_others(server: RawClient) -> None:
    """Found by tests/test_wire.py's long fuzz: an open document with an empty URI made every completion in another
    document of its language fail (-32603: naming its snippets' file raised)."""
    for uri, text in (("", "def helper():\n    return 1\n"), ("file:///g.py", "def f(x):\n    return x\n")):
        server.send({"method": "textDocument/didOpen", "params": {"textDocument": {
            "uri": uri, "languageId": "python", "version": 1, "text": text}}})  # fmt: skip
    server.send({"id": 3, "method": "canvas/fill", "params": {"textDocument": {"uri": "file:///g.py"},
                                                              "position": {"line": 1, "character": 12}}})  # fmt: skip
    answer = server.read()
    while answer is not None and answer.get("id") != 3:
        answer = server.read()
    assert answer["result"]["source"] == "error:http://127.0.0.1:9 is unreachable: All connection attempts failed"
