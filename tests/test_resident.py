"""The resident engine: a real `canvas-ls engine` process on a unix socket or TCP, and LSP servers sharing it."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket as sockets
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from lsprotocol import types
from pygls.lsp.client import LanguageClient

from canvas_ls.bench.soak import rss_mb
from canvas_ls.engine import Engine
from tests.conftest import NOTHING_LOADED, fuzz, refused_before_loading
from tests.test_adapters import PROMPTS

ENGINE = [sys.executable, "-m", "canvas_ls.server.cli", "engine"]
BODY = {"prefix": "def add(a, b):\n    return ", "suffix": "\n", "settings": {"max_new_tokens": 8, "max_steps": 3}}


def wait_health(client: httpx.Client, timeout: float = 120) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            response = client.get("/health")
            if response.status_code == 200:
                return response.json()
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError("the engine did not come up")


@pytest.fixture(scope="module")
def unix_engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    """One engine for the module's HTTP tests (each starting its own cost ~6 s apiece); tests read deltas."""
    path = tmp_path_factory.mktemp("resident") / "run" / "engine.sock"
    log = path.parent.parent / "engine.log"
    with log.open("wb") as sink:
        command = [*ENGINE, "--model", str(tiny_model_dir), "--socket", str(path), "--max-body", "20000",
                   "--log-level", "DEBUG"]  # fmt: skip
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stderr=sink)
    client = httpx.Client(transport=httpx.HTTPTransport(uds=str(path)), base_url="http://engine", timeout=60)
    wait_health(client)
    client.socket_path = path  # type: ignore[attr-defined]
    client.log_path = log  # type: ignore[attr-defined]
    yield client
    process.kill()
    process.wait()


def test_each_request_is_logged_at_debug(unix_engine: httpx.Client) -> None:
    """At --log-level DEBUG the engine's log has a line per request: what it encoded, reused and stepped."""
    result = unix_engine.post("/v1/infill", json=BODY).json()
    said = (f"DEBUG canvas_ls.engine.service infill: {result['prefix_tokens']} prefix tokens "
            f"({result['prefix_reused_tokens']} reused) encoded in {result['encode_ms']:.1f} ms, {result['steps']} "
            f"steps in {result['denoise_ms']:.1f} ms")  # fmt: skip
    assert said in unix_engine.log_path.read_text()  # type: ignore[attr-defined]


def test_socket_is_private(unix_engine: httpx.Client) -> None:
    mode = stat.S_IMODE(os.stat(unix_engine.socket_path).st_mode)  # type: ignore[attr-defined]
    assert mode == 0o600


def test_infill_returns_the_whole_result(unix_engine: httpx.Client, tiny_engine: Engine) -> None:
    """Over HTTP the engine answers what the library answers in this process for the same request (same model,
    dtype and seed): its tokens, text, steps and layout."""
    result = unix_engine.post("/v1/infill", json=BODY).json()
    here = tiny_engine.infill(BODY["prefix"], BODY["suffix"], BODY["settings"]).to_dict()
    for key in ("tokens", "text", "steps", "forward_passes", "stop_reason", "layout", "prefix_tokens", "dtype"):
        assert result[key] == here[key], key


# /v1/completions's fields as the engine's settings (`EngineService.completions`): max_tokens, temperature, seed.
COMPLETION = {"prompt": BODY["prefix"], "suffix": "\n", "max_tokens": 6, "temperature": 0.5, "seed": 3}
AS_SETTINGS = {"max_new_tokens": 6, "t_min": 0.25, "t_max": 0.5, "seed": 3}


def test_completions_are_openai_shaped(unix_engine: httpx.Client, tiny_engine: Engine) -> None:
    """The OpenAI-shaped answer carries what the library answers for the same request (same model and seed)."""
    response = unix_engine.post("/v1/completions", json=COMPLETION).json()
    here = tiny_engine.infill(BODY["prefix"], "\n", AS_SETTINGS)
    choice = response["choices"][0]
    assert (response["object"], choice["text"], choice["finish_reason"], response["usage"]["completion_tokens"]) == (
        "text_completion", here.text, "stop" if here.stop_reason == "eos" else "length", len(here.tokens)
    )  # fmt: skip


def test_streaming_sends_drafts_then_done(unix_engine: httpx.Client, tiny_engine: Engine) -> None:
    with unix_engine.stream("POST", "/v1/completions", json={**COMPLETION, "stream": True}) as response:
        events = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    here = tiny_engine.infill(BODY["prefix"], "\n", AS_SETTINGS)
    assert [c["choices"][0].get("draft") for c in chunks] == [True] * here.steps + [None]  # a draft per step
    final = chunks[-1]["choices"][0]
    assert (final["text"], final["finish_reason"]) == (here.text, "stop" if here.stop_reason == "eos" else "length")


