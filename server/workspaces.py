"""Workspace models in the server: each document answered by the model tuned on its repository, and the "Learn
this workspace" command that tunes one in the background.

`RoutedBackend` is the `Backend` the completer and the fills talk to. It holds the configured model's backend
(whose state is the server's state) and, lazily, one per workspace model (`engine.workspaces`): a request for a
document under a repository that has a model tuned from the configured one goes to that model once it has loaded;
until then, or when it fails to load (said once), the configured model answers. Nothing waits on a workspace model.

`Learner` runs `canvas-ls train --workspace DIR` as a child process at the lowest CPU priority (SCHED_IDLE: it
gets a core only when nothing else wants one, so the engine's steps keep both cores while it trains), reads its
progress lines, and reports them as work-done progress; the new model is used as soon as it is installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..engine.paths import die_with_parent, file_path, resolved_model
from ..engine.workspaces import WorkspaceIndex, WorkspaceModel
from .backend import Backend, CancelFlag, CompletionRequest, FillRequest, Identity, Reply

log = logging.getLogger(__name__)


def uri_path(uri: str | None, resolve: bool = True) -> Path | None:
    """The file a `file:` URI names, or None for other schemes: resolved (symbolic links followed), or only
    normalised as written (no file system read)."""
    path = file_path(uri) if uri else None
    if path is None:
        return None
    return Path(path).resolve() if resolve else Path(os.path.normpath(path))


@dataclass(frozen=True)
class Route:
    """Where one request goes, resolved once (`RoutedBackend.resolve`): which model answers (`identity`, None while
    it loads), the backend that runs it and the adapter it answers with; `entry`: the workspace model of the
    document, if any, and `pending` when that model's own backend has yet to be started."""

    identity: Identity | None
    backend: Backend
    adapter: str | None
    entry: WorkspaceModel | None = None
    pending: bool = False


