"""Where the model runs, seen from the server: off the event loop, cancellable, never fatal.

`LocalBackend` loads the engine in this process on one worker thread and runs every infill there, so the event
loop that answers the editor never waits on the model. `ResidentBackend` talks to `canvas-ls engine`, one shared
process per user, over its unix socket, and starts or restarts it as needed. `OpenAIBackend` asks any
OpenAI-compatible completions server. All three follow `Backend`, and every request ends in one typed `Reply`:
`Answer`, `Cancelled` or `Failed` (nothing is raised into the server, no dict whose shape depends on the backend).

Only this module loads the engine (torch, transformers), and only inside the worker; the rest of the server imports
only engine modules that need no torch (`paths`, `regions`, `confidence`, `workspaces`): the server starts answering
before torch is even imported (tests/test_packaging.py checks it).
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx

from ..engine.paths import API_HEADER, API_VERSION, CANCELLED_STATUS, IDLE_EXIT_S
from ..engine.regions import Hole
from ..engine.results import GapResult, InfillResult
from .silence import Why

log = logging.getLogger(__name__)
# A remote engine: connecting gives up after this long (a deployment that does not answer is said at once, not
# waited on), a request after this long (a denoise on a loaded deployment), and /health is asked again this often
# after a failure.
CONNECT_TIMEOUT_S = 5.0
REQUEST_TIMEOUT_S = 120.0
RECHECK_S = 5.0


class CancelFlag(threading.Event):
    """A request's cancel flag: the engine's worker thread checks `is_set()` between denoising steps, and the
    event loop can `await until_set()` without polling. (Polling wakes the process every few ms, and on a 2-core
    machine every wake-up stalls one of the engine's two OpenMP threads at its next barrier: a 10 ms poller in
    another process made completions ~8% slower, measured.)"""

    def __init__(self) -> None:
        super().__init__()
        self._waiters: list[asyncio.Future[None]] = []

    def set(self) -> None:
        super().set()
        for waiter in list(self._waiters):
            waiter.get_loop().call_soon_threadsafe(_resolve, waiter)

    async def until_set(self) -> None:
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            if not self.is_set():  # checked after registering: a set() in between still resolves the waiter
                await waiter
        finally:
            self._waiters.remove(waiter)


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


@dataclass(frozen=True)
class Settings:
    """The engine settings a request asks for, by `engine/settings.py`'s names; None: the model's own."""

    gap_tokens: int | None = None
    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    max_prefix_tokens: int | None = None
    max_suffix_tokens: int | None = None
    max_steps: int | None = None
    entropy_bound: float | None = None
    suffix_refresh: int | None = None
    single_line: bool | None = None
    workspace_cache: float | None = None
    max_holes: int | None = None
    fill_tokens: int | None = None
    max_canvas_tokens: int | None = None

    def asked(self) -> dict[str, Any]:
        """The settings this request sets, as the engine takes them (its `settings` object)."""
        return {name: value for name, value in asdict(self).items() if value is not None}


@dataclass(frozen=True)
class CompletionRequest:
    """One model call for a completion: the text either side of the gap, its settings, and its place: the document
    (the engine lets a newer request of the same document supersede it), whether it is work computed ahead
    (`background`: run only when no real request waits, dropped when one comes), and the workspace's LoRA adapter
    that answers it (a folder; the router sets it, `workspaces.RoutedBackend`)."""

    prefix: str
    suffix: str
    settings: Settings = Settings()
    document: str | None = None
    background: bool = False
    adapter: str | None = None


@dataclass(frozen=True)
class FillRequest:
    """Several holes in one canvas: the text and holes in document order (`engine.regions`' parts), as the engine
    takes them; JSON only where it crosses to another process (`EngineClient`)."""

    parts: tuple[str | Hole, ...]
    settings: Settings = Settings()
    document: str | None = None
    adapter: str | None = None


@dataclass(frozen=True)
class Gap:
    """One gap of a fill, as the engine wrote it."""

    text: str
    ended: bool  # the model closed it (EOS); False: it filled its token budget without closing it
    token_texts: tuple[str, ...] = ()  # the tokens that wrote it, and their confidences
    confidence: tuple[float, ...] = ()
    healed: str = ""  # the text before the gap its first token re-writes (token healing); not in `text`

    @classmethod
    def of(cls, gap: GapResult) -> Gap:
        """A gap of the engine's result."""
        return cls(gap.text, gap.stop_reason == "eos", tuple(gap.token_texts), tuple(gap.confidence), gap.healed)


@dataclass(frozen=True)
class Answer:
    """What the model wrote for a request. The server decides what to show from the tokens (`engine.confidence.judge`
    scores the part it shows, against the whole document, as `bench calibrate` measured): the engine's own `score`
    of the whole answer is for its HTTP and command-line callers, and stays in `details`. A server that gives no
    per-token confidences (OpenAI-compatible ones) leaves `score_kind` None: its answers are shown as they are."""

    text: str
    token_texts: tuple[str, ...] = ()
    confidence: tuple[float, ...] = ()
    healed: str = ""  # the prefix text the first token re-writes (token healing); not in `text`
    score_kind: str | None = None
    min_confidence: float = 0.0  # the threshold calibrated for this model and kind of request (0: show everything)
    gaps: tuple[Gap, ...] = ()  # per gap of a fill, in document order
    steps: int = 0
    engine_ms: float | None = None  # the engine's own encode + denoise time; None where the server does not say
    # The backend's whole answer: canvas-ls's engine's `InfillResult`, or another server's JSON
    raw: InfillResult | Mapping[str, Any] | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, result: InfillResult) -> Answer:
        """An answer of canvas-ls's engine (in this process, or decoded from `/v1/infill` and `/v1/fill`)."""
        return cls(
            text=result.text,
            token_texts=tuple(result.token_texts),
            confidence=tuple(result.confidence),
            healed=result.healed,
            score_kind=result.score_kind,
            min_confidence=result.min_confidence,
            gaps=tuple(Gap.of(gap) for gap in result.gaps),
            steps=result.steps,
            engine_ms=result.encode_ms + result.denoise_ms,
            raw=result,
        )

    @property
    def details(self) -> Mapping[str, Any] | None:
        """The backend's whole answer as JSON (`canvas/fill`'s "result"), made when asked for."""
        return self.raw.to_dict() if isinstance(self.raw, InfillResult) else self.raw

    def cached(self) -> Answer:
        """What a completion cache keeps of it (the tokens the display decision reads, not the engine's report)."""
        return Answer(self.text, self.token_texts, self.confidence, self.healed, self.score_kind, self.min_confidence)


