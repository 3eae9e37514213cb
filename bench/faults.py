"""`canvas-ls bench soak --fault`: several clients at once, each a raw stdio client of its own `canvas-ls serve`
(all sharing one resident engine, as editors do), sending a seeded mix of valid typing (opens, edits, inline
completions) and faults: garbage bytes, malformed headers, arbitrary JSON bodies, and every fuzzable method with
mangled params. Reports the frames sent, requests answered, errors by code, each server's RSS growth, the slowest
answer to a valid request sent right after garbage (resynchronisation), and the servers that exited (must be 0).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from ..engine.tasks import machine
from ..server.wire import Frames, request_id
from .soak import rss_mb

URI = "file:///faults/doc{}.py"
SOURCE = "def total(items):\n    result = 0\n    for item in items:\n        result += item\n    return result\n\n"
# Methods the fuzz mangles, with valid params of their shape (exit, shutdown and initialize end or reset a session
# by design and are not sent).
BASES: dict[str, dict[str, Any]] = {
    "textDocument/inlineCompletion": {
        "textDocument": {"uri": URI},
        "position": {"line": 1, "character": 4},
        "context": {"triggerKind": 2},
    },
    "textDocument/completion": {"textDocument": {"uri": URI}, "position": {"line": 1, "character": 4}},
    "textDocument/codeAction": {
        "textDocument": {"uri": URI},
        "range": {"start": {"line": 0, "character": 0}, "end": {"line": 1, "character": 0}},
        "context": {"diagnostics": []},
    },
    "textDocument/didChange": {
        "textDocument": {"uri": URI, "version": 99},
        "contentChanges": [
            {"range": {"start": {"line": 0, "character": 0}, "end": {"line": 0, "character": 1}}, "text": "x"}
        ],
    },
    "workspace/didChangeConfiguration": {"settings": {"completion": {"debounce_ms": 0}}},
    "workspace/executeCommand": {
        "command": "canvas-ls.fillHoles",
        "arguments": [{"textDocument": {"uri": URI}, "position": {"line": 1, "character": 0}}],
    },
    "canvas/fill": {"textDocument": {"uri": URI}, "position": {"line": 1, "character": 4}},
    "canvas/prefetch": {"textDocument": {"uri": URI}, "position": {"line": 1, "character": 4}},
    "canvas/stats": {"brief": True},
    "$/cancelRequest": {"id": 1},
}
NOTIFICATIONS = {"textDocument/didChange", "workspace/didChangeConfiguration", "$/cancelRequest"}
JUNK = [b"Content-Length: ", b"-1", b"99999999999", b"\r\n", b"\r\n\r\n", b"{", b'"', b"}", b"\xff\xfe", b"\x00",
        b"Content-Type: x", b"[", b"null", b"12", b" "]  # fmt: skip


def random_json(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(8 if depth < 3 else 5)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, -1, 2**31, 2**63, 10**30, rng.randrange(-1000, 1000)])
    if kind == 3:
        return rng.choice([0.5, -1e300, 1e-9])
    if kind == 4:
        return rng.choice(["", "x", "\ud800", "😀" * 20, "file:///", "\x00", "2.0", "canvas/stats"])
    if kind in (5, 6):
        return {rng.choice(["a", "id", "method", "params", "uri", ""]): random_json(rng, depth + 1)
                for _ in range(rng.randrange(4))}  # fmt: skip
    return [random_json(rng, depth + 1) for _ in range(rng.randrange(4))]


def mangle(rng: random.Random, value: Any) -> Any:
    """`value` with fields dropped, given other JSON, and extra fields, at any depth."""
    if rng.random() < 0.1:
        return random_json(rng)
    if isinstance(value, dict):
        out = {key: mangle(rng, item) for key, item in value.items() if rng.random() > 0.15}
        if rng.random() < 0.2:
            out[rng.choice(["extra", "uri", "line", ""])] = random_json(rng)
        return out
    if isinstance(value, list):
        return [mangle(rng, item) for item in value]
    return value


def frame(body: bytes) -> bytes:
    return b"Content-Length: %d\r\n\r\n" % len(body) + body


class FaultClient:
    """One editor gone wrong: a raw stdio client of its own server."""

    def __init__(self, number: int, rng: random.Random, env: dict[str, str]) -> None:
        self.number, self.rng, self.env = number, rng, env
        self.uri = URI.format(number)
        self.text, self.version = SOURCE, 1
        self.next_id = 0
        self.sent_ids: Counter[Any] = Counter()
        self.answers: Counter[Any] = Counter()
        self.codes: Counter[int] = Counter()
        self.waiting: dict[Any, asyncio.Future[dict[str, Any]]] = {}
        self.frames_sent = 0
        self.faults = 0
        self.resync_s: list[float] = []
        self.timeouts: list[str] = []
        self.internal: list[str] = []  # the internal errors' messages (-32603: a handler raised)

    async def start(self, init: dict[str, Any]) -> None:
        command = [sys.executable, "-m", "canvas_ls.server.cli", "serve", "--log-level", "ERROR"]
        self.process = await asyncio.create_subprocess_exec(
            *command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL, env=self.env,
        )  # fmt: skip
        self.reader = asyncio.ensure_future(self._read())
        if await self.request("initialize", {"capabilities": {}, "initializationOptions": init}) is None:
            raise RuntimeError(f"server {self.number} did not answer initialize")
        self.send({"jsonrpc": "2.0", "method": "initialized", "params": {}})
        while (stats := await self.request("canvas/stats", {"brief": True})) is not None and stats["result"]["engine"][
            "state"
        ] == "loading":
            await asyncio.sleep(0.2)
        self.send({"jsonrpc": "2.0", "method": "textDocument/didOpen", "params": {"textDocument": {
            "uri": self.uri, "languageId": "python", "version": 1, "text": self.text}}})  # fmt: skip

    async def _read(self) -> None:
        frames = Frames()
        assert self.process.stdout is not None
        while chunk := await self.process.stdout.read(1 << 16):
            for body in frames.feed(chunk):
                message = json.loads(body) if isinstance(body, bytes) else {}
                if "method" in message or "id" not in message:
                    continue  # the server's notifications and requests (log, progress)
                self.answers[_key(message["id"])] += 1
                if "error" in message:
                    self.codes[message["error"]["code"]] += 1
                    if message["error"]["code"] == -32603 and len(self.internal) < 20:  # a bug of the server's
                        trace = (message["error"].get("data") or {}).get("traceback") or [""]
                        self.internal.append(f"{message['error']['message']} at {trace[-1].strip()[:300]}")
                waiter = self.waiting.pop(_key(message["id"]), None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(message)

    def write(self, data: bytes) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(data)
        self.frames_sent += 1

    def send(self, message: dict[str, Any]) -> None:
        if "id" in message and "method" in message:
            self.sent_ids[_key(message["id"])] += 1
        self.write(frame(json.dumps(message).encode()))

    async def request(self, method: str, params: Any, timeout: float = 120) -> dict[str, Any] | None:
        """The answer, or None (counted) when none came within `timeout`."""
        self.next_id += 1
        msg_id = f"c{self.number}-{self.next_id}"
        waiter = self.waiting[_key(msg_id)] = asyncio.get_running_loop().create_future()
        self.send({"jsonrpc": "2.0", "id": msg_id, "method": method, "params": params})
        try:
            return await asyncio.wait_for(waiter, timeout)
        except TimeoutError:
            self.timeouts.append(f"{method}: no answer within {timeout:g} s")
            return None

    # -- one step: typing, or a fault ---------------------------------------------------------------------------

    async def typing(self) -> None:
        """An edit at the end of a line, then the inline completion there, awaited."""
        lines = self.text.split("\n")
        line = self.rng.randrange(len(lines))
        insert = self.rng.choice(["x", " = ", "(", "# note", "é", "😀"])
        character = len(lines[line].encode("utf-16-le")) // 2
        self.version += 1
        span = {"start": {"line": line, "character": character}, "end": {"line": line, "character": character}}
        self.send({"jsonrpc": "2.0", "method": "textDocument/didChange", "params": {
            "textDocument": {"uri": self.uri, "version": self.version},
            "contentChanges": [{"range": span, "text": insert}]}})  # fmt: skip
        lines[line] += insert
        self.text = "\n".join(lines)
        position = {"line": line, "character": character + len(insert.encode("utf-16-le")) // 2}
        await self.request("textDocument/inlineCompletion", {"textDocument": {"uri": self.uri}, "position": position,
                                                              "context": {"triggerKind": 2}})  # fmt: skip

    async def fault(self) -> None:
        self.faults += 1
        kind = self.rng.randrange(4)
        if kind == 0:  # garbage bytes, then a valid request: answered at once (resynchronisation)
            self.write(bytes(self.rng.randrange(256) for _ in range(self.rng.randrange(1, 200))))
        elif kind == 1:
            self.write(b"".join(self.rng.choice(JUNK) for _ in range(self.rng.randrange(1, 12))))
        elif kind == 2:
            value = random_json(self.rng)
            body = json.dumps(value).encode()
            if request_id(value) is not None:
                self.sent_ids[_key(request_id(value))] += 1
            self.write(frame(body))
            return
        else:
            method = self.rng.choice(sorted(BASES))
            params = mangle(self.rng, json.loads(json.dumps(BASES[method]).replace(URI, self.uri)))
            message: dict[str, Any] = {"jsonrpc": "2.0", "method": method, "params": params}
            if method not in NOTIFICATIONS:
                self.next_id += 1
                message["id"] = f"c{self.number}-f{self.next_id}"
            self.send(message)
            return
        started = time.perf_counter()
        if await self.request("canvas/stats", {"brief": True}, timeout=30) is not None:
            self.resync_s.append(time.perf_counter() - started)


def _key(msg_id: Any) -> Any:
    return json.dumps(msg_id)  # one key for 1 and "1" apart, and hashable for any id


async def _drive(frames: int, clients: int, model: str | None, device: str, seed: int, typing_share: float,
                 runtime: Path) -> dict[str, Any]:  # fmt: skip
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime)}
    init = {"engine": {"model": model, "device": device, "backend": "resident", "idle_exit_s": 120},
            "completion": {"min_confidence": 0}}  # fmt: skip
    fleet = [FaultClient(n, random.Random(seed * 1000 + n), env) for n in range(clients)]
    for client in fleet:  # one after the other: the first starts the shared engine
        await client.start(init)
    started = time.perf_counter()
    warm: dict[int, float] = {}
    typed = Counter()

    async def run(client: FaultClient) -> None:
        warm_up = frames // clients // 10
        while client.frames_sent < frames // clients:
            if client.process.returncode is not None:
                return
            if client.rng.random() < typing_share:
                await client.typing()
                typed[client.number] += 1
            else:
                await client.fault()
            if client.frames_sent >= warm_up and client.number not in warm:
                warm[client.number] = rss_mb(client.process.pid)
            await client.process.stdin.drain()  # type: ignore[union-attr]  # (and the answers are read meanwhile)

    await asyncio.gather(*(run(client) for client in fleet))
    seconds = time.perf_counter() - started
    for client in fleet:  # the fuzz's own requests: answered by now, or after the engine's queue drains
        for _ in range(600):
            if client.process.returncode is not None or all(client.answers[k] >= 1 for k in client.sent_ids):
                break
            await asyncio.sleep(0.1)
    await asyncio.sleep(2.5)
    final = {client.number: rss_mb(client.process.pid) if client.process.returncode is None else None
             for client in fleet}  # fmt: skip
    exits = [client.process.returncode for client in fleet if client.process.returncode is not None]
    for client in fleet:
        if client.process.returncode is None:
            client.process.kill()
            await client.process.wait()
        client.reader.cancel()
    for socket in (runtime / "canvas-ls").glob("*.sock"):
        from ..server.backend import engine_health

        health = engine_health(socket)
        if health is not None:
            os.kill(health["pid"], 15)
    report = _tally(fleet, warm, final, exits)
    return {"machine": machine(), "model": model or "(default)", "clients": clients, "seconds": seconds,
            "typing_requests": sum(typed.values()), **report}  # fmt: skip


def _tally(fleet: list[FaultClient], warm: dict[int, float], final: dict[int, float | None],
           exits: list[int]) -> dict[str, Any]:  # fmt: skip
    """What the clients saw, added up, and the checks on it."""
    sent = sum(len(c.sent_ids) for c in fleet)
    unanswered = sum(1 for c in fleet for k in c.sent_ids if c.answers[k] == 0)
    doubled = sum(1 for c in fleet for k, n in c.answers.items() if n > c.sent_ids.get(k, 0) and c.sent_ids.get(k))
    codes: Counter[int] = Counter()
    for client in fleet:
        codes.update(client.codes)
    resync = sorted(s for c in fleet for s in c.resync_s)
    growth = [final[c.number] - warm[c.number] for c in fleet if final[c.number] is not None and c.number in warm]
    checks = {
        "no server exited": not exits,
        "every request id answered": unanswered == 0 and not any(c.timeouts for c in fleet),
        "no request id answered twice": doubled == 0,
        "no internal error (-32603)": not codes.get(-32603),
        "next valid request after garbage answered within 1 s": bool(resync) and resync[-1] <= 1.0,
        "RSS growth <= 50 MB a server": bool(growth) and max(growth) <= 50,
    }
    return {
        "frames": sum(c.frames_sent for c in fleet),
        "faults": sum(c.faults for c in fleet),
        "request_ids": sent,
        "unanswered": unanswered,
        "answered_twice": doubled,
        "errors_by_code": {str(code): count for code, count in sorted(codes.items())},
        "exits": exits,
        "resync_p50_ms": 1000 * resync[len(resync) // 2] if resync else None,
        "resync_max_ms": 1000 * resync[-1] if resync else None,
        "rss_growth_mb": growth,
        "timeouts": [t for c in fleet for t in c.timeouts][:20],
        "internal_errors": [e for c in fleet for e in c.internal][:20],
        "checks": checks,
    }


def run_fault_soak(frames: int, clients: int, model: str | None, device: str, seed: int = 0,
                   typing_share: float = 0.05) -> dict[str, Any]:  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="canvas-ls-faults-") as runtime:
        Path(runtime).chmod(0o700)
        return asyncio.run(_drive(frames, clients, model, device, seed, typing_share, Path(runtime)))


def format_fault_soak(report: dict[str, Any]) -> str:
    lines = [
        f"model {report['model']}", report["machine"],
        f"{report['clients']} clients, {report['frames']} frames in {report['seconds']:.0f} s: {report['faults']} "
        f"faults, {report['typing_requests']} typing completions",
        f"request ids {report['request_ids']}: unanswered {report['unanswered']}, answered twice "
        f"{report['answered_twice']}; errors by code {report['errors_by_code']}",
        f"valid request after garbage: p50 {report['resync_p50_ms']:.1f} ms, max {report['resync_max_ms']:.1f} ms",
        f"server RSS growth after the warm-up (MB): {', '.join(f'{g:+.1f}' for g in report['rss_growth_mb'])}",
        f"servers exited: {len(report['exits'])}",
        *(f"  timeout: {timeout}" for timeout in report["timeouts"]),
        *(f"  internal error: {error}" for error in report["internal_errors"]),
    ]  # fmt: skip
    lines += [f"{'ok  ' if ok else 'FAIL'} {name}" for name, ok in report["checks"].items()]
    return "\n".join(lines)