def test_malformed_json_is_400_and_the_engine_stays_up(unix_engine: httpx.Client) -> None:
    response = unix_engine.post("/v1/infill", content=b"{not json")
    assert response.status_code == 400 and "malformed JSON" in response.json()["error"]
    assert unix_engine.post("/v1/infill", json={"prefix": 3}).status_code == 400
    assert unix_engine.get("/health").status_code == 200


def test_a_body_over_the_limit_is_413(unix_engine: httpx.Client) -> None:
    response = unix_engine.post("/v1/infill", json={"prefix": "x" * 30000, "suffix": ""})
    assert response.status_code == 413
    assert unix_engine.get("/health").status_code == 200


ENDPOINT_KEYS = {
    "/v1/infill": ["prefix", "suffix", "settings", "document", "priority", "adapter"],
    "/v1/fill": ["segments", "settings", "document", "adapter"],
    "/v1/completions": ["prompt", "suffix", "max_tokens", "temperature", "seed", "stream", "document"],
}
ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
QUICK = {"max_new_tokens": 4, "max_steps": 2}


@st.composite
def engine_requests(draw: st.DrawFn) -> tuple[str, bytes, dict[str, str]]:
    """A POST to one of the endpoints: an object of its own keys holding anything (settings kept quick when they
    are an object), or any JSON, or bytes that are no JSON; with any content type."""
    path = draw(st.sampled_from(sorted(ENDPOINT_KEYS)))
    kind = draw(st.integers(0, 5))
    if kind == 0:
        body = draw(st.binary(max_size=40))
    elif kind == 1:
        body = json.dumps(draw(ANY_JSON)).encode()
    else:
        keys = ENDPOINT_KEYS[path]
        value = draw(st.dictionaries(st.sampled_from(keys), ANY_JSON | st.sampled_from(["x = ", "", "file:///a.py"])))
        settings = value.get("settings")
        if settings is None or isinstance(settings, dict):
            value["settings"] = {**(settings or {}), **QUICK}
        if path == "/v1/completions":
            value["max_tokens"] = 4 if not isinstance(value.get("max_tokens"), int) else value["max_tokens"] % 6
        body = json.dumps(value).encode()
    content_type = draw(st.sampled_from(["application/json", "text/plain", "", "application/x-www-form-urlencoded"]))
    return path, body, ({"content-type": content_type} if content_type else {})


@fuzz(100)
@given(engine_requests())
def test_any_request_body_gets_an_answer_with_a_json_reason(
    unix_engine: httpx.Client, sent: tuple[str, bytes, Any]
) -> None:
    path, body, headers = sent
    response = unix_engine.post(path, content=body, headers=headers)
    if response.status_code == 200:
        if "text/event-stream" not in response.headers.get("content-type", ""):
            assert isinstance(response.json(), dict)
    else:
        assert 400 <= response.status_code < 500, (response.status_code, response.text, body)
        reason = response.json()
        # nothing cancels these one-at-a-time requests: every refusal says why
        assert isinstance(reason.get("error"), str) and response.status_code != 499, reason
    assert unix_engine.get("/health").json()["status"] == "ok"


@pytest.mark.parametrize(
    ("method", "path", "status", "words"),
    [("GET", "/v1/infill", 405, "GET /v1/infill: Method Not Allowed"), ("POST", "/nowhere", 404, "Not Found"),
     ("DELETE", "/health", 405, "Method Not Allowed")],
)  # fmt: skip
def test_a_wrong_route_or_method_is_a_json_error(unix_engine: httpx.Client, method: str, path: str, status: int,
                                                 words: str) -> None:  # fmt: skip
    response = unix_engine.request(method, path)
    assert response.status_code == status and words in response.json()["error"]


def test_a_bad_temperature_is_400_not_500(unix_engine: httpx.Client) -> None:
    response = unix_engine.post("/v1/completions", json={"prompt": "x = ", "temperature": "hot", "max_tokens": 2})
    assert response.status_code == 400 and response.json() == {"error": "'temperature' must be a number from 0"}


def test_the_engines_own_score_is_given_unless_the_caller_scores_itself(unix_engine: httpx.Client) -> None:
    """The language server asks for no score (it scores what it shows itself, `display.decide`): the engine then
    leaves it out instead of searching the document for copies a second time; a flag that is no boolean is a 400."""
    body = {"prefix": "def f(x):\n    return ", "suffix": "\n", "settings": {"max_new_tokens": 2, "seed": 0}}
    scored = unix_engine.post("/v1/infill", json=body).json()
    assert isinstance(scored["score"], float) and isinstance(scored["gaps"][0]["score"], float)
    unscored = unix_engine.post("/v1/infill", json={**body, "score": False}).json()
    assert (unscored["score"], unscored["gaps"][0]["score"], unscored["text"]) == (None, None, scored["text"])
    refused = unix_engine.post("/v1/infill", json={**body, "score": "no"})
    assert refused.status_code == 400 and refused.json() == {"error": "'score' must be true or false, got 'no'"}


