"""`canvas-ls engine`: one long-lived process holds the model for every editor on the machine.

HTTP on a unix socket (mode 0600, in a 0700 folder of the user's runtime directory) by default, or on TCP with a
bearer token (loopback unless told otherwise, and never a non-loopback address without a token).

    POST /v1/completions   OpenAI-compatible: prompt (= prefix), suffix, max_tokens, temperature, stream (drafts
                           as server-sent events), so the client side can also talk to vLLM or SGLang
    POST /v1/infill        the engine's whole result (InfillResult) for {prefix, suffix, settings, document,
                           priority, adapter}; priority "background": work computed ahead (an editor's next
                           suggestion); adapter: a LoRA adapter folder tuned from this model (a workspace's), held
                           beside the others (`engine.adapters.AdapterSet`), /v1/fill takes it too
    POST /v1/fill          several holes and span rewrites in one canvas: {segments: [{"text": ...} | {"hole": true}
                           | {"rewrite": current text, "strength": s}, ...], settings, document}; the text before
                           the first hole is the prefix, after the last the suffix; the answers are `gaps`
    GET  /health           model, device, quantised weights, queue depth, the compiled decoder's state (warming,
                           ready, failed, off)
    GET  /metrics          Prometheus text: requests, latency, steps, tokens per forward, prefix-cache hits, queue,
                           batch rows and step time by rows

Requests run on one scheduler thread (`batcher.Batcher`): every request in flight denoises in one batch, their canvases
sharing each decoder forward; requests join and leave between steps. Each has a cancel flag the denoising loop
checks every step: a client that disconnects, or a newer request for the same `document`, stops it at its next
step; the others go on. Background requests run only while no other request waits or runs: one that arrives
stops them before the next step (they answer 499, counted in canvas_background_preempted; their requests are
counted under endpoint "infill_background"). A batch computes with one adapter: a request naming another waits
until the batch drains.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Summary,
    generate_latest,
)
from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .addresses import check_address, check_socket
from .batcher import Batcher
from .canvas import InfillCancelled, StepView
from .engine import Engine, InfillRequest
from .errors import ModelLoadError
from .paths import (
    API_HEADER,
    API_VERSION,
    CANCELLED_STATUS,
    MAX_BATCH,
    MAX_BODY_BYTES,
    document_repository,
)
from .regions import FillError, Hole, parts_from_json, split_parts
from .settings import SettingsError
from .supersession import Supersession

__all__ = ["EngineService", "serve"]

log = logging.getLogger(__name__)


class BadRequest(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class EngineService:
    def __init__(self, engine: Engine, token: str | None = None, max_body: int = MAX_BODY_BYTES,
                 idle_exit_s: float | None = None, max_batch: int = MAX_BATCH):  # fmt: skip
        self.engine = engine
        self.token = token
        self.max_body = max_body
        self.idle_exit_s = idle_exit_s
        self.last_activity = time.monotonic()
        self.in_flight: Supersession[threading.Event] = Supersession()  # document -> its newest request
        self.queue = 0
        registry = self.registry = CollectorRegistry()
        self.m_requests = Counter("canvas_requests", "Requests by endpoint and outcome", ["endpoint", "outcome"],
                                  registry=registry)  # fmt: skip
        self.m_latency = Histogram("canvas_latency_seconds", "Infill latency", registry=registry,
                                   buckets=(0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 1, 2, 5, 10))  # fmt: skip
        self.m_steps = Histogram("canvas_denoising_steps", "Denoising steps per request", registry=registry,
                                 buckets=(1, 2, 4, 8, 12, 16, 24, 32, 64, 128))  # fmt: skip
        self.m_tpf = Histogram("canvas_tokens_per_forward", "Tokens per decoder forward", registry=registry,
                               buckets=(0.5, 1, 1.5, 2, 3, 4, 6, 8, 12, 16))  # fmt: skip
        self.m_prefix_hits = Counter("canvas_prefix_cache_hits", "Requests whose prefix KV came from the cache",
                                     registry=registry)  # fmt: skip
        self.m_prefix_reused = Counter("canvas_prefix_reused_tokens", "Prefix tokens not re-encoded",
                                       registry=registry)  # fmt: skip
        self.m_cancelled_steps = Histogram(
            "canvas_cancelled_after_steps", "Denoising steps a cancelled request had run (a disconnect or a newer "
            "request stops it at its next step)", registry=registry, buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 512),
        )  # fmt: skip
        self.m_preempted = Counter("canvas_background_preempted", "Background requests dropped for a real one",
                                   registry=registry)  # fmt: skip
        self.m_queue = Gauge("canvas_queue_depth", "Requests waiting or running", registry=registry)
        self.m_batch = Histogram("canvas_batch_size", "Requests sharing a decoder forward", registry=registry,
                                 buckets=(1, 2, 3, 4, 6, 8, 12, 16))  # fmt: skip
        self.m_step = Summary("canvas_step_seconds", "One denoising step of a batch (shared forward and the rows' "
                              "sampling), by rows in it", ["rows"], registry=registry)  # fmt: skip
        compiled = engine.decoder.report
        for name, key, text in (
            ("canvas_compiled_steps", "compiled_steps", "Batched steps run by the compiled decoder"),
            ("canvas_eager_steps", "eager_steps", "Batched steps run eager (compile off, warming up, or failed)"),
            ("canvas_compilations_after_warmup", "compilations_after_warmup",
             "Decoder graphs compiled after the warm-up (shapes it did not cover)"),
            ("canvas_uncovered_steps", "uncovered_steps",
             "Steps run eager because no precompiled graph's guards accept their shapes (CPU)"),
        ):  # fmt: skip
            Gauge(name, text, registry=registry).set_function(lambda key=key: float(compiled()[key]))
        Gauge("canvas_compile_warmup_seconds", "Seconds the decoder's compilation took (0 until done)",
              registry=registry).set_function(lambda: float(compiled()["warmup_seconds"] or 0.0))  # fmt: skip
        Gauge("canvas_prefix_cache_bytes", "Bytes of KV the prefix caches hold (bounded: --prefix-cache-mb, 64 "
              "snapshots)", registry=registry).set_function(lambda: float(engine.prefix_cache_bytes()))  # fmt: skip
        self.batcher = Batcher(engine, max_batch, self._observe_step, self.m_preempted.inc)
        engine.warm_up()  # compiles in the background when compile is on; requests run eager meanwhile
        self.app = Starlette(
            routes=[
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.metrics, methods=["GET"]),
                Route("/v1/infill", self.infill, methods=["POST"]),
                Route("/v1/fill", self.fill, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
            ],
            exception_handlers={BadRequest: _bad_request, HTTPException: _http_error, Exception: _internal_error},
        )
        self.app.add_middleware(_BearerToken, token=token)
        self.app.add_middleware(_ApiVersion)

    # -- endpoints ---------------------------------------------------------------------------------------------

    async def health(self, request: Request) -> JSONResponse:
        device = str(self.engine.loaded.device)
        return JSONResponse({"status": "ok", "api": API_VERSION, "model": self.engine.name, "device": device,
                             "dtype": self.engine.dtype, "quantize": self.engine.loaded.quantized, "queue": self.queue,
                             "steps": self.engine.steps, "pid": os.getpid(),
                             "compile": self.engine.decoder.report(),
                             "adapters": list(self.engine.adapters.names),
                             "identity": self.engine.identity,
                             "threads": self.engine.threads and self.engine.threads.choice.to_dict()})  # fmt: skip

    async def metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    async def infill(self, request: Request) -> Response:
        body = await self._json(request)
        prefix, suffix = _text(body, "prefix"), _text(body, "suffix", "")
        settings = body.get("settings") or {}
        if not isinstance(settings, dict):
            raise BadRequest(400, "'settings' must be an object")
        priority = body.get("priority", "normal")
        if priority not in ("normal", "background"):
            raise BadRequest(400, f"'priority' must be 'normal' or 'background', got {priority!r}")
        endpoint = "infill_background" if priority == "background" else "infill"  # counted apart in /metrics
        result = await self._run(request, endpoint, prefix, suffix, settings, body.get("document"),
                                 background=priority == "background", adapter=_adapter(body),
                                 score=_flag(body, "score"))  # fmt: skip
        if result is None:
            return JSONResponse({"cancelled": True}, status_code=CANCELLED_STATUS)
        return JSONResponse(result)

    async def fill(self, request: Request) -> Response:
        body = await self._json(request)
        segments = body.get("segments")
        if not isinstance(segments, list):
            raise BadRequest(400, "'segments' must be a list")
        settings = body.get("settings") or {}
        if not isinstance(settings, dict):
            raise BadRequest(400, "'settings' must be an object")
        try:
            prefix, middle, suffix = split_parts(parts_from_json(segments))
        except FillError as exc:
            raise BadRequest(400, str(exc)) from exc
        result = await self._run(request, "fill", prefix, suffix, settings, body.get("document"), middle=middle,
                                 adapter=_adapter(body), score=_flag(body, "score"))  # fmt: skip
        if result is None:
            return JSONResponse({"cancelled": True}, status_code=CANCELLED_STATUS)
        return JSONResponse(result)

    async def completions(self, request: Request) -> Response:
        body = await self._json(request)
        prefix, suffix = _text(body, "prompt"), _text(body, "suffix", "")
        settings: dict[str, Any] = {}
        if body.get("max_tokens") is not None:
            settings["max_new_tokens"] = _int(body, "max_tokens")
        if body.get("temperature") is not None:
            temperature = _number(body, "temperature")
            settings.update(t_min=temperature / 2, t_max=max(temperature, 1e-3))
        if body.get("seed") is not None:
            settings["seed"] = _int(body, "seed")
        created, ident = int(time.time()), f"cmpl-{uuid.uuid4().hex[:24]}"

        def chunk(text: str, finish: str | None, **extra: Any) -> dict[str, Any]:
            choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": finish, **extra}
            return {"id": ident, "object": "text_completion", "created": created, "model": self.engine.name,
                    "choices": [choice]}  # fmt: skip

        if not body.get("stream"):
            result = await self._run(request, "completions", prefix, suffix, settings, body.get("document"))
            if result is None:
                return JSONResponse({"cancelled": True}, status_code=CANCELLED_STATUS)
            response = chunk(result["text"], _finish(result))
            produced = len(result["tokens"])
            response["usage"] = {"prompt_tokens": result["prefix_tokens"], "completion_tokens": produced,
                                 "total_tokens": result["prefix_tokens"] + produced}  # fmt: skip
            return JSONResponse(response)

        # Streaming: every denoising step's draft (the whole current text), then the final text.
        drafts: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        tokenizer = self.engine.tokenizer

        stops = set(self.engine.stop_ids)

        def on_step(view: StepView) -> None:
            ids = view.argmax.tolist()
            ids = ids[: next((i for i, t in enumerate(ids) if t in stops), len(ids))]  # the draft ends at its EOS
            text = tokenizer.decode(ids, skip_special_tokens=True).removeprefix(view.healed)
            loop.call_soon_threadsafe(drafts.put_nowait, chunk(text, None, draft=True, step=view.step))

        async def events():
            task = asyncio.ensure_future(
                self._run(request, "completions", prefix, suffix, settings, body.get("document"), on_step)
            )
            task.add_done_callback(lambda _: drafts.put_nowait(None))
            while (item := await drafts.get()) is not None:
                yield {"data": json.dumps(item)}
            result = await task
            if result is not None:
                yield {"data": json.dumps(chunk(result["text"], _finish(result)))}
            yield {"data": "[DONE]"}

        return EventSourceResponse(events())

    # -- the work ----------------------------------------------------------------------------------------------

    async def _json(self, request: Request) -> dict[str, Any]:
        """The JSON body, read within the limit: a declared Content-Length over it is refused before reading, and a
        body without one (chunked) is counted as it arrives, so an oversized request is never held in memory."""
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body):
            raise BadRequest(413, f"request body of {declared} bytes is over the limit of {self.max_body}")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body:
                raise BadRequest(413, f"request body over the limit of {self.max_body} bytes")
            chunks.append(chunk)
        body = b"".join(chunks)
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise BadRequest(400, f"malformed JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise BadRequest(400, "the body must be a JSON object")
        return data

    async def _run(
        self,
        request: Request,
        endpoint: str,
        prefix: str,
        suffix: str,
        settings: dict[str, Any],
        document: Any,
        on_step: Callable[[StepView], None] | None = None,
        middle: list[str | Hole] | None = None,
        background: bool = False,
        adapter: str | None = None,
        score: bool = True,
    ) -> dict[str, Any] | None:
        """Run one infill on the worker; None when it was cancelled (client gone, superseded, or, in the
        background, preempted). A document's background request supersedes only its older background one."""
        try:
            self.engine.settings.merged(settings)  # a bad setting is this request's 400, not its batch's failure
        except SettingsError as exc:
            raise BadRequest(400, str(exc)) from exc
        workspace = document_repository(document)  # its token cache (`engine.token_cache`), once built
        # a newer request for the same document supersedes the older one (a background one only the older background)
        key = (f"background:{document}" if background else document) if isinstance(document, str) else None
        running = self.in_flight.running(key, threading.Event()) if key else contextlib.nullcontext(threading.Event())
        with running as cancel:
            self.queue += 1
            self.m_queue.set(self.queue)
            self.last_activity = time.monotonic()
            started = time.perf_counter()

            submitted = InfillRequest(prefix, suffix, settings, cancel, on_step, middle, background, adapter, workspace,
                                      score)  # fmt: skip
            job = asyncio.wrap_future(self.batcher.submit(submitted))
            watcher = asyncio.ensure_future(_watch_disconnect(request, cancel))
            try:
                try:
                    outcome = await job
                except asyncio.CancelledError:  # the caller's task was cancelled (a Ray Serve cancellation)
                    cancel.set()  # the job stops at its next step instead of denoising for nobody
                    raise
                except (FillError, ModelLoadError) as exc:  # a fill it cannot lay out, an adapter it cannot load
                    self.m_requests.labels(endpoint, "bad_request").inc()
                    raise BadRequest(400, str(exc)) from exc
                if isinstance(outcome, InfillCancelled):
                    self.m_cancelled_steps.observe(outcome.steps)
                result = None if isinstance(outcome, InfillCancelled) else outcome.to_dict()
            finally:
                watcher.cancel()
                self.queue -= 1
                self.m_queue.set(self.queue)
                self.last_activity = time.monotonic()
        outcome = "cancelled" if result is None else "ok"
        self.m_requests.labels(endpoint, outcome).inc()
        if result is not None:
            self.m_latency.observe(time.perf_counter() - started)
            self.m_steps.observe(result["steps"])
            self.m_tpf.observe(result["tokens_per_forward"])
            if result["prefix_reused_tokens"]:
                self.m_prefix_hits.inc()
                self.m_prefix_reused.inc(result["prefix_reused_tokens"])
            log.debug("%s: %d prefix tokens (%d reused) encoded in %.1f ms, %d steps in %.1f ms",
                      endpoint, result["prefix_tokens"], result["prefix_reused_tokens"], result["encode_ms"],
                      result["steps"], result["denoise_ms"])  # fmt: skip
        return result

    def _observe_step(self, rows: int, seconds: float) -> None:
        self.m_batch.observe(rows)
        self.m_step.labels(str(rows)).observe(seconds)

    async def memory_watch(self, every_s: float = 2.0) -> None:
        """Hand freed memory back to the system once the engine is idle after work. Requests of ever-new prefix
        lengths leave the C allocator's arenas (one per torch thread) holding freed blocks that it does not return
        by itself; `bench soak` measured the resident engine at +0.4 MB per request without this."""
        trim = _malloc_trim()
        trimmed_at = self.last_activity
        while trim is not None:
            await asyncio.sleep(every_s)
            if self.queue == 0 and self.last_activity != trimmed_at:
                trimmed_at = self.last_activity
                trim()

    async def idle_watch(self, server: Any) -> None:
        """Ask uvicorn to exit after `idle_exit_s` without requests."""
        while self.idle_exit_s:
            await asyncio.sleep(min(5.0, self.idle_exit_s / 4))
            if self.queue == 0 and time.monotonic() - self.last_activity > self.idle_exit_s:
                server.should_exit = True
                return


