"""Supervision: an engine that fails in a way it has no answer for is reloaded, the failing request gets an error
that says so (shown once by the server), and the next request is answered. The resident engine's process killed
mid-request is tested in test_resident.py (test_kill_9_mid_request_answers_empty_then_recovers)."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest

from canvas_ls.server.backend import Answer, CancelFlag, CompletionRequest, Failed, LocalBackend, Settings
from canvas_ls.server.silence import Why
from tests.test_wire import captured

PREFIX, SUFFIX = "def add(a, b):\n    return ", "\n"
QUICK = CompletionRequest(PREFIX, SUFFIX, Settings(max_new_tokens=4, max_steps=2))


async def loaded(backend: LocalBackend, model: Path) -> None:
    done = threading.Event()
    backend.load(str(model), "cpu", lambda _: done.set())
    await asyncio.to_thread(done.wait, 120)
    assert backend.state == "ready", backend.error


async def test_a_broken_local_engine_is_reloaded_and_the_next_request_answered(tiny_model_dir: Path) -> None:
    backend = LocalBackend(compile="off")
    await loaded(backend, tiny_model_dir)
    broken = backend._engine

    def dies(*args: object, **kwargs: object) -> None:
        raise RuntimeError("device lost")

    broken.infill = dies  # the engine breaks mid-request
    failed = await backend.infill(QUICK, CancelFlag())
    assert failed == Failed("the engine failed (RuntimeError: device lost); it is reloading")
    assert backend.restarts == 1
    for _ in range(600):  # requests meanwhile are told the model is loading, not failed
        reply = await backend.infill(QUICK, CancelFlag())
        if not isinstance(reply, Failed):
            break
        assert reply == Failed("the model is still loading", loading=True, why=Why.LOADING)
        await asyncio.sleep(0.05)
    assert backend._engine is not broken and isinstance(reply, Answer) and reply.steps >= 1
    backend.shutdown()


def test_a_handler_bug_is_logged_and_shown_once_and_a_client_mistake_is_not_shown(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from pygls.exceptions import FeatureRequestError, JsonRpcInvalidParams

    from canvas_ls.server.lsp import server

    try:
        with captured(server.protocol) as written:
            for _ in range(3):
                server.report_server_error(KeyError("uri"), FeatureRequestError)
            server.report_server_error(JsonRpcInvalidParams("want a position"), FeatureRequestError)
    finally:
        server.shown_errors.clear()
    shown = [w for w in written if b"window/showMessage" in w]
    assert len(shown) == 1 and b"internal error (KeyError: 'uri'); the server goes on" in shown[0]
    assert sum("KeyError" in r.getMessage() and r.exc_info is not None for r in caplog.records) == 3


def test_a_failed_model_call_is_logged_each_time_and_shown_once() -> None:
    from canvas_ls.server.lsp import server

    try:
        with captured(server.protocol) as written:
            for _ in range(3):
                server.show_error_once("http://127.0.0.1:9 is unreachable")
            server.show_error_once("the engine went away")
    finally:
        server.shown_errors.clear()
    logged = [w for w in written if b"window/logMessage" in w]
    shown = [w for w in written if b"window/showMessage" in w]
    assert len(logged) == 4
    assert [json.loads(w.partition(b"\r\n\r\n")[2])["params"]["message"] for w in shown] == [
        "canvas-ls: completion failed: http://127.0.0.1:9 is unreachable",
        "canvas-ls: completion failed: the engine went away",
    ]
