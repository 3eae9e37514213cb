"""Malformed JSON-RPC on stdio, byte for byte: `canvas-ls serve` answers what the protocol has answers for, drops
what it cannot read, and keeps answering the messages after it."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
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


@pytest.fixture
def server() -> RawClient:
    client = RawClient()
    # a backend that loads nothing (the model would load on `initialized`, never sent here)
    options = {"engine": {"backend": "openai", "url": "http://127.0.0.1:9"}}
    client.send({"id": 0, "method": "initialize", "params": {"capabilities": {}, "initializationOptions": options}})
    assert client.read()["id"] == 0
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


def test_a_50_mb_message_is_read_and_answered(server: RawClient) -> None:
    server.send({"id": 1, "method": "canvas/stats", "params": {"junk": "x" * (50 << 20)}})
    answer = server.read(timeout=120)
    assert answer is not None and answer["id"] == 1
    server.stats(2)


def test_stdin_closed_mid_frame_ends_the_server_cleanly(server: RawClient) -> None:
    server.raw(b'Content-Length: 500\r\n\r\n{"jsonrpc":')
    server.process.stdin.close()
    assert server.process.wait(timeout=30) == 0