def _malloc_trim() -> Callable[[], None] | None:
    """glibc's `malloc_trim(0)` (return free memory at the top of each arena and whole free pages inside them to the
    system), or None where the C library is not glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    return lambda: trim(0) and None


async def _watch_disconnect(request: Request, cancel: threading.Event) -> None:
    """Set `cancel` when the client goes away: the ASGI server answers `receive()` with http.disconnect then (the
    body was read already). Waiting, not polling: a wake-up every few ms costs the model's threads on a small CPU."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    cancel.set()


async def _bad_request(request: Request, exc: Exception) -> JSONResponse:
    return JSONResponse({"error": str(exc)}, getattr(exc, "status", 400))


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own refusals (no such route, a method the route does not take) as JSON like the others."""
    status = getattr(exc, "status_code", 400)
    return JSONResponse({"error": f"{request.method} {request.url.path}: {getattr(exc, 'detail', exc)}"}, status)


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    """A bug of ours: the request gets a JSON 500 with the reason (the traceback goes to the log); the engine goes
    on."""
    return JSONResponse({"error": f"internal error: {type(exc).__name__}: {exc}"}, 500)


class _ApiVersion:
    """ASGI middleware: every answer names the engine's API version (`API_HEADER`), so a client never reads a result
    of another version as its own (a deployment upgraded between its /health and its answer)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        async def versioned(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), API_HEADER_ITEM]}
            await send(message)

        await self.app(scope, receive, versioned if scope["type"] == "http" else send)