class RoutedBackend:
    """The configured model's backend for most documents; a workspace's own model for documents of that workspace.
    Same methods as every `Backend`; its state, errors and counters are the configured model's."""

    def __init__(self, default: Backend, make: Callable[[str | None, str | None], Backend], base: str | None,
                 enabled: bool = True, notify: Callable[[str], None] | None = None, learner: Learner | None = None,
                 paths: dict[str, Path | None] | None = None) -> None:  # fmt: skip
        self.default = default
        self.make = make  # (model, adapter) -> a new backend of the same kind as the default
        self.base = base
        resolved_model(base)  # resolved now, not on a request
        self.enabled = enabled
        self.notify = notify or log.info
        self.learner = learner  # "Learn this workspace" runs, held while a model answers
        self.index = WorkspaceIndex()
        self.workspace_backends: dict[tuple[str | None, str | None], Backend] = {}
        self._device = "auto"
        # uri -> resolved path, filled when a document opens (`watch`); the server's, kept across its routers
        self.paths: dict[str, Path | None] = {} if paths is None else paths
        self._announced: set[Path] = set()  # workspaces whose adapter the configured engine answers with, told

    # -- the configured model's state is the server's ---------------------------------------------------------

    @property
    def state(self) -> str:
        return self.default.state

    @property
    def error(self) -> str | None:
        return self.default.error

    @property
    def model_name(self) -> str | None:
        return self.default.model_name

    @property
    def load_seconds(self) -> float | None:
        return self.default.load_seconds

    @property
    def cancelled_after_steps(self) -> list[int]:
        return self.default.cancelled_after_steps

    @property
    def steps(self) -> int | None:
        return self.default.steps

    @property
    def restarts(self) -> int:
        return getattr(self.default, "restarts", 0)

    def load(self, model: str | None, device: str, on_done: Callable[[Any], None] | None = None) -> None:
        self._device = device
        self.default.load(model, device, on_done)

    def retarget(self, base: str | None, enabled: bool) -> None:
        """The default backend now runs `base` (reloaded in place): the workspace models of the old base go."""
        self.base, self.enabled = base, enabled
        resolved_model(base)
        for backend in self.workspace_backends.values():
            backend.shutdown()
        self.workspace_backends.clear()

    # -- requests ----------------------------------------------------------------------------------------------

    def watch(self, document: str) -> None:
        """A document opened: its path resolved now (symbolic links followed: workspace roots are resolved), so that
        `resolve` never touches the file system."""
        if len(self.paths) > 4096:
            self.paths.clear()
        self.paths[document] = uri_path(document)

    def refresh(self) -> None:
        """Re-read the installed workspace models (the server calls it on a timer and after a training run)."""
        self.index.refresh()

    def resolve(self, document: str | None) -> Route:
        """Which backend, adapter and model identity answer this document's request now: read from memory only (no
        file system, no clock, nothing started), once per request; the completion cache's key holds its identity.
        A workspace's LoRA adapter of the configured model goes to the configured model's own engine, which holds
        it beside the others (one copy of the base, whatever the number of workspaces); a workspace's tuned model
        answers from a backend of its own once that has loaded (`pending` until then: the configured model
        answers, and the request that calls the model starts loading it); else the configured one."""
        default = self.default
        entry = self._entry(document)
        if entry is None:
            return Route(default.identity, default, None)
        if self._shared(entry):
            adapter = entry.runs_as[1]
            identity = None if default.identity is None else replace(default.identity, adapter=adapter or "")
            return Route(identity, default, adapter, entry=entry)
        if not default.whole_models:  # a tuned model a team deployment cannot run: its model answers (told once)
            return Route(default.identity, default, None, entry=entry)
        own = self.workspace_backends.get(entry.runs_as)
        if own is not None and own.state == "ready":
            return Route(own.identity, own, None)
        return Route(default.identity, default, None, entry=entry, pending=own is None)

    def _start(self, route: Route) -> None:
        """What a model call on `route` starts first: a workspace model's own backend (loaded in the background), or
        the notice that its documents answer with their workspace's adapter."""
        entry = route.entry
        if entry is None:
            return
        if route.adapter is not None or not self.default.whole_models:
            if entry.root not in self._announced:
                self._announced.add(entry.root)
                self.notify(
                    f"documents under {entry.root} answer with the adapter tuned on it"
                    if route.adapter
                    else f"the model tuned on {entry.root} is a whole model, which the team deployment cannot run "
                    "(it holds LoRA adapters of its model): its documents answer with the deployment's model"
                )
            return
        key = entry.runs_as
        if route.pending and key not in self.workspace_backends:
            backend = self.workspace_backends[key] = self.make(*key)
            self.notify(f"loading the model tuned on {entry.root}")
            loop = asyncio.get_running_loop()  # the load ends on a worker thread: report it on the server's loop
            backend.load(key[0], self._device, lambda done: loop.call_soon_threadsafe(self._loaded, entry, done))

    def _entry(self, document: str | None) -> WorkspaceModel | None:
        """The workspace model of this document's repository, if any (from memory: the index as last refreshed, the
        path resolved when the document opened, else the URI's path as written)."""
        if not self.enabled or document is None:
            return None
        path = self.paths[document] if document in self.paths else uri_path(document, resolve=False)
        return self.index.for_path(path, self.base) if path is not None else None

    def _shared(self, entry: WorkspaceModel) -> bool:
        """Whether the workspace's model is an adapter the configured model's engine answers with."""
        return self.default.adapters and entry.shares_base

    def _loaded(self, entry: WorkspaceModel, backend: Backend) -> None:
        if backend.state == "ready":
            self.notify(f"documents under {entry.root} now use the model tuned on it ({backend.model_name})")
        else:
            self.notify(f"the model tuned on {entry.root} failed to load ({backend.error}); the configured model "
                        "answers there")  # fmt: skip

    async def infill(self, request: CompletionRequest, cancel: CancelFlag, route: Route | None = None) -> Reply:
        """The model's answer on `route` (resolved for the request's document here when not given), with the
        route's adapter."""
        route = route or self.resolve(request.document)
        self._start(route)
        with self._learning_held():
            return await route.backend.infill(replace(request, adapter=route.adapter), cancel)

    async def fill(self, request: FillRequest, cancel: CancelFlag, route: Route | None = None) -> Reply:
        route = route or self.resolve(request.document)
        self._start(route)
        with self._learning_held():
            return await route.backend.fill(replace(request, adapter=route.adapter), cancel)

    @contextlib.contextmanager
    def _learning_held(self) -> Iterator[None]:
        """Workspace training stopped while the model answers (and a second after), so that it never slows it."""
        if self.learner is not None:
            self.learner.hold()
        try:
            yield
        finally:
            if self.learner is not None:
                self.learner.release()

    def shutdown(self) -> None:
        self.default.shutdown()
        for backend in self.workspace_backends.values():
            backend.shutdown()