@dataclass(frozen=True)
class Cancelled:
    """The request's cancel flag won (a newer keystroke, the editor gave up, the engine dropped background work)."""


@dataclass(frozen=True)
class Failed:
    """No answer, and why, in words for the user. `loading`: the model is loading (or failed to load), which is not
    an error of this request; `why`: which of the closed list's reasons (`silence.py`)."""

    reason: str
    loading: bool = False
    why: Why = Why.ENGINE_FAILED


Reply = Answer | Cancelled | Failed


@dataclass(frozen=True)
class Identity:
    """Which model answers a request, as it was loaded: the backend kind, the model (a resolved folder or a hub id)
    with its files' fingerprint when it loaded, the device, dtype and quantisation, and the LoRA adapter (its
    folder and fingerprint). Taken once per load, never per request: the completion cache's key holds it, so a
    model switch, a reload of changed files or a workspace model re-keys every answer."""

    backend: str
    model: str
    fingerprint: str = ""
    device: str = ""
    dtype: str = ""
    quantize: str = ""
    adapter: str = ""

    @classmethod
    def of_engine(cls, backend: str, identity: Mapping[str, Any]) -> Identity:
        """From the engine's own identity (`Engine.identity`, /health's "identity")."""
        return cls(backend, *(str(identity.get(name, "")) for name in
                              ("model", "fingerprint", "device", "dtype", "quantize", "adapter")))  # fmt: skip

    def __str__(self) -> str:
        return "|".join((self.backend, self.model, self.fingerprint, self.device, self.dtype, self.quantize,
                         self.adapter))  # fmt: skip


def engine_mismatch(health: Mapping[str, Any], model: str | None, adapter: str | None) -> str | None:
    """Why a resident engine's /health is not the engine this server asked for (None: it is): another installation
    or version of canvas-ls started it, or it runs another model or adapter."""
    from ..engine.paths import installation, resolved_model

    theirs = health.get("identity")
    if not isinstance(theirs, dict):
        return "it was started by an older canvas-ls that does not say which installation it belongs to"
    for name, ours in installation().items():
        if theirs.get(name) != ours:
            return f"it belongs to another canvas-ls ({name} {theirs.get(name)!r}, this server's {ours!r})"
    if theirs.get("model") != resolved_model(model):
        return f"it runs model {theirs.get('model')!r}, not {resolved_model(model)!r}"
    if adapter and not str(theirs.get("adapter", "")).startswith(f"{Path(adapter).expanduser().resolve()}@"):
        return f"it runs adapter {theirs.get('adapter') or 'none'!r}, not {adapter!r}"
    return None