def test_truncated_and_slow_bodies(unix_engine: httpx.Client) -> None:
    """A client that declares 200 bytes, sends 10 and hangs up costs nothing; one that sends its body slowly, in
    pieces, is answered; the engine answers a valid request after both."""
    path = str(unix_engine.socket_path)  # type: ignore[attr-defined]
    with sockets.socket(sockets.AF_UNIX) as raw:
        raw.connect(path)
        raw.sendall(b"POST /v1/infill HTTP/1.1\r\nHost: e\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 200\r\n\r\n{\"prefix\":")  # fmt: skip
    body = json.dumps(BODY).encode()
    with sockets.socket(sockets.AF_UNIX) as raw:
        raw.connect(path)
        raw.sendall(b"POST /v1/infill HTTP/1.1\r\nHost: e\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body))  # fmt: skip
        for start in range(0, len(body), 16):
            raw.sendall(body[start : start + 16])
            time.sleep(0.02)
        answer = b""
        while chunk := raw.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200") and b'"text"' in answer
    assert unix_engine.post("/v1/infill", json=BODY).status_code == 200


def ok_infills(client: httpx.Client) -> float:
    line = 'canvas_requests_total{endpoint="infill",outcome="ok"} '
    return next(
        (float(x.removeprefix(line)) for x in client.get("/metrics").text.splitlines() if x.startswith(line)), 0
    )


def test_metrics_count_requests(unix_engine: httpx.Client) -> None:
    before = ok_infills(unix_engine)
    unix_engine.post("/v1/infill", json=BODY)
    assert ok_infills(unix_engine) == before + 1
    text = unix_engine.get("/metrics").text
    assert "canvas_latency_seconds_bucket" in text and "canvas_queue_depth" in text
    # compile=auto on a CPU: the decoder stays eager and says so; every step is counted as such
    compiled = unix_engine.get("/health").json()["compile"]
    assert compiled["state"] == "off" and "cpu" in compiled["detail"]
    eager = next(line for line in text.splitlines() if line.startswith("canvas_eager_steps "))
    assert float(eager.split()[1]) >= 1 and "canvas_compiled_steps 0.0" in text
    # the prefix cache's bytes (what `bench soak` tells apart from a leak): a long prefix leaves a snapshot
    long = {**BODY, "prefix": "".join(f"value_{i} = {i} * {i}\n" for i in range(60)) + BODY["prefix"]}
    assert unix_engine.post("/v1/infill", json=long).status_code == 200
    held = next(line for line in unix_engine.get("/metrics").text.splitlines()
                if line.startswith("canvas_prefix_cache_bytes "))  # fmt: skip
    assert float(held.split()[1]) > 0


def free_port() -> int:
    with sockets.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_tcp_needs_the_bearer_token(tiny_model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    (tmp_path / "token").write_text("s3cret\n")  # from a file: `ps` does not show it
    process = subprocess.Popen([*ENGINE, "--model", str(tiny_model_dir), "--tcp", f"127.0.0.1:{port}",
                                "--token-file", str(tmp_path / "token")], stdin=subprocess.DEVNULL)  # fmt: skip
    try:
        authorised = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": "Bearer s3cret"})
        wait_health(authorised)
        anonymous = httpx.get(f"http://127.0.0.1:{port}/health")
        assert anonymous.status_code == 401
        for guess in ("Bearer x", "Bearer s3cre", "Bearer s3cret2", "bearer s3cret", "s3cret"):
            wrong = httpx.post(f"http://127.0.0.1:{port}/v1/infill", json=BODY, headers={"Authorization": guess})
            assert wrong.status_code == 401, guess
        assert authorised.post("/v1/infill", json=BODY).status_code == 200
    finally:
        process.kill()
        process.wait()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tcp", "127.0.0.1:9"], "TCP needs a bearer token"),
        (["--tcp", "0.0.0.0:9", "--token", "t"], "0.0.0.0 is not a loopback address"),
        (["--tcp", "example.com:9", "--token", "t"], "'example.com' is not an IP address"),
        (["--tcp", "127.0.0.1:9", "--token-file", "/nonexistent/token"], "cannot read the token file"),
    ],
)
def test_unsafe_tcp_is_refused(args: list[str], message: str) -> None:
    done = refused_before_loading(["engine", *args])
    assert done.returncode == 2 and message in done.stderr
    assert done.stdout.strip() == NOTHING_LOADED