def _interrupted_with_parent() -> None:
    """In the training child: SIGINT when the server dies (an editor closed without a clean shutdown), as when it
    shuts down cleanly: the run stops, installs what it learnt, and the next "Learn" resumes it (Linux only). SIGINT
    back to its default first: a server started in a shell's background ignores it, and a Python started ignoring it
    keeps ignoring it (no KeyboardInterrupt), so the run would sleep through every interrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    die_with_parent(signal.SIGINT)


@dataclass
class LearnJob:
    root: Path
    process: asyncio.subprocess.Process | None = None  # None until the child has started
    held: bool = False  # stopped (SIGSTOP) while completions run
    interrupted: bool = False  # asked to stop (it may not have started yet)
    lines: list[str] = field(default_factory=list)  # the child's stderr tail, for the error message

    def send(self, signum: int) -> bool:
        """Signal the child if it runs; whether it did."""
        if self.process is None or self.process.returncode is not None:
            return False
        self.process.send_signal(signum)
        return True


@dataclass(frozen=True)
class Learned:
    """A finished "Learn this workspace" run: its summary (`train --progress json`'s final "done" record)."""

    summary: dict[str, Any]


@dataclass(frozen=True)
class LearnFailed:
    reason: str


class Learner:
    """`canvas-ls train --workspace` for the editor's "Learn this workspace": one run per repository at a time
    (`reserve` claims the repository at once, before anything is awaited), at the lowest CPU priority, stopped
    while the model answers, its progress lines handed to a `report` callback."""

    def __init__(self, resume_after_s: float = 1.0) -> None:
        self.jobs: dict[Path, LearnJob] = {}
        self.resume_after_s = resume_after_s
        self._resume: asyncio.TimerHandle | None = None

    def reserve(self, root: Path) -> LearnJob | None:
        """The new run's job, or None when that repository is being learnt already."""
        if root in self.jobs:
            return None
        job = self.jobs[root] = LearnJob(root)
        return job

    def hold(self) -> None:
        """A model call starts: stop every run (SIGSTOP) until `release` has let `resume_after_s` pass without
        one. SCHED_IDLE alone still doubled completion latency (p50 136 -> 280 ms beside a run; measured): a
        training step's cache and memory traffic slows the engine's threads even when it only runs in their gaps."""
        if self._resume is not None:
            self._resume.cancel()
            self._resume = None
        for job in self.jobs.values():
            if not job.held and job.send(signal.SIGSTOP):
                job.held = True

    def release(self) -> None:
        if any(job.held for job in self.jobs.values()):
            if self._resume is not None:
                self._resume.cancel()
            self._resume = asyncio.get_running_loop().call_later(self.resume_after_s, self._continue)

    def _continue(self) -> None:
        self._resume = None
        for job in self.jobs.values():
            if job.held:
                job.send(signal.SIGCONT)
                job.held = False

    def command(self, root: Path, base: str | None, minutes: float | None) -> list[str]:
        command = [sys.executable, "-m", "canvas_ls.server.cli", "train", "--workspace", str(root),
                   "--progress", "json", "--low-priority"]  # fmt: skip
        if base:
            command += ["--from", base]
        if minutes is not None:
            command += ["--minutes", f"{minutes:g}"]
        return command

    async def learn(self, job: LearnJob, base: str | None, minutes: float | None,
                    report: Callable[[dict[str, Any]], None]) -> Learned | LearnFailed:  # fmt: skip
        """Run a `reserve`d job to the end: the run's summary, or why it failed."""
        try:
            job.process = process = await asyncio.create_subprocess_exec(
                *self.command(job.root, base, minutes), stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, preexec_fn=_interrupted_with_parent,
            )  # fmt: skip
            if job.interrupted:  # cancelled while it started
                self.interrupt(job.root)
            stderr = asyncio.ensure_future(self._tail(process.stderr, job.lines))
            final: dict[str, Any] = {}
            assert process.stdout is not None
            async for raw in process.stdout:
                try:
                    record = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(record, dict):
                    if "done" in record or "error" in record:
                        final = record
                    report(record)
            status = await process.wait()
            await stderr
            if isinstance(final.get("done"), dict):
                return Learned(final["done"])
            if "error" in final:
                return LearnFailed(str(final["error"]))
            tail = " ".join(job.lines[-3:]) or "no output"
            return LearnFailed(f"training exited with status {status}: {tail}")
        finally:
            del self.jobs[job.root]

    @staticmethod
    async def _tail(stream: asyncio.StreamReader | None, lines: list[str]) -> None:
        if stream is None:
            return
        async for raw in stream:
            line = raw.decode(errors="replace").strip()
            if line:
                lines.append(line)
                del lines[:-20]

    def interrupt(self, root: Path) -> None:
        """Stop a run as Ctrl-C does: it evaluates, saves and installs what it learnt so far."""
        job = self.jobs.get(root)
        if job is None:
            return
        job.interrupted = True
        if job.send(signal.SIGINT) and job.held:  # a stopped process handles its SIGINT once it runs again
            job.send(signal.SIGCONT)
            job.held = False

    def interrupt_all(self) -> None:
        for root in list(self.jobs):
            self.interrupt(root)
