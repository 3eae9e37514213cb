"""The server object: its state (documents, configuration, backend, completer, learner), the stdio loop that hands
every frame to `wire.Dispatcher`, configuration changes, the model's loading (work-done progress), and what the user
is told (log and messages, each error shown once). The handlers are `lsp.py`'s."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from lsprotocol import types
from pygls.exceptions import JsonRpcException, JsonRpcInternalError
from pygls.io_ import StdoutWriter
from pygls.lsp.server import LanguageServer

from .acceptance import Recorder
from .backend import Backend, LocalBackend, OpenAIBackend, RemoteBackend, ResidentBackend
from .completion import Completer
from .config import EngineOptions, ServerConfig, parse_config
from .documents import DocumentStore
from .nextedit import NextEdits
from .personal import Thresholds
from .wire import Dispatcher, Frames
from .workspaces import Learner, RoutedBackend

log = logging.getLogger(__name__)
VERSION = "0.1.0"
WORKSPACES_REFRESH_S = 2.0


def make_backend(config: ServerConfig, learner: Learner | None = None, notify: Callable[[str], None] | None = None,
                 paths: dict[str, Path | None] | None = None) -> RoutedBackend:  # fmt: skip
    """The configured backend, behind the router that sends a workspace's documents to its own model (and holds
    `learner`'s runs while a model answers; `notify` tells the user when a workspace model is in use)."""
    options = config.engine
    if options.backend == "openai":
        key = options.api_key or os.environ.get("CANVAS_LS_API_KEY")
        remote = OpenAIBackend(options.url or "http://127.0.0.1:8000", key, options.remote_model, options.suffix_mode,
                               options.fim_template)  # fmt: skip
        return RoutedBackend(remote, lambda model, adapter: remote, options.model, False, notify, learner, paths)
    if options.backend == "remote":  # the deployment's model answers, with a workspace's adapter sent to it
        token = options.api_key or os.environ.get("CANVAS_LS_TOKEN")
        team = RemoteBackend(options.url or "http://127.0.0.1:8000", token, options.adapter)
        # `engine.model` names the deployment's model as the workspace adapters name their base (train's --from)
        enabled = options.workspace_models and not options.adapter
        return RoutedBackend(team, lambda model, adapter: team, options.model, enabled, notify, learner, paths)

    def make(model: str | None, adapter: str | None, socket: str | None = None) -> Backend:
        if options.backend == "resident":
            return ResidentBackend(socket, options.idle_exit_s, model, options.device, adapter, options.compile,
                                   options.quantize)  # fmt: skip
        return LocalBackend(adapter, options.compile, options.quantize)

    default = make(options.model, options.adapter, options.socket)
    # a workspace model applies to the configured model as it is, not to one with an adapter of the user's own
    enabled = options.workspace_models and not options.adapter
    return RoutedBackend(default, make, options.model, enabled, notify, learner, paths)