class Backend(Protocol):
    """What the server asks of where the model runs. `infill` and `fill` end in one `Reply` and raise nothing: an
    engine that refused the request, failed or went away is a `Failed` with the reason."""

    state: str  # "idle", "loading", "ready" or "failed"
    error: str | None
    model_name: str | None
    load_seconds: float | None
    cancelled_after_steps: list[int]
    steps: int | None  # denoising steps taken by an engine in this process (None: another's; its /health)
    adapters: bool  # whether a request may name a LoRA adapter of the model (`adapter`: its folder)
    whole_models: bool  # whether a workspace's own tuned model can get a backend of this kind (a team deployment
    # runs its one model, with the workspaces' adapters)
    identity: Identity | None  # which model answers, set when it has loaded (None before, and after a failure)

    def load(self, model: str | None, device: str, on_done: Callable[[Any], None] | None = None) -> None: ...

    async def infill(self, request: CompletionRequest, cancel: CancelFlag) -> Reply: ...

    async def fill(self, request: FillRequest, cancel: CancelFlag) -> Reply: ...

    def shutdown(self) -> None: ...


def _not_ready(state: str, error: str | None, why: Why = Why.LOAD_FAILED) -> Failed | None:
    if state == "ready":
        return None
    if state != "failed":
        return Failed("the model is still loading", True, Why.LOADING)
    return Failed(f"the model failed to load: {error}", True, why)


