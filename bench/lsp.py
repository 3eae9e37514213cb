"""`canvas-ls bench lsp`: end-to-end latency as an editor sees it.

A real LSP client (pygls) starts `canvas-ls serve` over stdio, opens the fixtures, and sends inline-completion
requests: "cold" ones at line ends across the files (each context new to the server), and after each cold answer
that offered text, a "typing" one where the user, after a pause to read it (`think_ms`), has typed the
completion's first characters (the server should answer from what is on screen, with no model call), then an
"accepted" one where the rest of the suggestion is accepted and the editor asks at its end (the server should have
computed that next suggestion in the background meanwhile). Reported: p50/p95 per kind, accepted ones split by
whether the speculation answered, the share it answered, the cache hit rate and the model calls, from the server's
own counters. Every answer is shown (`min_confidence` 0), so that the figures measure the path, not the threshold.
Nothing of a start is timed: first the resident engine's compiled step is ready and two untimed requests are made
in a small document of their own (which then stays among the recently closed documents, a few lines that the
other files' snippets may draw on), and the server's counters are counted from there.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

from lsprotocol import types
from pygls.lsp.client import LanguageClient

from ..engine.tasks import machine
from .core import Load, by_load, format_by_load, latency, wait_compiled

LEARN_WARMUP_S = 25.0
LOAD_KINDS = ("cold", "typing", "accepted")  # the requests compared per load (`--busy-cores 0,1`)
WARMUP = 2  # untimed requests before the timed ones (`_warm_up`), in a document of this text
WARMUP_TEXT = "total = 0\nfor value in range(10):\n    total = total + value\n"
LANGUAGES = {".py": "python", ".js": "javascript", ".go": "go", ".ts": "typescript", ".rs": "rust"}


def _positions(text: str) -> list[tuple[int, int]]:
    """Cursor positions worth completing at: the end of each non-blank line, and mid-line after `(`, `=`."""
    spots = []
    for number, line in enumerate(text.split("\n")):
        if line.strip():
            spots.append((number, len(line.encode("utf-16-le")) // 2))
        for marker in ("(", "= "):
            column = line.find(marker)
            if column > 0:
                spots.append((number, column + len(marker)))
    return spots


async def start_session(name: str, command: list[str], init: dict[str, Any], env: dict[str, str] | None = None,
                        shown: list[str] | None = None,
                        stderr: list[bytes] | None = None) -> tuple[LanguageClient, asyncio.Future]:  # fmt: skip
    """A pygls client that started `command` (UTF-16 positions), initialized it with `init` and waited for its
    model; with the task reading the server's stderr (kept in `stderr` when given) and the `window/showMessage`
    texts collected in `shown` when given."""
    client = LanguageClient(name, "1")
    for method in (types.WINDOW_LOG_MESSAGE, types.PROGRESS, types.WINDOW_WORK_DONE_PROGRESS_CREATE):
        client.feature(method)(lambda *args: None)
    client.feature(types.WINDOW_SHOW_MESSAGE)(
        lambda params: shown.append(params.message) if shown is not None else None
    )
    await client.start_io(*command, env=env)
    drain = asyncio.ensure_future(_drain(client, stderr))
    capabilities = types.ClientCapabilities(
        general=types.GeneralClientCapabilities(position_encodings=[types.PositionEncodingKind.Utf16])
    )
    await client.initialize_async(types.InitializeParams(capabilities=capabilities, initialization_options=init))
    client.initialized(types.InitializedParams())
    while (await client.protocol.send_request_async("canvas/stats", {})).engine.state == "loading":
        await asyncio.sleep(0.2)
    return client, drain


async def _drive(command: list[str], files: list[Path], requests: int, init: dict[str, Any],
                 think_ms: float, learn: Path | None = None, load: Load | None = None) -> dict[str, Any]:  # fmt: skip
    client, drain = await start_session("canvas-ls-bench", command, init)
    if learn is not None:  # "Learn this workspace" running in the background through every request
        params = types.ExecuteCommandParams("canvas-ls.learnWorkspace", [{"folder": learn.resolve().as_uri()}])
        started = await client.workspace_execute_command_async(params)
        if getattr(started, "error", None):
            raise RuntimeError(f"learn: {started.error}")
        await asyncio.sleep(LEARN_WARMUP_S)  # past its corpus and model loading: training steps are running

    warm = await _warm_up(client, files[0], init)  # the server's counters after it: the report counts from there
    texts = {path: path.read_text() for path in files}
    spots = [(path, spot) for path in files for spot in _positions(texts[path])]
    spots = [spots[int(i * len(spots) / requests)] for i in range(min(requests, len(spots)))]
    versions: dict[Path, int] = {}
    rows: list[dict[str, Any]] = []  # per place: its load, its requests' times, whether the speculation answered
    for index, (path, (line, character)) in enumerate(spots):
        row: dict[str, Any] = {"busy_cores": await asyncio.to_thread(load.at, index) if load is not None else 0}
        rows.append(row)
        uri = path.resolve().as_uri()
        version = versions.get(path, 0) + 1
        versions[path] = version
        if version > 1:
            client.text_document_did_close(types.DidCloseTextDocumentParams(types.TextDocumentIdentifier(uri)))
        client.text_document_did_open(
            types.DidOpenTextDocumentParams(types.TextDocumentItem(uri, LANGUAGES[path.suffix], version, texts[path]))
        )
        started = time.perf_counter()
        items = await _inline(client, uri, line, character)
        row["cold"] = (time.perf_counter() - started) * 1000
        if not items or len(items[0].insert_text) < 2:
            continue
        await asyncio.sleep(think_ms / 1000)  # the user reads the suggestion
        shown = items[0]
        typed = shown.insert_text[: min(3, len(shown.insert_text) - 1)]
        at = _insert(client, uri, version + 1000, types.Position(line, character), typed)
        started = time.perf_counter()
        await _inline(client, uri, at.line, at.character)
        row["typing"] = (time.perf_counter() - started) * 1000
        # Accept the rest (Tab): the suggestion's range is replaced, the cursor goes to its end.
        rest = shown.insert_text[len(typed) :]
        end = _insert(client, uri, version + 2000, at, rest, shown.range.end if shown.range else None, len(typed))
        before = (await client.protocol.send_request_async("canvas/stats", {})).speculation.used
        started = time.perf_counter()
        await _inline(client, uri, end.line, end.character)
        row["accepted"] = (time.perf_counter() - started) * 1000
        row["speculated"] = (await client.protocol.send_request_async("canvas/stats", {})).speculation.used > before
    stats = await client.protocol.send_request_async("canvas/stats", {})
    await end_session(client, drain)

    def times(kind: str, speculated: bool | None = None) -> list[float]:
        return [row[kind] for row in rows if kind in row and speculated in (None, row.get("speculated"))]

    accepts = len(times("accepted"))

    def since(counts: Any, before: Any, *fields: str) -> dict[str, int]:
        return {field: getattr(counts, field) - getattr(before, field) for field in fields}

    sources = {row.source: row.count for row in stats.bySource}
    for row in warm.bySource:
        sources[row.source] -= row.count
    counted = since(stats, warm, "modelCalls", "cacheHits", "typingHits", "requests")
    calls = stats.modelCallMs[len(warm.modelCallMs) :]
    return {
        "requests": len(times("cold")) + len(times("typing")) + accepts,
        "think_ms": think_ms,
        "cold": latency(times("cold")),
        "typing": latency(times("typing")),
        "accepted": latency(times("accepted")),
        "accepted_speculated": latency(times("accepted", True)),
        "accepted_other": latency(times("accepted", False)),
        "speculation_share": len(times("accepted", True)) / max(accepts, 1),
        "speculation": since(stats.speculation, warm.speculation, "started", "used", "wasted"),
        "context_blocks": since(stats.contextBlocks, warm.contextBlocks, "built", "reused"),
        "model_calls": counted["modelCalls"],
        "cache_hits": counted["cacheHits"],
        "typing_hits": counted["typingHits"],
        "hit_rate": (counted["cacheHits"] + counted["typingHits"]) / max(counted["requests"], 1),
        "by_source": {source: count for source, count in sources.items() if count},
        # Where a model call's time goes: the backend call the server waited on, of which the engine computed
        # (encode + denoise) so much; the rest is transport, queueing and scheduling.
        "model_call": latency([row.call for row in calls]),
        "engine": latency([row.engine for row in calls if row.engine is not None]),
        "call_overhead": latency([row.call - row.engine for row in calls if row.engine is not None]),
        "by_load": by_load(rows, LOAD_KINDS) if load is not None and len(load.counts) > 1 else None,
        "rows": rows,  # per place, in order: its load, each of its requests' ms, whether the speculation answered
    }


async def _warm_up(client: LanguageClient, near: Path, init: dict[str, Any]) -> Any:
    """Before the timed requests, as `bench neovim` does: the resident engine's compiled step ready (or off), then
    WARMUP untimed requests in a small document of their own beside the first file (the workspace's token cache and
    the engine's first forwards paid for), so that the first timed request is not a start's. Returns the server's
    `canvas/stats` after them."""
    engine = init["engine"]
    if engine.get("backend", "resident") == "resident":
        await asyncio.to_thread(wait_compiled, engine.get("model"), engine.get("device"))
    uri = near.with_name(f"canvas-ls-warm-up{near.suffix}").resolve().as_uri()
    client.text_document_did_open(
        types.DidOpenTextDocumentParams(types.TextDocumentItem(uri, LANGUAGES[near.suffix], 1, WARMUP_TEXT))
    )
    for line, character in _positions(WARMUP_TEXT)[:WARMUP]:
        await _inline(client, uri, line, character)
    client.text_document_did_close(types.DidCloseTextDocumentParams(types.TextDocumentIdentifier(uri)))
    return await client.protocol.send_request_async("canvas/stats", {})


def _insert(client: LanguageClient, uri: str, version: int, at: types.Position, text: str,
            replaced_end: types.Position | None = None, typed: int = 0) -> types.Position:  # fmt: skip
    """Insert `text` at `at` (replacing up to the suggestion's range end, moved by what was typed, when it replaced
    closers); the cursor after it. One line of text: the bench asks for single-line completions at line ends, and
    multi-line ones move the cursor to the last line."""
    end = at
    if replaced_end is not None and replaced_end.line == at.line:
        end = types.Position(at.line, max(at.character, replaced_end.character + typed))
    client.text_document_did_change(
        types.DidChangeTextDocumentParams(
            types.VersionedTextDocumentIdentifier(version=version, uri=uri),
            [types.TextDocumentContentChangePartial(range=types.Range(at, end), text=text)],
        )
    )
    lines = text.split("\n")
    width = len(lines[-1].encode("utf-16-le")) // 2
    return types.Position(at.line + len(lines) - 1, (at.character if len(lines) == 1 else 0) + width)


async def end_session(client: LanguageClient, drain: asyncio.Future) -> None:
    """Shut the server down, wait for it to exit and close its pipes while the event loop runs: a subprocess
    transport left to the garbage collector after the loop closed raises "Event loop is closed" from its finalizer."""
    await client.shutdown_async(None)
    client.exit(None)
    await client.stop()
    drain.cancel()
    transport = getattr(client._server, "_transport", None)  # asyncio's Process has no public close
    if transport is not None:
        transport.close()


async def _drain(client: LanguageClient, lines: list[bytes] | None = None) -> None:
    """Read the server's stderr so that a full pipe never blocks it (keeping what it said in `lines`, when given)."""
    server = client._server
    if server is None or server.stderr is None:
        return
    while line := await server.stderr.readline():
        if lines is not None:
            lines.append(line)


async def _inline(client: LanguageClient, uri: str, line: int, character: int) -> list[types.InlineCompletionItem]:
    result = await client.text_document_inline_completion_async(
        types.InlineCompletionParams(
            text_document=types.TextDocumentIdentifier(uri),
            position=types.Position(line, character),
            context=types.InlineCompletionContext(trigger_kind=types.InlineCompletionTriggerKind.Automatic),
        )
    )
    return list(result.items if isinstance(result, types.InlineCompletionList) else result or [])


def run_lsp_bench(files: list[Path], requests: int, model: str | None, device: str, backend: str = "resident",
                  think_ms: float = 300, speculate: bool = True, context_tokens: int = 512,
                  learn: Path | None = None, workspace_cache: float | None = None,
                  load: Load | None = None) -> dict[str, Any]:  # fmt: skip
    command = [sys.executable, "-m", "canvas_ls.server.cli", "serve", "--log-level", "WARNING"]
    init = {"engine": {"model": model, "device": device, "backend": backend},
            "completion": {"min_confidence": 0, "speculate": speculate, "context_tokens": context_tokens,
                           "workspace_cache": workspace_cache}}  # fmt: skip
    if learn is not None:
        init["engine"]["learn_minutes"] = 30  # longer than the run: it learns through every request
    report = asyncio.run(_drive(command, files, requests, init, think_ms, learn, load))
    report["learning"] = str(learn) if learn else None
    report["machine"] = machine()
    report["model"] = model or "(default)"
    report["backend"] = backend
    report["speculate"], report["context_tokens"] = speculate, context_tokens
    report["workspace_cache"] = workspace_cache  # None: the model's own weight
    return report


def format_report(report: dict[str, Any]) -> str:
    where = f" ({report['backend']} backend)" if "backend" in report else ""
    learning = f", while learning {report['learning']} in the background" if report.get("learning") else ""
    busy = f", {report['busy_cores']} other cores kept busy" if report.get("busy_cores") else ""
    lines = [f"model {report['model']}{where}", report["machine"], f"{report['requests']} requests{learning}{busy}",
             ""]  # fmt: skip
    for kind in ("cold", "typing", "accepted", "accepted_speculated", "accepted_other", "model_call", "engine",
                 "call_overhead"):  # fmt: skip
        s = report.get(kind, {"n": 0})
        if s["n"]:
            lines.append(f"{kind:<14} n={s['n']:<4} p50 {s['p50_ms']:8.1f} ms   p95 {s['p95_ms']:8.1f} ms")
    lines.append(f"model calls {report['model_calls']}, cache hits {report['cache_hits']}, "
                 f"typing-through hits {report['typing_hits']}, hit rate {100 * report['hit_rate']:.1f}%")  # fmt: skip
    if "speculation" in report:
        spec = report["speculation"]
        lines.append(f"after a {report['think_ms']:.0f} ms pause, accepted suggestions answered from the speculation: "
                     f"{100 * report['speculation_share']:.1f}% (started {spec['started']}, used {spec['used']}, "
                     f"wasted {spec['wasted']})")  # fmt: skip
    if report.get("context_tokens"):
        blocks = report["context_blocks"]
        lines.append(f"context from other files ({report['context_tokens']} tokens): blocks built {blocks['built']}, "
                     f"reused {blocks['reused']}")  # fmt: skip
    lines.append(f"outcomes: {report['by_source']}")
    return "\n".join(lines + format_by_load(report.get("by_load") or {}, LOAD_KINDS))