class CanvasServer(LanguageServer):
    def __init__(self) -> None:
        super().__init__("canvas-ls", VERSION)
        self.documents = DocumentStore()
        self.config = ServerConfig()
        self.learner = Learner()
        self.paths: dict[str, Path | None] = {}  # each open document's resolved path, for every router of this server
        self.backend = make_backend(self.config, self.learner, self.log_to_client, self.paths)
        self.completer = Completer(self.backend, self.config, self.documents)
        self.acceptance = Recorder(notify=lambda message: self.window_show_message(
            types.ShowMessageParams(type=types.MessageType.Warning, message=message)))  # fmt: skip
        # the display threshold learned from the user's accepts and dismissals, kept beside the statistics
        self.thresholds = Thresholds(self.acceptance.database)
        self.acceptance.on_settled = lambda shown: self.thresholds.settled(shown.language, shown.model,
                                                                           shown.calibrated)  # fmt: skip
        self.completer.thresholds = self.thresholds
        self.next_edits = NextEdits()
        self.pending_messages: list[str] = []
        self.initialization_options: Any = None  # what the editor started the server with; settings go over it
        self.loop: asyncio.AbstractEventLoop | None = None
        self.workspace_refresh: asyncio.Task[None] | None = None  # `refresh_workspaces`, from `initialized` on
        self.load_report: asyncio.Task[None] | None = None  # the last load's progress and outcome (held: a task
        # nothing references may be collected mid-way)
        self.shown_errors: set[str] = set()  # errors already shown to the user (each is shown once)
        self.dispatcher = Dispatcher(self.protocol)
        self.initialized = False  # `initialize` handled: later options that cannot be read keep the current ones

    def start_io(self, stdin: BinaryIO | None = None, stdout: BinaryIO | None = None) -> None:
        """Serve on stdio: frames read by `wire.Frames`, each message through `wire.Dispatcher` (not pygls's loop,
        which stops on a message it cannot type and answers nothing for a request it cannot read)."""
        self._stop_event = threading.Event()
        self.protocol.set_writer(StdoutWriter(stdout or sys.stdout.buffer))
        try:
            asyncio.run(self.serve_frames(stdin or sys.stdin.buffer, self._stop_event))
        except BrokenPipeError:
            log.error("the client went away; shutting down")
        except (KeyboardInterrupt, SystemExit):
            pass
        finally:
            self.shutdown()

    async def serve_frames(self, stdin: BinaryIO, stop: threading.Event) -> None:
        """Read stdin in chunks (off the loop) until it closes; every frame to the dispatcher."""
        loop = asyncio.get_running_loop()
        read = getattr(stdin, "read1", stdin.read)
        frames = Frames()
        while not stop.is_set():
            chunk = await loop.run_in_executor(self.thread_pool, read, 1 << 16)
            if not chunk:
                return  # the client closed stdin
            for item in frames.feed(chunk):
                self.dispatcher.receive(item)

    def report_server_error(self, error: Exception, source: Any) -> None:
        """An exception in a handler (pygls has answered a request with -32603 already): its traceback to the log,
        and the user told once per kind of error. A client's mistake (invalid params, a cancelled request) is only in
        its answer."""
        if isinstance(error, JsonRpcException) and not isinstance(error, JsonRpcInternalError):
            return  # the client's mistake (invalid params, a cancelled request): its answer says so
        log.error("%s, %s: %s", getattr(source, "__name__", source), type(error).__name__, error, exc_info=error)
        key = f"{type(error).__name__}: {error}"
        if key not in self.shown_errors and len(self.shown_errors) < 100:
            self.shown_errors.add(key)
            message = f"canvas-ls: internal error ({key}); the server goes on, details in its log"
            self.window_show_message(types.ShowMessageParams(type=types.MessageType.Error, message=message))

    def log_to_client(self, message: str, kind: types.MessageType = types.MessageType.Info) -> None:
        log.info(message)
        self.window_log_message(types.LogMessageParams(type=kind, message=f"canvas-ls: {message}"))

    def show_error_once(self, error: str) -> None:
        """A failed model call: logged always, shown to the user the first time this error is seen."""
        self.log_to_client(f"completion failed: {error}", types.MessageType.Error)
        if error not in self.shown_errors and len(self.shown_errors) < 100:
            self.shown_errors.add(error)
            message = f"canvas-ls: completion failed: {error}"
            self.window_show_message(types.ShowMessageParams(type=types.MessageType.Error, message=message))

    def apply_config(self, options: Any) -> None:
        config, error = parse_config(options, self.config if self.initialized else None)
        if error is not None:
            self.pending_messages.append(error)
        reload = config.engine != self.config.engine or self.backend.state == "idle"
        # A local backend reloads in place (model or device); any other change gets a new backend object.
        changed = config.engine != self.config.engine
        in_place = {config.engine.backend, self.config.engine.backend} == {"local"}
        if changed and not (in_place and config.engine.adapter == self.config.engine.adapter):
            self.backend.shutdown()
            self.backend = make_backend(config, self.learner, self.log_to_client, self.paths)
            self.completer.backend = self.backend
        elif changed:  # the same local backend, another model: its workspace models are another base's
            self.backend.retarget(config.engine.model, config.engine.workspace_models)
        self.config = config
        self.completer.config = config
        self.acceptance.enabled = config.statistics
        self.thresholds.enabled = config.completion.personal_threshold and config.statistics
        self.thresholds.target = config.completion.acceptance_target
        if changed:
            self.completer.reset()  # answers of the old model go (their keys name it, too)
        if reload and self.loop is not None:
            self.load_model()

    async def refresh_workspaces(self, every_s: float = WORKSPACES_REFRESH_S) -> None:
        """Re-read the installed workspace models every `every_s` (on the loop: a folder listing), so that a request
        reads them from memory and a model trained meanwhile takes effect without a restart."""
        while True:
            await asyncio.sleep(every_s)
            self.backend.refresh()

    async def begin_progress(self, token: str, title: str, message: str, cancellable: bool = False,
                             percentage: int | None = None) -> bool:  # fmt: skip
        """Server-initiated work-done progress, when the client supports it; False when it does not (or refused)."""
        if not (self.client_capabilities.window and self.client_capabilities.window.work_done_progress):
            return False
        try:
            await self.work_done_progress.create_async(token)
            begin = types.WorkDoneProgressBegin(title=title, message=message, cancellable=cancellable,
                                                percentage=percentage)  # fmt: skip
            self.work_done_progress.begin(token, begin)
            return True
        except Exception as exc:  # a client that refuses progress still gets its completions
            log.warning("no work-done progress: %s", exc)
            return False

    def load_model(self) -> asyncio.Task[None]:
        """Load (or reload) the model in the worker: started here, so that from this call on the backend's state says
        "loading" to any request (never "idle" while a load waits its turn); reported as work-done progress, when the
        client supports it, by the task returned."""
        assert self.loop is not None
        token = f"canvas-ls/load/{id(self)}/{self.backend.state}"
        done: asyncio.Future[None] = self.loop.create_future()
        options, backend, loop = self.config.engine, self.backend, self.loop
        self.log_to_client(f"loading model {options.model or '(default)'} on {options.device}")
        backend.load(options.model, options.device, lambda _: loop.call_soon_threadsafe(done.set_result, None))
        self.load_report = self.loop.create_task(self._report_load(token, options, backend, done))
        return self.load_report

    async def _report_load(self, token: str, options: EngineOptions, backend: RoutedBackend,
                           done: asyncio.Future[None]) -> None:  # fmt: skip
        progress = await self.begin_progress(token, "canvas-ls", "loading the model")
        await done
        if backend is not self.backend or backend.state == "loading":  # a newer configuration's load reports
            message = f"model {options.model or '(default)'} replaced by a newer configuration"
            self.log_to_client(message)
        elif backend.state == "ready":
            message = f"model {backend.model_name} ready in {backend.load_seconds:.1f} s"
            self.log_to_client(message)
        else:
            message = f"model failed to load: {backend.error}"
            self.log_to_client(message, types.MessageType.Error)
            self.window_show_message(types.ShowMessageParams(type=types.MessageType.Error, message=message))
        if progress:
            self.work_done_progress.end(token, types.WorkDoneProgressEnd(message=message))