class LocalBackend:
    adapters = True
    whole_models = True

    @property
    def steps(self) -> int | None:
        return self._engine.steps if self._engine is not None else 0

    def __init__(self, adapter: str | None = None, compile: str = "auto", quantize: str = "auto") -> None:
        self.adapter = adapter  # a LoRA adapter folder applied to whatever model `load` is given
        self.compile = compile  # the compiled step (warmed up in the background after the load)
        self.quantize = quantize  # the layers' weights (engine.quantize)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="canvas-engine")
        self._engine: Any = None
        self.state = "idle"  # idle -> loading -> ready | failed
        self.error: str | None = None
        self.model_name: str | None = None
        self.load_seconds: float | None = None
        self.cancelled_after_steps: list[int] = []  # per cancelled request, the denoising steps it had run
        self.restarts = 0  # reloads after the engine failed in a way it has no answer for
        self.identity: Identity | None = None
        self._loaded_with: tuple[str | None, str] = (None, "auto")

    def load(self, model: str | None, device: str, on_done: Callable[[LocalBackend], None] | None = None) -> None:
        """Start loading (in the worker); `on_done` runs in the worker thread when it ends, well or not."""
        self.state, self.error, self._engine, self.identity = "loading", None, None, None
        self._loaded_with = (model, device)

        def work() -> None:
            started = time.perf_counter()
            try:
                from ..engine import Engine

                self._engine = Engine.load(model, None if device == "auto" else device, adapter=self.adapter,
                                           compile=self.compile, quantize=self.quantize)  # fmt: skip
                self._engine.warm_up()  # in the background when compiling; requests run eager meanwhile
                self.model_name = self._engine.name
                self.identity = Identity.of_engine("local", self._engine.identity)
                self.state = "ready"
            except Exception as exc:  # a load failure is reported, never raised into the server
                self.error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                self.state = "failed"
                log.error("model load failed: %s", self.error)
            self.load_seconds = time.perf_counter() - started
            if on_done is not None:
                on_done(self)

        self._executor.submit(work)

    async def infill(self, request: CompletionRequest, cancel: CancelFlag) -> Reply:
        """A `background` request is work computed ahead: the server cancels it when a real request comes (one
        worker here)."""
        from ..engine.paths import document_repository

        workspace = document_repository(request.document)  # its token cache (`engine.token_cache`), once built
        return await self._call(cancel, lambda engine: engine.infill(
            request.prefix, request.suffix, request.settings.asked(), cancel=cancel, adapter=request.adapter,
            workspace=workspace, score=False))  # fmt: skip

    async def fill(self, request: FillRequest, cancel: CancelFlag) -> Reply:
        """Several holes in one canvas; Failed for a fill the engine cannot lay out."""
        from ..engine.paths import document_repository
        from ..engine.regions import split_parts

        def compute(engine: Any) -> Any:
            prefix, middle, suffix = split_parts(list(request.parts))
            return engine.fill(prefix, middle, suffix, request.settings.asked(), cancel=cancel,
                               adapter=request.adapter, workspace=document_repository(request.document),
                               score=False)  # fmt: skip

        return await self._call(cancel, compute)

    async def _call(self, cancel: CancelFlag, compute: Callable[[Any], Any]) -> Reply:
        """`compute(engine)` on the worker thread, as a Reply."""
        not_ready = _not_ready(self.state, self.error)
        if not_ready is not None:
            return not_ready
        from ..engine import FillError, InfillCancelled, ModelLoadError

        engine = self._engine

        def work() -> Reply:
            if cancel.is_set():
                return Cancelled()
            try:
                return Answer.of(compute(engine))
            except (FillError, ModelLoadError) as exc:  # a fill it cannot lay out, an adapter it cannot load
                return Failed(str(exc))
            except InfillCancelled as stopped:
                self.cancelled_after_steps = [*self.cancelled_after_steps[-99:], stopped.steps]
                return Cancelled()
            except Exception as exc:  # the engine broke (a bug, a device error): reload it, say so
                log.exception("the engine failed; reloading it")
                self.restarts += 1
                self.load(*self._loaded_with)  # queued behind this call on the worker; requests wait meanwhile
                return Failed(f"the engine failed ({type(exc).__name__}: {exc}); it is reloading")

        future = asyncio.get_running_loop().run_in_executor(self._executor, work)
        try:
            return await future
        except asyncio.CancelledError:
            cancel.set()  # the editor gave up: stop denoising at the next step
            raise

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class EngineClient:
    """canvas-ls's own engine API over HTTP, whoever runs it: the whole canvas (the suffix clamped in place, holes
    and rewrites through /v1/fill, per-token confidences, cancellation between denoising steps). `load` connects
    (`_connect`, the subclass's) off the event loop; every answer must carry this canvas-ls's API version
    (`x-canvas-api`), so a server never reads a result shaped by another version."""

    adapters = True
    whole_models = True
    kind = ""
    # Whether requests name the configured adapter (`engine.adapter`): a team deployment holds it beside its model
    # for this user (sent once, `RemoteBackend._adapter_name`); a resident engine merged it when it started.
    names_adapter = False

    def __init__(self, client: httpx.AsyncClient, adapter: str | None = None) -> None:
        self.adapter = adapter
        self.state = "idle"
        self.error: str | None = None
        # why the last load failed: the engine is not the one asked for (ENGINE_MISMATCH), a remote one does not
        # answer (UNREACHABLE), or it could not start (LOAD_FAILED)
        self.why = Why.LOAD_FAILED
        self.model_name: str | None = None
        self.load_seconds: float | None = None
        self.cancelled_after_steps: list[int] = []
        self.steps: int | None = None  # the engine's process counts them (/health)
        self.restarts = 0
        self.identity: Identity | None = None
        self._model: str | None = None
        self._device = "auto"
        self._starter = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"canvas-{self.kind}-connect")
        self._client = client

    # -- lifecycle ---------------------------------------------------------------------------------------------

    def load(self, model: str | None, device: str, on_done: Callable[[Any], None] | None = None) -> None:
        self._model, self._device = model, device
        self.state, self.error, self.identity, self.why = "loading", None, None, Why.LOAD_FAILED

        def work() -> None:
            started = time.perf_counter()
            try:
                health = self._connect()
                self.identity = Identity.of_engine(self.kind, health["identity"])
                self.model_name, self.state = health["model"], "ready"
            except Exception as exc:  # reported to the user, never raised into the server
                self.error, self.state = str(exc).splitlines()[0] or type(exc).__name__, "failed"
                log.error("%s engine: %s", self.kind, self.error)
            self.load_seconds = time.perf_counter() - started
            if on_done is not None:
                on_done(self)

        self._starter.submit(work)

    def _connect(self) -> dict[str, Any]:
        """The engine's /health once it answers and is the one asked for; raises with the reason otherwise."""
        raise NotImplementedError

    def _not_ready(self) -> Failed | None:
        return _not_ready(self.state, self.error, self.why)

    def _unreachable(self, exc: httpx.HTTPError, what: str) -> Failed:
        raise NotImplementedError

    # -- requests ----------------------------------------------------------------------------------------------

    async def infill(self, request: CompletionRequest, cancel: CancelFlag) -> Reply:
        body = {"prefix": request.prefix, "suffix": request.suffix,
                **({"priority": "background"} if request.background else {})}  # fmt: skip
        return await self._post("/v1/infill", body, request.settings, request.document, request.adapter, cancel,
                                "completion")  # fmt: skip

    async def fill(self, request: FillRequest, cancel: CancelFlag) -> Reply:
        """Several holes in one canvas through `/v1/fill`; Failed with the engine's reason when it refuses the fill
        or fails."""
        from ..engine.regions import parts_to_json

        body = {"segments": parts_to_json(list(request.parts))}
        return await self._post("/v1/fill", body, request.settings, request.document, request.adapter, cancel, "fill")

    async def _post(self, path: str, body: dict[str, Any], settings: Settings, document: str | None,
                    adapter: str | None, cancel: CancelFlag, what: str) -> Reply:  # fmt: skip
        """Cancelled when `cancel` won (or the engine says the request was cancelled); Failed with the engine's
        reason when it refused the request, and when it went away (`_unreachable`)."""
        not_ready = self._not_ready()
        if not_ready is not None:
            return not_ready
        # "score": false: the server scores what it shows itself (`display.decide`), the engine need not
        body = {**body, "document": document, "settings": settings.asked(), "score": False}
        if adapter is None and self.names_adapter:  # the configured one, where the engine does not merge it
            adapter = self.adapter
        for attempt in range(2):  # a deployment that lost an uploaded adapter (restarted) gets it again, once
            if adapter is not None:
                named = await self._adapter_name(adapter, again=attempt > 0)
                if isinstance(named, Failed):
                    return named
                body["adapter"] = named
            try:
                response = await post_cancellable(self._client, path, body, cancel)
            except httpx.HTTPError as exc:
                return self._unreachable(exc, what)
            if adapter is None or response is None or not _asks_upload(response):
                break
        if response is None or response.status_code == CANCELLED_STATUS:
            return Cancelled()
        theirs = response.headers.get(API_HEADER)
        if theirs != str(API_VERSION):  # an engine replaced under us by another version: never read its answer
            self.load(self._model, self._device)  # its /health says what it is, the status shows it
            return Failed(f"the engine answered in API version {theirs or 'unknown'}, this canvas-ls speaks "
                          f"{API_VERSION}; its answer was not read", True, Why.ENGINE_MISMATCH)  # fmt: skip
        if response.status_code != 200:
            return Failed(_error_text(response))
        try:
            return Answer.of(InfillResult.from_dict(response.json()))
        except (ValueError, TypeError) as exc:  # the same API version: a bug of ours
            return Failed(f"the engine answered something that is not a result ({exc})")

    async def _adapter_name(self, folder: str, again: bool = False) -> str | Failed:
        """What the engine knows the adapter `folder` by: the folder itself (a local engine reads this machine's
        files); a team deployment, its upload (`RemoteBackend`)."""
        return folder

    def shutdown(self) -> None:
        self._starter.shutdown(wait=False, cancel_futures=True)