def test_a_socket_path_that_is_not_a_socket_is_refused_and_kept(tmp_path: Path) -> None:
    path = tmp_path / "important.txt"
    path.write_text("keep me")
    done = refused_before_loading(["engine", "--socket", str(path)])
    assert done.returncode == 2 and "exists and is not a socket" in done.stderr
    assert done.stdout.strip() == NOTHING_LOADED
    assert path.read_text() == "keep me"


def test_an_endless_chunked_body_is_refused_without_being_held(unix_engine: httpx.Client) -> None:
    """No Content-Length: the body is counted as it arrives and refused past the limit (20,000 bytes here); the
    engine's memory does not grow by what the client tried to send (64 MiB)."""
    pid = unix_engine.get("/health").json()["pid"]

    def rss() -> int:
        return int(rss_mb(pid) * 2**20)

    before = rss()

    def endless() -> Iterator[bytes]:
        for _ in range(64):
            yield b"x" * (1 << 20)

    try:
        response = unix_engine.post("/v1/infill", content=endless())
        assert response.status_code == 413
    except httpx.HTTPError:
        pass  # the engine answered and closed while the client was still sending: refused all the same
    assert rss() - before < 16 << 20
    declared = unix_engine.post("/v1/infill", content=b"x" * 30_000, headers={"content-length": "30000"})
    assert declared.status_code == 413 and "over the limit" in declared.json()["error"]
    assert unix_engine.get("/health").status_code == 200


# -- LSP servers on the resident engine ----------------------------------------------------------------------------

COMMENT_DOC = "import os\n\n\ndef main():\n    # TODO: \n    return os.getcwd()\n"


async def lsp_session(init: dict[str, Any], uri: str = "file:///w/a.py") -> LanguageClient:
    client = LanguageClient("test", "1")
    for method in (types.WINDOW_LOG_MESSAGE, types.WINDOW_SHOW_MESSAGE, types.PROGRESS):
        client.feature(method)(lambda *args: None)
    client.feature(types.WINDOW_WORK_DONE_PROGRESS_CREATE)(lambda *args: None)
    await client.start_io(sys.executable, "-m", "canvas_ls.server.cli", "serve", "--log-level", "WARNING")
    await client.initialize_async(types.InitializeParams(capabilities=types.ClientCapabilities(),
                                                         initialization_options=init))  # fmt: skip
    client.initialized(types.InitializedParams())
    client.text_document_did_open(
        types.DidOpenTextDocumentParams(types.TextDocumentItem(uri, "python", 1, COMMENT_DOC))
    )
    return client


async def stats(client: LanguageClient) -> Any:
    return await client.protocol.send_request_async("canvas/stats", {})


