"""One request, one identity: which model answers a request is resolved once (`RoutedBackend.resolve`), from memory;
the completion cache's key holds it, so a model switch is answered by the new model at a position the old one
answered; an answer computed by a model that no longer answers is dropped; a server never takes answers from an
engine of another installation, version or model."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import pytest_lsp
from lsprotocol import types
from pytest_lsp import LanguageClient

from canvas_ls.engine import workspaces
from canvas_ls.engine.paths import default_socket, installation
from canvas_ls.server.backend import (
    Answer,
    CancelFlag,
    CompletionRequest,
    Identity,
    Reply,
    ResidentBackend,
    Settings,
    engine_health,
)
from canvas_ls.server.completion import Completer
from canvas_ls.server.config import ServerConfig
from canvas_ls.server.context import build_context
from canvas_ls.server.documents import Document
from canvas_ls.server.workspaces import RoutedBackend
from tests.conftest import SERVER
from tests.test_lsp import fill, open_doc, request
from tests.test_workspaces import fake_run

DOC = "def size(x):\n    return \n"
AFTER_RETURN = types.Position(line=1, character=11)


class Slow:
    """A backend whose answer waits for `release` (a request that is denoising), then answers `reply`."""

    adapters = False
    whole_models = True
    state, error, model_name, load_seconds = "ready", None, "slow", 0.0

    def __init__(self, reply: Reply, identity: Identity) -> None:
        self.reply, self.identity, self.calls = reply, identity, 0
        self.started, self.release = asyncio.Event(), asyncio.Event()
        self.cancelled_after_steps: list[int] = []

    def load(self, model: str | None, device: str, on_done: Any = None) -> None: ...

    async def infill(self, request: CompletionRequest, cancel: CancelFlag) -> Reply:
        self.calls += 1
        self.started.set()
        await self.release.wait()
        return self.reply

    async def fill(self, *args: Any, **kwargs: Any) -> Reply:
        return self.reply

    def shutdown(self) -> None: ...


def completer(backend: Slow, base: str | None = None) -> tuple[Completer, Document]:
    config = ServerConfig()
    config.completion.speculate = False
    routed = RoutedBackend(backend, lambda *_: backend, base, True)
    return Completer(routed, config), Document.open("file:///size.py", DOC, 1, "python")


async def test_an_answer_of_a_model_that_no_longer_answers_is_dropped_not_cached() -> None:
    """The configuration changes while a request is denoising: its answer is neither shown nor cached, and the
    next request is answered by the new model."""
    backend = Slow(Answer("len(x)"), Identity("local", "/models/old", "f1"))
    complete, document = completer(backend)
    running = asyncio.ensure_future(complete.complete(document, 1, 11))
    await backend.started.wait()
    backend.identity = Identity("local", "/models/new", "f2")  # the user switched models meanwhile
    backend.release.set()
    outcome = await running
    assert (outcome.label, outcome.edit, len(complete.cache)) == ("stale:the model changed while it answered", None, 0)
    backend.reply = Answer("x.size")
    again = await complete.complete(document, 1, 11)
    assert (again.source, again.edit.text if again.edit else None, backend.calls) == ("model", "x.size", 2)
    backend.identity = Identity("local", "/models/new", "f3")  # its files changed and it reloaded: a new identity
    backend.reply = Answer("x.shape")
    third = await complete.complete(document, 1, 11)
    assert (third.source, third.edit.text if third.edit else None, backend.calls) == ("model", "x.shape", 3)


async def test_the_cache_key_reads_memory_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Computing a request's route and cache key with the file system and the clock patched to raise: no error,
    and a workspace model installed for the document's repository is part of the key."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # its workspace model is this test's alone
    repo = tmp_path / "repo"
    base = str(tmp_path / "base")
    workspaces.install(repo, fake_run(tmp_path / "run"), base, {}, {"name": "full"})
    backend = Slow(Answer("len(x)"), Identity("local", base, "f1"))
    complete, _ = completer(backend, base)
    complete.backend.refresh()
    uri = (repo / "size.py").as_uri()
    complete.backend.watch(uri)
    document = Document.open(uri, DOC, 1, "python")
    context = build_context(document, document.index.offset(1, 11), complete.config.completion)

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the file system or the clock was read")

    reads = ((os, "stat"), (os, "lstat"), (os, "scandir"), (os, "listdir"), (os.path, "exists"),
             (os.path, "realpath"), (time, "time"), (time, "monotonic"), (time, "perf_counter"))  # fmt: skip
    for module, name in reads:
        monkeypatch.setattr(module, name, forbidden)
    route = complete.backend.resolve(uri)
    key = complete._key(document, context, {}, route.identity)
    outside = complete.backend.resolve("file:///elsewhere/size.py")
    monkeypatch.undo()
    assert route.entry is not None and route.entry.root == repo and route.pending
    assert key == complete._key(document, context, {}, outside.identity)  # its model not loaded yet: the base's
    assert key != complete._key(document, context, {}, Identity("local", base, "f2"))


def other_installation_engine(model: Path, socket: Path, installation: str = "/opt/other-venv/canvas_ls",
                              version: str = "0.0.9") -> subprocess.Popen[bytes]:  # fmt: skip
    """A real `canvas-ls engine` that says it belongs to another installation of canvas-ls (another virtualenv), or
    to another version of this one."""
    script = (
        "import sys, functools; from canvas_ls.engine import paths; "
        f"paths.installation = functools.cache(lambda: {{'installation': {installation!r}, 'version': {version!r}}}); "
        "from canvas_ls.server.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    command = [sys.executable, "-c", script, "engine", "--model", str(model), "--device", "cpu", "--socket",
               str(socket)]  # fmt: skip
    return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def loaded(backend: Any, model: str | None = None, device: str = "auto") -> None:
    """`backend.load(model, device)`, awaited until it has loaded or failed."""
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    backend.load(model, device, lambda _: loop.call_soon_threadsafe(done.set))
    await done.wait()


def health_when_up(process: subprocess.Popen[bytes], socket: Path, timeout: float = 120) -> dict[str, Any]:
    """The engine's /health once it answers (it must not exit meanwhile)."""
    deadline = time.monotonic() + timeout
    while (health := engine_health(socket)) is None:
        assert process.poll() is None and time.monotonic() < deadline, "the other engine did not start"
        time.sleep(0.2)
    return health