class ResidentBackend(EngineClient):
    """The model in `canvas-ls engine`, one process per user, shared by every editor: reached over its unix
    socket, started (under a lock file) when none answers, restarted when it dies. Same methods as LocalBackend.
    """

    kind = "resident"

    def __init__(self, socket: str | None = None, idle_exit_s: float = IDLE_EXIT_S, model: str | None = None,
                 device: str = "auto", adapter: str | None = None, compile: str = "auto",
                 quantize: str = "auto"):  # fmt: skip
        from ..engine.paths import default_socket

        self.compile = compile  # the engine's --compile when this backend starts it
        self.quantize = quantize  # and its --quantize
        self.socket = Path(socket) if socket else default_socket(model, device, adapter, quantize)
        self.lock_file = self.socket.with_suffix(".lock")  # one starter at a time per engine
        self.log_file = self.socket.with_suffix(".log")
        self.idle_exit_s = idle_exit_s
        client = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(self.socket)),
                                   base_url="http://canvas-ls", timeout=None)  # fmt: skip
        super().__init__(client, adapter)

    def _connect(self) -> dict[str, Any]:
        health = self._ensure_engine()
        why = engine_mismatch(health, self._model, self.adapter)
        if why is not None:
            self.why = Why.ENGINE_MISMATCH
            raise RuntimeError(f"the engine at {self.socket} is not this server's: {why}; stop that engine "
                               "(it exits when idle) or set engine.socket to another path")  # fmt: skip
        return health

    def _unreachable(self, exc: httpx.HTTPError, what: str) -> Failed:
        """The engine died (or was killed): start a new one, say what happened."""
        log.warning("resident engine unreachable (%s); restarting it", exc)
        self.restarts += 1
        self.load(self._model, self._device)
        return Failed(f"the engine went away during the {what} ({exc}); it is restarting")

    def _health(self) -> dict[str, Any] | None:
        return engine_health(self.socket)

    def _ensure_engine(self, timeout_s: float = 300.0) -> dict[str, Any]:
        """Connect to the running engine, or start one; one starter at a time per user (flock)."""
        health = self._health()
        if health is not None:
            return health
        self.socket.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with open(self.lock_file, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another editor may be starting it right now: wait for it
            health = self._health()
            if health is not None:
                return health
            retire_older_engines(self.socket)  # their memory (a GPU's) is what this one is about to load into
            command = [sys.executable, "-m", "canvas_ls.server.cli", "engine", "--socket", str(self.socket),
                       "--idle-exit", str(self.idle_exit_s)]  # fmt: skip
            if self._model:
                command += ["--model", self._model]
            if self._device and self._device != "auto":
                command += ["--device", self._device]
            if self.adapter:
                command += ["--adapter", self.adapter]
            if self.compile != "auto":
                command += ["--compile", self.compile]
            if self.quantize != "auto":
                command += ["--quantize", self.quantize]
            with open(self.log_file, "ab") as sink:
                logged = sink.tell()  # where this start's output begins in the log
                process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=sink, stderr=sink,
                                           start_new_session=True)  # fmt: skip
            log.info("started the resident engine (pid %d): %s", process.pid, " ".join(command))
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                health = self._health()
                if health is not None:
                    return health
                if process.poll() is not None:
                    raise RuntimeError(f"the engine exited with status {process.returncode}: "
                                       f"{self._last_words(logged)} (log: {self.log_file})")  # fmt: skip
                time.sleep(0.1)
            raise RuntimeError(f"the engine did not answer within {timeout_s:.0f} s")

    def _last_words(self, since: int) -> str:
        """The last line the engine wrote to its log after offset `since` (its error, when it failed to start)."""
        try:
            with open(self.log_file, "rb") as sink:
                sink.seek(since)
                lines = [line.strip() for line in sink.read().decode(errors="replace").splitlines() if line.strip()]
        except OSError:
            return "no output"
        return lines[-1] if lines else "no output"