async def wait_ready(client: LanguageClient, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while (await stats(client)).engine.state != "ready":
        assert time.monotonic() < deadline, "the resident engine did not become ready"
        await asyncio.sleep(0.1)


async def fill(client: LanguageClient, character: int = 12, uri: str = "file:///w/a.py") -> Any:
    params = {"textDocument": {"uri": uri}, "position": {"line": 4, "character": character}}
    return await client.protocol.send_request_async("canvas/fill", params)


async def close(client: LanguageClient) -> None:
    await client.shutdown_async(None)
    client.exit(None)


async def until_engine(path: Path, reached: Callable[[dict[str, Any]], bool], timeout: float = 60) -> None:
    """Returns once the engine's /health satisfies `reached` (its steps, its queue)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not reached(engine_health(path)):
        assert asyncio.get_running_loop().time() < deadline, engine_health(path)
        await asyncio.sleep(0.02)


def engine_health(path: Path) -> dict[str, Any]:
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(path)), base_url="http://engine") as client:
        return client.get("/health").json()


def resident(tiny_model_dir: Path, path: Path, **completion: Any) -> dict[str, Any]:
    engine = {"backend": "resident", "socket": str(path), "model": str(tiny_model_dir), "device": "cpu"}
    return {"engine": engine, "completion": {"max_steps": 3, "speculate": False, **completion}}


def test_one_engine_socket_per_installation_model_and_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from canvas_ls.engine import paths
    from canvas_ls.engine.paths import DEFAULT_MODEL_DIR, default_socket

    assert default_socket() == default_socket(None, "auto") == default_socket(str(DEFAULT_MODEL_DIR))  # shipped
    ours = default_socket()
    monkeypatch.setattr(paths, "installation", lambda: {"installation": "/opt/other-venv", "version": "0.1.0"})
    assert default_socket() != ours  # another installation's server never reaches this one's engine
    monkeypatch.undo()
    assert default_socket(str(tmp_path), "cpu") == default_socket(str(tmp_path / "." / ""), "cpu")
    assert default_socket(str(tmp_path), "cpu") not in (default_socket(str(tmp_path), "cuda"), default_socket())
    adapted = default_socket(str(tmp_path), "cpu", str(tmp_path / "adapter"))  # an adapter is another engine
    assert adapted != default_socket(str(tmp_path), "cpu") and adapted != default_socket(None, None, "other")
    assert default_socket(None, None, None, "auto") == ours  # int8 weights are another engine
    assert default_socket(str(tmp_path), "cpu", None, "int8") != default_socket(str(tmp_path), "cpu", None, "none")
    assert oct(default_socket().parent.stat().st_mode & 0o777) == "0o700"


async def test_the_default_backend_is_the_engine_for_its_model(tiny_model_dir: Path) -> None:
    """An editor that names no backend gets the shared engine of its model (started on demand)."""
    from canvas_ls.engine.paths import default_socket

    client = await lsp_session({"engine": {"model": str(tiny_model_dir), "device": "cpu"}})
    try:
        await wait_ready(client)
        assert (await fill(client)).result is not None
        socket = default_socket(str(tiny_model_dir), "cpu")
        assert engine_health(socket)["model"] == str(tiny_model_dir)
        # its log (its stderr) says how many threads it computes with and why (`engine/threads.py`), as /health does
        cores = engine_health(socket)["threads"]["cores"]
        said = rf"INFO canvas_ls\.engine\.threads threads: [1-9]\d* of {cores} cores \(.*other processes keep "
        assert re.search(said, socket.with_suffix(".log").read_text())
    finally:
        await close(client)


async def test_an_engine_that_cannot_start_says_why(tmp_path: Path) -> None:
    """A wrong model path: the editor is told the engine's own error, not just an exit status."""
    client = await lsp_session({"engine": {"model": str(tmp_path / "no-such-model"), "device": "cpu"}})
    try:
        deadline = time.monotonic() + 120
        while (state := (await stats(client)).engine).state == "loading":
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
        assert state.state == "failed"
        assert "no-such-model' does not exist" in state.error and "exited with status" in state.error
    finally:
        await close(client)


async def test_the_compile_option_reaches_the_engine_the_server_starts(tiny_model_dir: Path, tmp_path: Path) -> None:
    """`engine.compile: on` starts the resident engine with its compiled step (warming up in the background while
    requests run eager), on the CPU too, where `auto` leaves it off."""
    path = tmp_path / "run" / "engine.sock"
    client = await lsp_session({"engine": {**resident(tiny_model_dir, path)["engine"], "compile": "on"}})
    try:
        await wait_ready(client)
        assert (await fill(client)).result is not None  # served eager meanwhile, never refused
        assert engine_health(path)["compile"]["state"] in ("warming", "ready")
    finally:
        await close(client)
        os.kill(engine_health(path)["pid"], signal.SIGKILL)  # its compilation would hold the cores


async def test_the_quantize_option_reaches_the_engine_the_server_starts(tiny_model_dir: Path, tmp_path: Path) -> None:
    """`engine.quantize: int8` starts the resident engine with int8 weights (eager: its compile is off, and says
    why); one the machine cannot run reaches the editor as the engine's own error."""
    path = tmp_path / "run" / "engine.sock"
    client = await lsp_session({"engine": {**resident(tiny_model_dir, path)["engine"], "quantize": "int8"}})
    try:
        await wait_ready(client)
        assert (await fill(client)).result is not None
        health = engine_health(path)
        assert health["quantize"] == "int8"
        assert health["compile"]["state"] == "off" and health["compile"]["detail"] == "off: int8 weights run eager"
    finally:
        await close(client)
        os.kill(engine_health(path)["pid"], signal.SIGKILL)
    other = tmp_path / "run" / "int4.sock"
    client = await lsp_session({"engine": {**resident(tiny_model_dir, other)["engine"], "quantize": "int4"}})
    try:
        deadline = time.monotonic() + 120
        while (state := (await stats(client)).engine).state == "loading":
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
        assert state.state == "failed" and "int4 weights run on NVIDIA GPUs" in state.error
    finally:
        await close(client)


async def test_two_editors_share_one_engine(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "run" / "engine.sock"
    first, second = await asyncio.gather(lsp_session(resident(tiny_model_dir, path)),
                                         lsp_session(resident(tiny_model_dir, path), "file:///w/b.py"))  # fmt: skip
    try:
        await asyncio.gather(wait_ready(first), wait_ready(second))
        one, two = await asyncio.gather(fill(first), fill(second, 11, "file:///w/b.py"))
        assert one.result is not None and two.result is not None
        pid = engine_health(path)["pid"]
        engines = subprocess.run(
            ["pgrep", "-f", "--", f"engine --socket {path}"], capture_output=True, text=True
        ).stdout.split()
        assert engines == [str(pid)]  # both editors started or found the same single engine (the lock)
    finally:
        await asyncio.gather(close(first), close(second))
        os.kill(engine_health(path)["pid"], signal.SIGKILL)


async def test_kill_9_mid_request_answers_empty_then_recovers(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "run" / "engine.sock"
    client = await lsp_session(resident(tiny_model_dir, path, max_steps=3000, gap_tokens_single_line=32))
    try:
        await wait_ready(client)
        victim, steps = engine_health(path)["pid"], engine_health(path)["steps"]
        pending = asyncio.ensure_future(fill(client))
        await until_engine(path, lambda health: health["steps"] > steps)  # it is denoising
        os.kill(victim, signal.SIGKILL)
        answer = await asyncio.wait_for(pending, 60)
        assert answer.edit is None  # the editor gets an empty result, said to be an error (never "cancelled")
        assert answer.source.startswith("error:the engine went away during the completion")
        assert (await stats(client)).errors == 1
        await wait_ready(client)  # ...the server starts a new engine...
        assert engine_health(path)["pid"] != victim
        assert (await stats(client)).engineRestarts == 1
        client.workspace_did_change_configuration(
            types.DidChangeConfigurationParams(settings={"canvas-ls": resident(tiny_model_dir, path)})
        )
        after = await fill(client, 11)
        assert after.result is not None  # ...and the next request succeeds
    finally:
        await close(client)
        os.kill(engine_health(path)["pid"], signal.SIGKILL)


async def test_kill_9_under_8_editors_answers_each_its_own_document(tiny_model_dir: Path, tmp_path: Path) -> None:
    """8 editors (8 servers) on one engine, a request pending in each when the engine is killed: every one answers
    empty with the reason, the engine comes back once, and each editor's next answer is for its own document (their
    prefixes differ in length: the answers' prefix sizes keep that order)."""
    path = tmp_path / "run" / "engine.sock"
    slow = resident(tiny_model_dir, path, max_steps=3000, gap_tokens_single_line=32)
    clients = [await lsp_session(slow, f"file:///w/editor{i}.py") for i in range(8)]
    documents = [f"file:///w/own{i}.py" for i in range(8)]
    try:
        for client in clients:
            await wait_ready(client)
        for i, (client, uri) in enumerate(zip(clients, documents, strict=True)):
            text = f"# editor {i}\n" * (4 * i + 1) + COMMENT_DOC  # the cursor line moves down with the header
            client.text_document_did_open(types.DidOpenTextDocumentParams(types.TextDocumentItem(uri, "python", 1,
                                                                                                 text)))  # fmt: skip
        lines = [4 * i + 1 + 4 for i in range(8)]
        victim, steps = engine_health(path)["pid"], engine_health(path)["steps"]
        pending = [asyncio.ensure_future(fill_at(c, uri, line)) for c, uri, line in zip(clients, documents, lines,
                                                                                           strict=True)]  # fmt: skip
        await until_engine(path, lambda health: health["queue"] == 8 and health["steps"] > steps)  # all 8 in it
        os.kill(victim, signal.SIGKILL)
        answers = await asyncio.wait_for(asyncio.gather(*pending), 120)
        assert all(a.edit is None and a.source.startswith("error:") for a in answers), [a.source for a in answers]
        for client in clients:
            await wait_ready(client)
            client.workspace_did_change_configuration(
                types.DidChangeConfigurationParams(settings={"canvas-ls": resident(tiny_model_dir, path)})
            )
        assert engine_health(path)["pid"] != victim
        after = await asyncio.gather(*(fill_at(c, uri, line) for c, uri, line in zip(clients, documents, lines,
                                                                                        strict=True)))  # fmt: skip
        sizes = [a.result.prefix_tokens for a in after]
        assert sizes == sorted(sizes) and len(set(sizes)) == 8, sizes
    finally:
        for client in clients:
            await close(client)
            await asyncio.wait_for(client._server.wait(), 30)
        os.kill(engine_health(path)["pid"], signal.SIGKILL)


async def fill_at(client: LanguageClient, uri: str, line: int, character: int = 12) -> Any:
    params = {"textDocument": {"uri": uri}, "position": {"line": line, "character": character}}
    return await client.protocol.send_request_async("canvas/fill", params)


# -- the "openai" backend: any OpenAI-compatible server, tested against our own engine's /v1/completions ----------


def test_completion_request_places_the_suffix_as_the_server_takes_it() -> None:
    from canvas_ls.server.backend import CompletionRequest, Settings, completion_request

    template = "<PRE>{prefix}<SUF>{suffix}<MID>"
    as_field = completion_request(CompletionRequest("a = ", "\nb", Settings(max_new_tokens=9)), "m", "field", template)
    assert as_field == {"max_tokens": 9, "temperature": 0, "stream": False, "model": "m", "prompt": "a = ",
                        "suffix": "\nb"}  # fmt: skip
    in_prompt = completion_request(CompletionRequest("a = ", "\nb"), None, "prompt", template)
    assert in_prompt["prompt"] == "<PRE>a = <SUF>\nb<MID>" and "suffix" not in in_prompt


async def test_openai_backend_against_our_engine(tiny_model_dir: Path) -> None:
    port = free_port()
    engine = subprocess.Popen([*ENGINE, "--model", str(tiny_model_dir), "--tcp", f"127.0.0.1:{port}",
                               "--token", "k3y"], stdin=subprocess.DEVNULL)  # fmt: skip
    wait_health(httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": "Bearer k3y"}))
    base = {"backend": "openai", "url": f"http://127.0.0.1:{port}", "suffix_mode": "field"}
    good = await lsp_session({"engine": {**base, "api_key": "k3y"}, "completion": {"max_new_tokens_single_line": 8}})
    bad = await lsp_session({"engine": {**base, "api_key": "wrong"}}, "file:///w/b.py")
    try:
        await asyncio.gather(wait_ready(good), wait_ready(bad))
        answer = await fill(good)
        assert not answer.source.startswith("error:")  # the OpenAI-compatible server's answer reached the server,
        assert isinstance(answer.result.choices[0].text, str)  # which the fill names as the backend's whole answer
        refused = await fill(bad, uri="file:///w/b.py")
        assert refused.source.startswith("error:") and "401" in refused.source
    finally:
        await asyncio.gather(close(good), close(bad))
        engine.kill()
        engine.wait()


def test_concurrent_requests_share_decoder_forwards(unix_engine: httpx.Client) -> None:
    import concurrent.futures

    path = unix_engine.socket_path  # type: ignore[attr-defined]
    slow = {"max_new_tokens": 16, "max_steps": 40, "gap_tokens": 16}

    def one(index: int) -> int:
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(path)), base_url="http://engine", timeout=120) as c:
            body = {"prefix": f"# client {index}\n" + BODY["prefix"], "suffix": "\n", "settings": slow}
            return c.post("/v1/infill", json=body).status_code

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert list(pool.map(one, range(4))) == [200] * 4
    metrics = unix_engine.get("/metrics").text
    batched = [line for line in metrics.splitlines() if line.startswith('canvas_batch_size_bucket{le="1.0"}')]
    count = [line for line in metrics.splitlines() if line.startswith("canvas_batch_size_count")]
    assert float(batched[0].split()[-1]) < float(count[0].split()[-1])  # at least one batch held 2+ requests


def test_one_engine_answers_for_several_adapters_at_once(tiny_model_dir: Path, linear_adapters: list[Path],
                                                         tmp_path: Path) -> None:  # fmt: skip
    """Requests naming different LoRA adapters (workspaces tuned from the engine's model), sent together, each get
    the answer of the model with their adapter merged (fp32, token for token): a batch computes with one adapter
    and the others wait for it to drain. A folder that is not an adapter is that request's 400."""
    import concurrent.futures

    path = tmp_path / "run" / "engine.sock"
    process = subprocess.Popen([*ENGINE, "--model", str(tiny_model_dir), "--socket", str(path), "--dtype", "float32"],
                               stdin=subprocess.DEVNULL)  # fmt: skip
    settings = {"max_new_tokens": 8, "min_new_tokens": 2, "seed": 1}
    requests = [(prompt, adapter) for adapter in (*linear_adapters, None) for prompt in PROMPTS]
    expected = {}
    for adapter in (*linear_adapters, None):
        merged = Engine.load(str(tiny_model_dir), "cpu", dtype="float32", adapter=adapter and str(adapter))
        for prefix, suffix in PROMPTS:
            expected[prefix, adapter] = merged.infill(prefix, suffix, settings).tokens

    def one(request: tuple[tuple[str, str], Path | None]) -> dict[str, Any]:
        (prefix, suffix), adapter = request
        body = {"prefix": prefix, "suffix": suffix, "settings": settings, "adapter": adapter and str(adapter)}
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(path)), base_url="http://engine", timeout=120) as c:
            return c.post("/v1/infill", json=body).json()

    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(path)), base_url="http://engine", timeout=60) as c:
            wait_health(c)
            with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
                results = list(pool.map(one, requests))
            for ((prefix, _), adapter), result in zip(requests, results, strict=True):
                assert result["tokens"] == expected[prefix, adapter] and result["adapter"] == (adapter and str(adapter))
            assert sorted(c.get("/health").json()["adapters"]) == sorted(str(a) for a in linear_adapters)
            refused = c.post("/v1/infill", json={**BODY, "adapter": str(tmp_path)})
            assert refused.status_code == 400 and "is not a peft adapter folder" in refused.json()["error"]
            assert c.post("/v1/infill", json=BODY).status_code == 200
    finally:
        process.kill()
        process.wait()