API_HEADER_ITEM = (API_HEADER.encode(), str(API_VERSION).encode())


class _BearerToken:
    """ASGI middleware: with a token set, every request must carry `Authorization: Bearer <token>` (compared in
    constant time: the answer's timing says nothing of how much of a guess was right)."""

    def __init__(self, app: Any, token: str | None):
        self.app = app
        self.expected = f"Bearer {token}".encode() if token else None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        if scope["type"] == "http" and self.expected is not None and not hmac.compare_digest(given, self.expected):
            return await JSONResponse({"error": "missing or wrong bearer token"}, 401)(scope, receive, send)
        await self.app(scope, receive, send)


def _text(body: dict[str, Any], key: str, default: str | None = None) -> str:
    value = body.get(key, default)
    if not isinstance(value, str):
        raise BadRequest(400, f"'{key}' must be a string")
    return value


def _flag(body: dict[str, Any], name: str, default: bool = True) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise BadRequest(400, f"'{name}' must be true or false, got {value!r}")
    return value


def _adapter(body: dict[str, Any]) -> str | None:
    """The request's LoRA adapter folder (`adapter`: a workspace's, tuned from the engine's model), or None."""
    adapter = body.get("adapter")
    if adapter is not None and (not isinstance(adapter, str) or not adapter):
        raise BadRequest(400, "'adapter' must be an adapter folder's path")
    return adapter