class RemoteBackend(EngineClient):
    """A team deployment (`canvas-ls team serve`) or a `canvas-ls engine --tcp` elsewhere: the whole canvas API at
    `url` with a bearer token. Nothing is started here. A deployment that does not answer, or refuses the token,
    fails requests at once with the reason (timeouts bounded: `CONNECT_TIMEOUT_S`) and is asked again every
    `RECHECK_S`, so completions resume when it is back; one of another API version gets no request."""

    kind = "remote"
    names_adapter = True
    whole_models = False  # the deployment runs its own model; a workspace's adapter of it is sent there

    def __init__(self, url: str, token: str | None, adapter: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.checked = -float("inf")  # when /health was last asked
        client = httpx.AsyncClient(base_url=self.url, headers=self.headers,
                                   timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=CONNECT_TIMEOUT_S))  # fmt: skip
        super().__init__(client, adapter)
        self._packed: dict[str, tuple[tuple[Any, ...], str]] = {}  # adapter folder -> (its files' stamp, its name)
        self._uploaded: set[str] = set()  # the adapters' names this deployment has been sent

    def _connect(self) -> dict[str, Any]:
        self.checked, self.why = time.monotonic(), Why.UNREACHABLE
        try:
            with httpx.Client(base_url=self.url, headers=self.headers, timeout=CONNECT_TIMEOUT_S) as client:
                response = client.get("/health")
        except httpx.HTTPError as exc:
            raise RuntimeError(f"the team engine at {self.url} is unreachable ({exc or type(exc).__name__}); "
                               f"asked again every {RECHECK_S:g} s") from None  # fmt: skip
        if response.status_code == 401:
            self.why = Why.LOAD_FAILED
            raise RuntimeError(f"the team engine at {self.url} refused the token: set engine.api_key or "
                               "$CANVAS_LS_TOKEN to one from `canvas-ls team token add`")  # fmt: skip
        try:
            health = response.json()
        except ValueError:
            health = None
        health = health if isinstance(health, dict) else {}
        if response.status_code != 200:
            reason = health.get("error") or f"it answered {response.status_code}"
            raise RuntimeError(f"the team engine at {self.url} is not ready: {reason}")
        if health.get("api") != API_VERSION:
            self.why = Why.ENGINE_MISMATCH
            raise RuntimeError(f"the team engine at {self.url} speaks API version {health.get('api', 'unknown')} "
                               f"(canvas-ls {health.get('identity', {}).get('version', 'unknown')}), this "
                               f"canvas-ls {API_VERSION}: upgrade the one that is older")  # fmt: skip
        return health

    def _not_ready(self) -> Failed | None:
        if self.state != "failed":
            return _not_ready(self.state, self.error)
        failed = Failed(self.error or "the team engine failed", True, self.why)
        if time.monotonic() - self.checked > RECHECK_S:
            self.load(self._model, self._device)  # asked again in the background; this request fails at once
        return failed

    async def _adapter_name(self, folder: str, again: bool = False) -> str | Failed:
        """An adapter is sent to the deployment (`PUT /v1/adapters/{sha256}`: the replicas cannot read this
        machine's files) once per content, and again when the deployment says it lacks it (`again`: restarted, or
        the upload pushed out by newer ones); requests name it by its digest. Packed again when its files change."""
        from ..engine.adapter_files import ADAPTER_PREFIX, name_of, pack

        source = Path(folder)
        try:
            stamp = tuple((f.name, (st := f.stat()).st_size, st.st_mtime_ns) for f in sorted(source.iterdir()))
            known = self._packed.get(folder)
            if known is not None and known[0] == stamp and known[1] in self._uploaded and not again:
                return known[1]
            data = await asyncio.to_thread(pack, source)
            name = name_of(data)
            self._packed[folder] = (stamp, name)
            if name not in self._uploaded or again:
                response = await self._client.put(f"/v1/adapters/{name.removeprefix(ADAPTER_PREFIX)}", content=data)
                if response.status_code != 201:
                    return Failed(f"the team engine refused the workspace adapter {folder}: {_error_text(response)}")
                self._uploaded.add(name)
        except OSError as exc:
            return Failed(f"the workspace adapter {folder} cannot be read: {exc}")
        except httpx.HTTPError as exc:
            return self._unreachable(exc, "adapter upload")
        return name

    def _unreachable(self, exc: httpx.HTTPError, what: str) -> Failed:
        log.warning("team engine at %s unreachable during a %s: %s", self.url, what, exc)
        self.error = f"the team engine at {self.url} is unreachable ({exc or type(exc).__name__})"
        self.state, self.checked, self.why = "failed", time.monotonic(), Why.UNREACHABLE
        return Failed(self.error, True, Why.UNREACHABLE)