def test_background_work_waits_for_real_requests_and_yields_to_them(unix_engine: httpx.Client) -> None:
    """priority "background" (an editor's next suggestion, computed ahead): it waits while a real request runs,
    and a real request that arrives stops it before the next step (499, counted)."""
    import concurrent.futures

    path = unix_engine.socket_path  # type: ignore[attr-defined]
    endless = {"max_new_tokens": 16, "gap_tokens": 16, "max_steps": 300, "stability_threshold": 1000,
               "confidence_threshold": 1e-9}  # every step runs: ~1 s of denoising  # fmt: skip

    def post(body: dict[str, Any]) -> tuple[int, float]:
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(path)), base_url="http://engine", timeout=120) as c:
            status = c.post("/v1/infill", json=body).status_code
            return status, time.monotonic()

    def preempted() -> float:
        line = next(x for x in unix_engine.get("/metrics").text.splitlines()
                    if x.startswith("canvas_background_preempted_total "))  # fmt: skip
        return float(line.split()[1])

    before, steps = preempted(), unix_engine.get("/health").json()["steps"]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        background = pool.submit(post, {**BODY, "settings": endless, "priority": "background", "document": "d"})
        while unix_engine.get("/health").json()["steps"] <= steps:  # until it is denoising
            time.sleep(0.01)
        real = post(BODY)
        assert real[0] == 200 and background.result()[0] == 499
    assert preempted() == before + 1
    metrics = unix_engine.get("/metrics").text
    assert 'canvas_requests_total{endpoint="infill_background",outcome="cancelled"}' in metrics
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # the other way round: it waits, then runs
        real_future = pool.submit(post, {**BODY, "settings": endless})
        while unix_engine.get("/health").json()["queue"] < 1:
            time.sleep(0.01)
        background_status, background_done = post({**BODY, "priority": "background"})
        real_status, real_done = real_future.result()
    assert (real_status, background_status) == (200, 200) and background_done >= real_done
    assert unix_engine.post("/v1/infill", json={**BODY, "priority": "urgent"}).status_code == 400