async def test_a_server_never_takes_answers_from_another_installations_engine(
    fixed_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another installation's engine listens on the socket this server would use for the same model: the server
    refuses it with why (and sends it no request) instead of answering with its code and model."""
    # this test's own folder, no other test's engine there; short: a unix socket's path has at most 107 bytes
    monkeypatch.setenv("XDG_RUNTIME_DIR", tempfile.mkdtemp(prefix="cls-"))
    socket = default_socket(str(fixed_model_dir), "cpu")
    process = other_installation_engine(fixed_model_dir, socket)
    try:
        health = health_when_up(process, socket)
        assert health["identity"]["installation"] == "/opt/other-venv/canvas_ls"
        backend = ResidentBackend(None, model=str(fixed_model_dir), device="cpu")
        await loaded(backend, str(fixed_model_dir), "cpu")
        assert (backend.state, backend.identity) == ("failed", None)
        ours = installation()["installation"]
        assert backend.error == (
            f"the engine at {socket} is not this server's: it belongs to another canvas-ls (installation "
            f"'/opt/other-venv/canvas_ls', this server's '{ours}'); stop that engine (it exits when idle) or set "
            "engine.socket to another path"
        )
        reply = await backend.infill(CompletionRequest("def f():\n    return ", "\n"), CancelFlag())
        assert reply.reason.startswith("the model failed to load: the engine at ")  # type: ignore[union-attr]
        metrics = engine_health(socket)
        assert metrics is not None and metrics["queue"] == 0
    finally:
        process.kill()
        process.wait()


async def test_an_engine_left_by_an_older_version_is_stopped_when_this_one_starts(
    fixed_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An upgrade in place: the old version's engine (this installation, version 0.0.9) still holds the model on its
    own socket. The first server of the new version to start its engine stops the old one (it would otherwise hold
    its memory, a GPU's, for 30 idle minutes); an engine of another installation beside it is left alone."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", tempfile.mkdtemp(prefix="cls-"))
    ours = installation()["installation"]
    folder = default_socket(str(fixed_model_dir), "cpu").parent
    old = other_installation_engine(fixed_model_dir, folder / "engine-old.sock", installation=ours)
    other = other_installation_engine(fixed_model_dir, folder / "engine-other.sock")
    try:
        health_when_up(old, folder / "engine-old.sock")
        health_when_up(other, folder / "engine-other.sock")
        backend = ResidentBackend(None, model=str(fixed_model_dir), device="cpu")
        await loaded(backend, str(fixed_model_dir), "cpu")
        assert (backend.state, backend.error) == ("ready", None)
        # the old version exited on SIGTERM (uvicorn ends its requests in flight, then re-raises the signal)
        assert (old.wait(timeout=30), other.poll()) == (-signal.SIGTERM, None)
        reply = await backend.infill(
            CompletionRequest("def f():\n    return ", "\n", Settings(max_new_tokens=4)), CancelFlag()
        )
        assert isinstance(reply, Answer)
    finally:
        for process in (old, other):
            process.kill()
            process.wait()
        socket = default_socket(str(fixed_model_dir), "cpu")
        if (health := engine_health(socket)) is not None:
            os.kill(health["pid"], 9)


@pytest_lsp.fixture(config=SERVER)
async def client(lsp_client: LanguageClient):
    yield


async def wait_model(client: LanguageClient, model: Path, timeout: float = 120) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        engine = (await request(client, "canvas/stats", {}))["engine"]
        if engine["state"] in ("ready", "failed") and engine["model"] == str(model):
            assert engine["state"] == "ready", engine
            return
        assert asyncio.get_running_loop().time() < deadline, engine
        await asyncio.sleep(0.1)


async def test_a_model_switch_is_answered_by_the_new_model_where_the_old_one_answered(
    client: LanguageClient, fixed_model_dir: Path, ending_model_dir: Path
) -> None:
    """Through a real `canvas-ls serve` (the resident engine): the fixed model answers "Nonecodecodecode" after
    `return `; the user switches to the model that answers one word and ends ("None"); the same position, asked
    again once it is ready, is answered by the new model on the first request, not from the cache."""
    init = {
        "engine": {"model": str(fixed_model_dir), "device": "cpu"},
        "completion": {"speculate": False, "max_new_tokens_single_line": 4},
    }
    capabilities = pytest_lsp.client_capabilities("neovim")
    await client.initialize_session(types.InitializeParams(capabilities=capabilities, initialization_options=init))
    await wait_model(client, fixed_model_dir)
    open_doc(client, "size.py", DOC)
    before = await fill(client, "size.py", AFTER_RETURN)
    assert (before["source"], before["edit"]["text"]) == ("model", "Nonecodecodecode")
    again = await fill(client, "size.py", AFTER_RETURN)
    assert (again["source"], again["edit"]["text"]) == ("cache", "Nonecodecodecode")
    settings = {"canvas-ls": {"engine": {"model": str(ending_model_dir)}}}
    client.workspace_did_change_configuration(types.DidChangeConfigurationParams(settings=settings))
    await wait_model(client, ending_model_dir)
    after = await fill(client, "size.py", AFTER_RETURN)
    assert (after["source"], after["edit"]["text"]) == ("model", "None")
    assert (after["result"]["model"], after["result"]["score"]) == (str(ending_model_dir), None)  # the server scores