def retire_older_engines(keep: Path) -> list[int]:
    """Stop the resident engines of this installation at another version, beside `keep`'s socket: an upgrade in
    place leaves the old version's engine holding its model in memory (a GPU's too) for up to its 30 idle minutes,
    and no server of the new version will ask it anything. SIGTERM: uvicorn lets their requests in flight end first.
    Engines of this version (another model's) and of other installations are left alone. Their pids."""
    from ..engine.paths import installation

    ours, stopped = installation(), []
    for socket in keep.parent.glob("engine-*.sock"):
        health = engine_health(socket, timeout=1.0) if socket != keep else None
        theirs = (health or {}).get("identity")
        if not isinstance(theirs, dict) or theirs.get("installation") != ours["installation"]:
            continue
        pid = (health or {}).get("pid")
        if theirs.get("version") != ours["version"] and isinstance(pid, int):
            try:
                os.kill(pid, signal.SIGTERM)
            except OSError as exc:  # gone meanwhile, or not ours to stop
                log.warning("could not stop the canvas-ls %s engine (pid %d): %s", theirs.get("version"), pid, exc)
                continue
            log.info("stopped the resident engine of canvas-ls %s (pid %d): this is %s", theirs.get("version"), pid,
                     ours["version"])  # fmt: skip
            stopped.append(pid)
    return stopped