def test_fill_takes_segments_and_answers_per_gap(unix_engine: httpx.Client) -> None:
    segments = [{"text": "def add(a, b):\n    "}, {"hole": True}, {"text": "\n\n\ndef sub(a, b):\n    "},
                {"rewrite": "return a + b", "strength": 0.5}, {"text": "\n"}]  # fmt: skip
    result = unix_engine.post("/v1/fill", json={"segments": segments, "settings": {"max_steps": 4}}).json()
    assert len(result["gaps"]) == 2 and result["forward_passes"] == result["steps"] > 0
    assert all(gap["stop_reason"] in ("eos", "truncated") for gap in result["gaps"])
    for body, message in [
        ({"segments": [{"text": "x"}]}, "no hole given"),
        ({"segments": [{"hole": True, "text": "x"}]}, "each segment is"),
        ({"segments": [{"rewrite": "x", "strength": "strong"}]}, "must be a number"),
        ({"segments": "x"}, "'segments' must be a list"),
        ({"segments": [{"hole": True}] * 9}, "9 holes, over the limit of 8"),
        ({"segments": [{"hole": True}], "settings": {"layout": "prompt"}}, "'canvas' layout"),
    ]:
        response = unix_engine.post("/v1/fill", json=body)
        assert response.status_code == 400 and message in response.json()["error"], (body, response.text)
    assert unix_engine.get("/health").status_code == 200
    assert 'canvas_requests_total{endpoint="fill",outcome="bad_request"}' in unix_engine.get("/metrics").text


