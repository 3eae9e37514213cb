"""`canvas-ls bench soak`: many LSP requests against the server and its resident engine; does anything grow or break?

A real LSP client (pygls) starts `canvas-ls serve` (the resident backend, in a runtime folder of its own so that the
engine it starts is this run's alone) and sends a seeded random mix: incremental edits (multi-byte and astral
characters, CRLF, at line ends and across lines), inline completions (awaited), completions cancelled with
`$/cancelRequest` a few milliseconds after they were sent, `canvas/prefetch` (half the time followed by the
completion there, which joins it; one in ten for a version not yet sent), opens and closes (at most 8 documents
open). One
"request" is one message sent. The resident set size (RSS) of both processes is sampled along the way; growth is
measured from the end of a warm-up (the first 10% of the requests: caches fill, the allocator settles) to the end,
each sample after a pause of 2.5 s (an editor's user pauses too: the idle engine then hands freed memory back).
At the end: every non-cancelled completion answered without an error, the engine's queue is back to 0, and the
counters agree (the engine's requests by outcome, the server's model calls and speculations).
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from lsprotocol import types
from prometheus_client.parser import text_string_to_metric_families
from pygls.lsp.client import LanguageClient

from ..engine.tasks import machine
from .lsp import end_session, start_session

MAX_OPEN = 8
WEIGHTS = {"edit": 40, "complete": 27, "cancel": 9, "prefetch": 9, "open": 7.5, "close": 7.5}
INSERTS = ["x", "total = ", "(", ")", "\n", "    ", "é", "→", "😀", "𝔘", "\r\n", "# note ", "return ", "def f(a, b):\n"]


def rss_mb(pid: int) -> float:
    """Resident set size of a process, from /proc (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def position(text: str, offset: int) -> types.Position:
    """The LSP position (UTF-16 code units, the negotiated encoding here) of a code-point offset."""
    line = text.count("\n", 0, offset)
    start = text.rfind("\n", 0, offset) + 1
    return types.Position(line, len(text[start:offset].encode("utf-16-le")) // 2)


class Soak:
    def __init__(self, client: LanguageClient, sources: list[str], seed: int):
        self.client, self.sources, self.rng = client, sources, random.Random(seed)
        self.documents: dict[str, tuple[str, int]] = {}  # uri -> (text, version)
        self.sent: Counter[str] = Counter()
        self.failures: list[str] = []
        self.opened = 0

    def open(self) -> None:
        self.opened += 1
        uri = f"file:///soak/doc{self.opened}.py"
        text = self.rng.choice(self.sources)
        self.documents[uri] = (text, 1)
        self.client.text_document_did_open(
            types.DidOpenTextDocumentParams(types.TextDocumentItem(uri, "python", 1, text))
        )

    def close(self) -> None:
        uri = self.rng.choice(sorted(self.documents))
        del self.documents[uri]
        self.client.text_document_did_close(types.DidCloseTextDocumentParams(types.TextDocumentIdentifier(uri)))

    def edit(self) -> None:
        uri = self.rng.choice(sorted(self.documents))
        text, version = self.documents[uri]
        start = self.rng.randrange(len(text) + 1)
        end = min(len(text), start + self.rng.choice((0, 0, 0, 1, 3, 40)))  # mostly insertions
        new = self.rng.choice(INSERTS) if end == start or self.rng.random() < 0.5 else ""
        change = types.TextDocumentContentChangePartial(
            range=types.Range(position(text, start), position(text, end)), text=new
        )
        self.documents[uri] = (text[:start] + new + text[end:], version + 1)
        document = types.VersionedTextDocumentIdentifier(version=version + 1, uri=uri)
        self.client.text_document_did_change(types.DidChangeTextDocumentParams(document, [change]))

    def _completion_params(self) -> types.InlineCompletionParams:
        uri = self.rng.choice(sorted(self.documents))
        text = self.documents[uri][0]
        line_ends = [i for i, c in enumerate(text) if c == "\n"] + [len(text)]
        at = self.rng.choice(line_ends)
        if text[at - 1 : at] == "\r":
            at -= 1
        return types.InlineCompletionParams(
            text_document=types.TextDocumentIdentifier(uri),
            position=position(text, at),
            context=types.InlineCompletionContext(trigger_kind=types.InlineCompletionTriggerKind.Automatic),
        )

    async def complete(self, params: types.InlineCompletionParams | None = None) -> None:
        try:
            await asyncio.wait_for(
                self.client.text_document_inline_completion_async(params or self._completion_params()), 60
            )
        except Exception as exc:
            self.failures.append(f"completion: {type(exc).__name__}: {exc}")

    async def prefetch(self) -> None:
        """`canvas/prefetch` where the cursor went (now and then for a version the server has not seen), followed
        half the time by the completion there, as an editor's debounce would send it (it joins the prefetch)."""
        params = self._completion_params()
        uri = params.text_document.uri
        version = self.documents[uri][1] + (1 if self.rng.random() < 0.1 else 0)
        position = {"line": params.position.line, "character": params.position.character}
        try:
            await asyncio.wait_for(
                self.client.protocol.send_request_async(
                    "canvas/prefetch", {"textDocument": {"uri": uri, "version": version}, "position": position}
                ),
                60,
            )
        except Exception as exc:
            self.failures.append(f"prefetch: {type(exc).__name__}: {exc}")
        if self.rng.random() < 0.5:
            await self.complete(params)

    async def cancel(self, number: int) -> None:
        msg_id = f"soak-cancel-{number}"
        pending = asyncio.ensure_future(
            self.client.protocol.send_request_async(
                types.TEXT_DOCUMENT_INLINE_COMPLETION, self._completion_params(), msg_id=msg_id
            )
        )
        await asyncio.sleep(self.rng.uniform(0, 0.02))
        self.client.protocol.notify(types.CANCEL_REQUEST, types.CancelParams(id=msg_id))
        try:
            await asyncio.wait_for(pending, 60)
        except TimeoutError:
            self.failures.append("a cancelled completion never answered")
        except Exception as exc:  # the cancellation's own error is the expected answer
            if "cancel" not in str(exc).lower():
                self.failures.append(f"cancelled completion: {type(exc).__name__}: {exc}")

    async def step(self, number: int) -> str:
        kinds = dict(WEIGHTS)
        if len(self.documents) >= MAX_OPEN:
            kinds.pop("open")
        if len(self.documents) <= 1:
            kinds.pop("close")
        kind = "open" if not self.documents else self.rng.choices(list(kinds), list(kinds.values()))[0]
        if kind == "complete":
            await self.complete()
        elif kind == "prefetch":
            await self.prefetch()
        elif kind == "cancel":
            await self.cancel(number)
        else:
            getattr(self, kind)()
            if number % 50 == 0:
                await asyncio.sleep(0)  # let the server's answers in
        self.sent[kind] += 1
        return kind


def _engine(runtime: Path) -> tuple[httpx.Client, dict[str, Any]]:
    (socket,) = (runtime / "canvas-ls").glob("*.sock")
    client = httpx.Client(transport=httpx.HTTPTransport(uds=str(socket)), base_url="http://engine", timeout=10)
    return client, client.get("/health").json()


def _metrics(engine: httpx.Client) -> dict[str, float]:
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(engine.get("/metrics").text):
        for sample in family.samples:
            if sample.name == "canvas_requests_total":
                key = f"{sample.labels['endpoint']}:{sample.labels['outcome']}"
                values[key] = values.get(key, 0) + sample.value
            elif sample.name == "canvas_queue_depth":
                values["queue"] = sample.value
            elif sample.name == "canvas_prefix_cache_bytes":
                values["prefix_cache_mb"] = sample.value / 2**20
            elif sample.name in ("canvas_compilations_after_warmup", "canvas_compiled_steps", "canvas_eager_steps"):
                values[sample.name.removeprefix("canvas_")] = sample.value
    return values


async def _drive(requests: int, model: str | None, device: str, seed: int, runtime: Path) -> dict[str, Any]:
    # One soak's sequence (~85 lines): start, send, sample memory along the way, drain, read the counters, check.
    messages: list[str] = []
    stderr: list[bytes] = []
    command = [sys.executable, "-m", "canvas_ls.server.cli", "serve", "--log-level", "WARNING"]
    init = {"engine": {"model": model, "device": device, "backend": "resident", "idle_exit_s": 60},
            "completion": {"min_confidence": 0}}  # fmt: skip
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime)}
    client, drain = await start_session("canvas-ls-soak", command, init, env, messages, stderr)
    server_pid = client._server.pid  # the subprocess pygls started
    engine, health = _engine(runtime)
    engine_pid = health["pid"]

    from .. import server

    server_code = Path(server.__file__).parent  # the language server's own modules, as documents
    sources = [p.read_text(encoding="utf-8") for p in sorted(server_code.glob("*.py"))][:12]
    soak = Soak(client, sources, seed)
    warm_up = max(1, requests // 10)
    samples: list[dict[str, float]] = []
    started = time.perf_counter()
    for number in range(requests):
        await soak.step(number)
        if number + 1 == warm_up or (number + 1) % max(1, requests // 20) == 0:
            await asyncio.sleep(2.5)  # background work (speculation) ends, and the idle engine trims its heap
            samples.append({"requests": number + 1, "server_mb": rss_mb(server_pid), "engine_mb": rss_mb(engine_pid),
                            "prefix_cache_mb": _metrics(engine).get("prefix_cache_mb", 0.0),
                            "seconds": time.perf_counter() - started})  # fmt: skip
    seconds = time.perf_counter() - started

    for _ in range(600):  # what is still queued or running in the engine (speculations) finishes
        if engine.get("/health").json()["queue"] == 0:
            break
        await asyncio.sleep(0.1)
    stats = await client.protocol.send_request_async("canvas/stats", {})
    metrics = _metrics(engine)
    queue = engine.get("/health").json()["queue"]
    final = {"requests": requests, "server_mb": rss_mb(server_pid), "engine_mb": rss_mb(engine_pid),
             "prefix_cache_mb": metrics.get("prefix_cache_mb", 0.0), "seconds": seconds}  # fmt: skip
    samples.append(final)
    await end_session(client, drain)
    engine.close()
    os.kill(engine_pid, 15)  # this run's own engine (its own runtime folder)

    base = next(s for s in samples if s["requests"] >= warm_up)
    speculation = stats.speculation
    engine_infill = {k: v for k, v in metrics.items() if k.startswith("infill")}  # endpoint:outcome
    checks = {
        "no failed completion": not soak.failures,
        "no error shown or counted": not messages and stats.errors == 0,
        "engine queue back to 0": queue == 0 and metrics.get("queue", 0) == 0,
        "every model call reached the engine": stats.modelCalls
        <= sum(v for k, v in engine_infill.items() if k.startswith("infill:")),
        "speculations accounted for": speculation.started
        == speculation.used + speculation.wasted + speculation.running + speculation.ready,
        "no traceback on the server's stderr": not any(b"Traceback" in line for line in stderr),
        "prefetches accounted for": stats.prefetch.used <= stats.prefetch.started <= soak.sent["prefetch"],
    }
    return {
        "machine": machine(),
        "model": model or "(default)",
        "requests": requests,
        "sent": dict(soak.sent),
        "seconds": seconds,
        "warm_up": warm_up,
        "samples": samples,
        "server_growth_mb": final["server_mb"] - base["server_mb"],
        "engine_growth_mb": final["engine_mb"] - base["engine_mb"],
        # of which the prefix KV cache filling up to its bounds (by design, not a leak)
        "prefix_cache_growth_mb": final["prefix_cache_mb"] - base["prefix_cache_mb"],
        "failures": soak.failures[:20],
        "messages": messages[:20],
        "server": {
            "requests": stats.requests,
            "model_calls": stats.modelCalls,
            "errors": stats.errors,
            "by_source": {row.source: row.count for row in stats.bySource},
            "speculation": {k: getattr(speculation, k) for k in ("started", "used", "wasted", "running", "ready")},
            "prefetch": {"started": stats.prefetch.started, "used": stats.prefetch.used},
        },
        "engine": metrics,
        "checks": checks,
    }


def run_soak(requests: int, model: str | None, device: str, seed: int = 0) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="canvas-ls-soak-") as runtime:
        Path(runtime).chmod(0o700)
        return asyncio.run(_drive(requests, model, device, seed, Path(runtime)))


def format_soak(report: dict[str, Any]) -> str:
    lines = [f"model {report['model']}", report["machine"],
             f"{report['requests']} requests in {report['seconds']:.0f} s: "
             + ", ".join(f"{k} {v}" for k, v in sorted(report["sent"].items())), "",
             f"{'requests':>9} {'server MB':>10} {'engine MB':>10} {'its prefix cache MB':>20}"]  # fmt: skip
    lines += [f"{s['requests']:>9} {s['server_mb']:>10.1f} {s['engine_mb']:>10.1f} {s['prefix_cache_mb']:>20.1f}"
              for s in report["samples"]]  # fmt: skip
    lines.append(f"growth after the warm-up ({report['warm_up']} requests): server {report['server_growth_mb']:+.1f} "
                 f"MB, engine {report['engine_growth_mb']:+.1f} MB (its prefix cache "
                 f"{report['prefix_cache_growth_mb']:+.1f} MB)")  # fmt: skip
    server = report["server"]
    lines.append(f"server: {server['requests']} completions, {server['model_calls']} model calls, "
                 f"by source {server['by_source']}, speculation {server['speculation']}, "
                 f"prefetch {server.get('prefetch')}")  # fmt: skip
    lines.append(f"engine: {report['engine']}")
    lines += [f"{'ok  ' if ok else 'FAIL'} {name}" for name, ok in report["checks"].items()]
    lines += [f"  failure: {failure}" for failure in report["failures"]]
    return "\n".join(lines)


def plot_soak(report: dict[str, Any], path: Path) -> Path:
    """Resident memory of both processes against the requests sent."""
    from .core import figure

    samples = report["samples"]
    with figure(path, (6.5, 3.6)) as (_, axis):
        for key, label in (("server_mb", "language server"), ("engine_mb", "resident engine")):
            axis.plot([s["requests"] for s in samples], [s[key] for s in samples], marker="o", label=label)
        axis.axvline(report["warm_up"], color="grey", linestyle=":", label="end of warm-up")
        axis.set_xlabel("LSP requests sent")
        axis.set_ylabel("RSS (MB)")
        axis.set_title(f"soak: {report['requests']} requests, {report['model']}", fontsize=9)
    return path