def _asks_upload(response: httpx.Response) -> bool:
    """A team gateway's answer that it does not hold the adapter a request named (404 with where to upload it)."""
    if response.status_code != 404:
        return False
    try:
        return "upload" in response.json()
    except ValueError:
        return False


def _error_text(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"])
    except (ValueError, KeyError, TypeError):
        return f"the engine answered {response.status_code}: {response.text[:200]}"


async def post_cancellable(client: httpx.AsyncClient, path: str, body: dict[str, Any],
                           cancel: CancelFlag) -> httpx.Response | None:  # fmt: skip
    """POST, racing the response against `cancel`: None when the cancel wins. Dropping the connection is how the
    server learns it: our engine stops denoising at its next step."""
    request = asyncio.ensure_future(client.post(path, json=body))
    stop = asyncio.ensure_future(cancel.until_set())
    try:
        done, _ = await asyncio.wait({request, stop}, return_when=asyncio.FIRST_COMPLETED)
        if request not in done:
            request.cancel()
            return None
        return request.result()
    except asyncio.CancelledError:
        request.cancel()
        raise
    finally:
        stop.cancel()


def completion_request(request: CompletionRequest, model: str | None, suffix_mode: str,
                       template: str) -> dict[str, Any]:  # fmt: skip
    """An OpenAI `/v1/completions` body. Servers that take `suffix` get it as a field; for the others (vLLM and
    SGLang have not accepted it) the suffix goes into the prompt through the model's FIM template ("prompt")."""
    body: dict[str, Any] = {"max_tokens": request.settings.max_new_tokens or 64, "temperature": 0, "stream": False}
    if model:
        body["model"] = model
    if suffix_mode == "field":
        body.update(prompt=request.prefix, suffix=request.suffix)
    else:
        body["prompt"] = template.format(prefix=request.prefix, suffix=request.suffix)
    return body


class OpenAIBackend:
    """Any OpenAI-compatible completions server (our own engine over TCP, vLLM, SGLang...). Same methods."""

    adapters = False  # a workspace's adapter runs there only if that server loads it itself
    whole_models = False

    def __init__(self, url: str, api_key: str | None, model: str | None, suffix_mode: str, template: str):
        self.url = url.rstrip("/")
        self.model, self.suffix_mode, self.template = model, suffix_mode, template
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=None)
        self.state, self.error = "idle", None
        self.model_name: str | None = model or self.url
        self.load_seconds: float | None = 0.0
        self.cancelled_after_steps: list[int] = []
        self.steps: int | None = None  # no canvas here
        self.restarts = 0
        self.identity: Identity | None = Identity("openai", f"{self.url}|{model or ''}")

    def load(self, model: str | None, device: str, on_done: Callable[[Any], None] | None = None) -> None:
        self.state = "ready"  # nothing to load here; a server that does not answer shows in the requests' logs
        if on_done is not None:
            on_done(self)

    async def infill(self, request: CompletionRequest, cancel: CancelFlag) -> Reply:
        body = completion_request(request, self.model, self.suffix_mode, self.template)
        try:
            response = await post_cancellable(self._client, "/v1/completions", body, cancel)
        except httpx.HTTPError as exc:
            return Failed(f"{self.url} is unreachable: {exc}")
        if response is None:
            return Cancelled()
        if response.status_code != 200:
            return Failed(f"{self.url} answered {response.status_code}: {response.text[:200]}")
        try:
            data = response.json()
            text = data["choices"][0].get("text") or ""
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            return Failed(f"{self.url} answered something that is no completion: {response.text[:200]}")
        if not isinstance(text, str):
            return Failed(f"{self.url} answered a completion whose text is not a string: {text!r:.200}")
        return Answer(text, raw=data)

    async def fill(self, request: FillRequest, cancel: CancelFlag) -> Reply:
        return Failed("filling several holes needs canvas-ls's own engine (engine.backend local or resident)")

    def shutdown(self) -> None:
        pass


def engine_health(socket: Path, timeout: float = 2.0) -> dict[str, Any] | None:
    """The resident engine's /health at `socket`, or None where none answers."""
    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(socket)), timeout=timeout) as client:
            response = client.get("http://canvas-ls/health")
            return response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