def test_a_bad_setting_is_that_request_s_400(unix_engine: httpx.Client) -> None:
    response = unix_engine.post("/v1/infill", json={**BODY, "settings": {"gap_tokens": "many"}})
    assert response.status_code == 400 and "gap_tokens" in response.json()["error"]


def test_the_engine_exits_when_idle(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "engine.sock"
    process = subprocess.Popen([*ENGINE, "--model", str(tiny_model_dir), "--socket", str(path), "--idle-exit", "1"],
                               stdin=subprocess.DEVNULL)  # fmt: skip
    client = httpx.Client(transport=httpx.HTTPTransport(uds=str(path)), base_url="http://engine", timeout=60)
    wait_health(client)
    assert client.post("/v1/infill", json=BODY).status_code == 200
    assert process.wait(timeout=60) == 0  # no request for a second: it leaves by itself


async def test_a_cancel_flag_wakes_its_waiters_from_any_thread() -> None:
    from canvas_ls.server.backend import CancelFlag

    for setter in ("loop", "thread"):
        flag = CancelFlag()
        waiting = asyncio.ensure_future(flag.until_set())
        await asyncio.sleep(0.05)
        assert not waiting.done()
        if setter == "loop":
            flag.set()
        else:
            threading.Thread(target=flag.set).start()
        await asyncio.wait_for(waiting, 5)
        assert flag.is_set()
        await asyncio.wait_for(flag.until_set(), 1)  # already set: returns at once