def _int(body: dict[str, Any], key: str) -> int:
    value = body.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(400, f"'{key}' must be an integer")
    return value


def _number(body: dict[str, Any], key: str) -> float:
    value = body.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1e6:
        raise BadRequest(400, f"'{key}' must be a number from 0")
    return float(value)


def _finish(result: dict[str, Any]) -> str:
    return "stop" if result["stop_reason"] == "eos" else "length"


def serve(service: EngineService, socket: Path | None = None, host: str | None = None, port: int | None = None,
          log_level: str = "warning", allow_remote: bool = False) -> None:  # fmt: skip
    """Run until stopped (or idle): on a unix socket created 0600, or on TCP (with the service's token, see
    `check_address`). A path that exists and is not a socket is refused, never deleted."""
    import socket as sockets

    import uvicorn

    if socket is None:
        check_address(host or "127.0.0.1", service.token, allow_remote)
    else:
        check_socket(socket)

    config = uvicorn.Config(service.app, host=host or "127.0.0.1", port=port or 0, log_level=log_level,
                            timeout_graceful_shutdown=2)  # fmt: skip
    server = uvicorn.Server(config)
    bound = None
    if socket is not None:
        socket.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        socket.unlink(missing_ok=True)
        bound = sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM)
        previous = os.umask(0o177)  # the socket file is born 0600: no window where others could connect
        try:
            bound.bind(str(socket))
        finally:
            os.umask(previous)

    async def main() -> None:
        watches = [asyncio.ensure_future(service.idle_watch(server)), asyncio.ensure_future(service.memory_watch())]
        await server.serve(sockets=[bound] if bound is not None else None)
        for watch in watches:
            watch.cancel()

    asyncio.run(main())
