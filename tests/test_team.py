"""A team on one deployment: `canvas-ls team serve` (Ray Serve, a local cluster of 2 replicas of the fixed-answer
model), its users' tokens and rate limit, affinity routing, a replica killed, and the language server's `remote`
backend through a real `canvas-ls serve`; the remote backend's refusals (another API version, an answer without the
version, a deployment that does not answer) against fake engines."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_lsp
from lsprotocol import types
from pytest_lsp import LanguageClient
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from canvas_ls.engine.paths import API_HEADER, API_VERSION
from canvas_ls.engine.team import rendezvous
from canvas_ls.engine.users import RateLimit, TokenFile
from canvas_ls.server import backend as backends
from canvas_ls.server.backend import Answer, CancelFlag, CompletionRequest, Failed, RemoteBackend, Settings
from canvas_ls.server.cli import main
from canvas_ls.server.silence import Why
from tests.conftest import SERVER
from tests.test_identity import AFTER_RETURN, DOC, loaded, wait_model
from tests.test_lsp import fill, open_doc

CLI = [sys.executable, "-m", "canvas_ls.server.cli"]
RATE, BURST = 0.2, 10  # the deployment's rate limit: each test asks as a user of its own


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def add_user(tokens: Path, name: str) -> str:
    done = subprocess.run([*CLI, "team", "token", "add", name, "--tokens", str(tokens)], capture_output=True,
                          text=True, check=True)  # fmt: skip
    return done.stdout.strip()


# -- without a cluster -------------------------------------------------------------------------------------------


def test_an_adapter_archive_is_the_same_bytes_every_time_and_holds_only_the_adapter(tmp_path: Path) -> None:
    import io
    import tarfile

    from canvas_ls.engine.adapter_files import AdapterArchiveError, check, name_of, pack, unpack

    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text('{"r": 4}')
    (folder / "adapter_model.safetensors").write_bytes(b"weights")
    (folder / "README.md").write_text("not sent")
    data = pack(folder)
    os.utime(folder / "adapter_config.json", (1, 1))  # another time, the same bytes
    assert pack(folder) == data and name_of(data).startswith("sha256:") and len(name_of(data)) == 7 + 64
    assert (unpack(data, tmp_path / "out") / "adapter_config.json").read_text() == '{"r": 4}'
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]

    def archive(*members: tarfile.TarInfo) -> bytes:
        out = io.BytesIO()
        with tarfile.open(fileobj=out, mode="w") as tar:
            for member in members:
                tar.addfile(member, io.BytesIO(b"x" * member.size) if member.isfile() else None)
        return out.getvalue()

    link = tarfile.TarInfo("adapter_model.safetensors")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    for bad in (archive(tarfile.TarInfo("adapter_config.json"), link),
                archive(tarfile.TarInfo("adapter_config.json"), tarfile.TarInfo("adapter_model.safetensors"),
                        tarfile.TarInfo("../escape"))):  # fmt: skip
        with pytest.raises(AdapterArchiveError, match=r"holds adapter_config\.json and adapter_model\.safetensors"):
            check(bad)


def test_the_token_file_holds_digests_and_a_revoked_token_is_refused(tmp_path: Path) -> None:
    tokens = tmp_path / "users"
    alice, bob = add_user(tokens, "alice"), add_user(tokens, "bob")
    text = tokens.read_text()
    assert (alice in text, bob in text, oct(tokens.stat().st_mode & 0o777)) == (False, False, "0o600")
    users = TokenFile(tokens)
    assert [users.user(f"Bearer {alice}"), users.user(f"Bearer {bob}"), users.user("Bearer nope"),
            users.user(None), users.user(alice)] == ["alice", "bob", None, None, None]  # fmt: skip
    again = subprocess.run([*CLI, "team", "token", "add", "alice", "--tokens", str(tokens)], capture_output=True,
                           text=True)  # fmt: skip
    assert (again.returncode, again.stderr.strip()) == (
        2, f"canvas-ls: error: alice is already in {tokens}; revoke it first to give a new token"
    )  # fmt: skip
    subprocess.run([*CLI, "team", "token", "revoke", "alice", "--tokens", str(tokens)], check=True)
    users.refresh(force=True)
    assert (users.user(f"Bearer {alice}"), users.user(f"Bearer {bob}")) == (None, "bob")
    listed = subprocess.run([*CLI, "team", "token", "list", "--tokens", str(tokens)], capture_output=True, text=True)
    assert listed.stdout == "bob\n"


def test_the_rate_limit_refills_and_says_when_to_come_back() -> None:
    limit = RateLimit(rate=2.0, burst=3)
    assert [limit.take("a", now=0.0) for _ in range(4)] == [0.0, 0.0, 0.0, 0.5]
    assert (limit.take("b", now=0.0), limit.take("a", now=0.25), limit.take("a", now=0.5)) == (0.0, 0.25, 0.0)


def test_rendezvous_moves_only_the_keys_of_a_replica_that_left() -> None:
    keys = [f"user\0file:///src/{i}.py" for i in range(3000)]

    def homes(replicas: list[str]) -> dict[str, str]:
        return {key: max(replicas, key=lambda r: rendezvous(key, r)) for key in keys}

    before, after = homes(["a", "b", "c"]), homes(["a", "c"])
    moved = {key for key in keys if before[key] != after[key]}
    assert moved == {key for key in keys if before[key] == "b"}
    shares = sorted(list(before.values()).count(r) for r in "abc")
    assert shares[0] > 900 and shares[-1] < 1100  # about a third each


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["team", "serve", "--http", "0.0.0.0:8000"],
         "0.0.0.0 is not a loopback address; pass --allow-remote to listen on it"),
        (["team", "serve", "--http", "0.0.0.0:8000", "--allow-remote"],
         "a deployment other machines can reach needs --tokens (`canvas-ls team token add`)"),
        (["team", "serve", "--replicas", "0"], "a deployment needs at least 1 replica, got 0"),
        (["serve", "--tcp", "0.0.0.0:2087"], "0.0.0.0 is not a loopback address; pass --allow-remote to listen on it "
                                             "(LSP over TCP has no authentication)"),
    ],
)  # fmt: skip
def test_nothing_listens_beyond_loopback_unless_told_and_guarded(
    argv: list[str], error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused before anything starts: a team deployment on a non-loopback address needs --allow-remote and a token
    file; the language server over TCP (no authentication at all) needs --allow-remote."""
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == f"canvas-ls: error: {error}"


# -- the remote backend against fake engines -----------------------------------------------------------------------


class FakeEngine:
    """An HTTP server in a thread that answers /health with `health` and /v1/infill with `answer`, counting
    requests; `versioned`: whether its answers carry the API header."""

    def __init__(self, health: dict[str, Any], versioned: bool = True, port: int | None = None) -> None:
        import uvicorn

        self.health, self.versioned, self.infills = health, versioned, 0
        self.port = port or free_port()
        app = Starlette(routes=[Route("/health", self._health), Route("/v1/infill", self._infill, methods=["POST"])])
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    async def _health(self, request: Any) -> JSONResponse:
        return JSONResponse(self.health, headers={API_HEADER: str(self.health.get("api"))})

    async def _infill(self, request: Any) -> JSONResponse:
        self.infills += 1
        headers = {API_HEADER: str(self.health["api"])} if self.versioned else {}
        return JSONResponse({"text": "x"}, headers=headers)

    def __enter__(self) -> FakeEngine:
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        return self

    def __exit__(self, *_: Any) -> None:
        self.server.should_exit = True
        self.thread.join()


def identity(version: str = "0.0.9") -> dict[str, str]:
    return {"installation": "/elsewhere", "version": version, "model": "team-model", "fingerprint": "f",
            "device": "cpu", "dtype": "float32", "quantize": "none", "adapter": ""}  # fmt: skip


async def test_a_deployment_of_another_api_version_gets_no_request() -> None:
    with FakeEngine(
        {"status": "ok", "api": API_VERSION + 1, "model": "team-model", "identity": identity("9.0")}
    ) as fake:
        backend = RemoteBackend(f"http://127.0.0.1:{fake.port}", "t")
        await loaded(backend)
        reply = await backend.infill(CompletionRequest("def f():\n    return ", "\n"), CancelFlag())
    assert (backend.state, backend.why, fake.infills) == ("failed", Why.ENGINE_MISMATCH, 0)
    expected = (f"the team engine at http://127.0.0.1:{fake.port} speaks API version {API_VERSION + 1} (canvas-ls "
                f"9.0), this canvas-ls {API_VERSION}: upgrade the one that is older")  # fmt: skip
    assert (reply, backend.error) == (Failed(expected, True, Why.ENGINE_MISMATCH), expected)


async def test_an_answer_without_this_api_version_is_not_read() -> None:
    """/health said the right version, but the deployment was replaced before it answered (a rolling upgrade to a
    version that does not say its own): the answer is not read as a result."""
    with FakeEngine({"status": "ok", "api": API_VERSION, "model": "team-model", "identity": identity()},
                    versioned=False) as fake:  # fmt: skip
        backend = RemoteBackend(f"http://127.0.0.1:{fake.port}", "t")
        await loaded(backend)
        assert backend.state == "ready"
        reply = await backend.infill(CompletionRequest("def f():\n    return ", "\n"), CancelFlag())
    assert (reply, fake.infills) == (
        Failed(
            f"the engine answered in API version unknown, this canvas-ls speaks {API_VERSION}; its answer was not read",
            True,
            Why.ENGINE_MISMATCH,
        ),
        1,
    )


async def test_a_deployment_that_does_not_answer_fails_at_once_and_is_asked_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(backends, "RECHECK_S", 0.0)
    port = free_port()
    backend = RemoteBackend(f"http://127.0.0.1:{port}", "t")
    started = time.monotonic()
    await loaded(backend)
    reply = await backend.infill(CompletionRequest("def f():\n    return ", "\n"), CancelFlag())
    assert time.monotonic() - started < backends.CONNECT_TIMEOUT_S
    assert reply == Failed(f"the team engine at http://127.0.0.1:{port} is unreachable ([Errno 111] Connection "
                           f"refused); asked again every 0 s", True, Why.UNREACHABLE)  # fmt: skip
    with FakeEngine({"status": "ok", "api": API_VERSION, "model": "team-model", "identity": identity()},
                    port=port) as fake:  # fmt: skip
        deadline = time.monotonic() + 30
        while fake.infills == 0:  # each request asks /health again while it fails; it answers now
            assert time.monotonic() < deadline, backend.error
            await backend.infill(CompletionRequest("def f():\n    return ", "\n"), CancelFlag())
            await asyncio.sleep(0.05)
    assert (backend.state, backend.model_name) == ("ready", "team-model")
    assert str(backend.identity) == "remote|team-model|f|cpu|float32|none|"


# -- a real deployment -------------------------------------------------------------------------------------------


class Deployment:
    def __init__(self, url: str, tokens: Path, process: subprocess.Popen[str], model: Path) -> None:
        self.url, self.tokens, self.process, self.model = url, tokens, process, model

    def client(self, user: str) -> httpx.Client:
        token = add_user(self.tokens, user)
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {token}"}, timeout=120)


@pytest.fixture(scope="module")
def deployment(fixed_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """`canvas-ls team serve`: a local Ray cluster with 2 replicas of the fixed-answer model, users from a token
    file, `RATE` requests a second per user in bursts of `BURST`."""
    folder = tmp_path_factory.mktemp("team")
    tokens, port = folder / "users", free_port()
    add_user(tokens, "admin")
    command = [
        *CLI,
        "team",
        "serve",
        "--model",
        str(fixed_model_dir),
        "--replicas",
        "2",
        "--device",
        "cpu",
        "--tokens",
        str(tokens),
        "--http",
        f"127.0.0.1:{port}",
        "--rate",
        str(RATE),
        "--burst",
        str(BURST),
    ]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True, env=env, start_new_session=True)  # fmt: skip
    lines: list[str] = []
    assert process.stderr is not None
    for line in process.stderr:  # ends when it is up (its line), or when it exits
        lines.append(line)
        if line.startswith("canvas-ls team:"):
            break
    assert lines and lines[-1].startswith("canvas-ls team: 2 replica(s) of"), "".join(lines[-20:])
    threading.Thread(target=process.stderr.read, daemon=True).start()  # keep draining its log
    try:
        yield Deployment(f"http://127.0.0.1:{port}", tokens, process, fixed_model_dir)
    finally:
        os.killpg(process.pid, signal.SIGINT)  # serve.shutdown(), then the local cluster with the driver
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def infill(client: httpx.Client, document: str, **extra: Any) -> httpx.Response:
    body = {"prefix": DOC[: DOC.index("return ") + 7], "suffix": "\n", "document": document,
            "settings": {"max_new_tokens": 4}, **extra}  # fmt: skip
    return client.post("/v1/infill", json=body)


def test_a_request_without_a_valid_token_learns_nothing_of_the_deployment(deployment: Deployment) -> None:
    for headers in ({}, {"Authorization": "Bearer cls_wrong"}):
        for method, path in (("GET", "/health"), ("GET", "/metrics"), ("POST", "/v1/infill")):
            response = httpx.request(method, deployment.url + path, headers=headers, json={}, timeout=30)
            assert (response.status_code, response.json()) == (401, {"error": "missing, wrong or revoked bearer token"})


def test_the_deployment_says_its_api_model_and_replicas(deployment: Deployment) -> None:
    with deployment.client("health-user") as client:
        health = client.get("/health").json()
    assert (health["api"], health["model"], health["identity"]["model"], health["router"]) == (
        API_VERSION, str(deployment.model), str(deployment.model), "affinity"
    )  # fmt: skip
    assert (health["deployment"]["status"], health["deployment"]["replicas"]) == ("HEALTHY", {"RUNNING": 2})


def test_a_documents_requests_go_to_one_replica_and_are_counted_by_user(deployment: Deployment) -> None:
    with deployment.client("routing-user") as client:
        answers = [infill(client, f"file:///team/{i % 4}.py") for i in range(8)]
        metrics = client.get("/metrics").text
    assert [(a.status_code, a.json()["text"], a.headers[API_HEADER]) for a in answers] == [
        (200, "Nonecodecodecode", str(API_VERSION))
    ] * 8  # fmt: skip
    replicas = [a.headers["x-canvas-replica"] for a in answers]
    assert replicas[:4] == replicas[4:]  # each document's second request went where its first did
    assert 'canvas_team_requests_total{endpoint="infill",status="200",user="routing-user"} 8.0' in metrics
    assert 'canvas_team_tokens_total{user="routing-user"}' in metrics
    assert "def size" not in metrics and "return" not in metrics  # counts, never code


def test_a_workspace_adapter_is_answered_by_the_replica_that_holds_it(
    deployment: Deployment, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Requests naming a workspace's LoRA adapter (a folder the replicas can read) are answered with it, by the
    replica that holds it (Serve's multiplexing), even for documents whose own home (rendezvous of the user and the
    document) is the other replica, where the same documents go without the adapter; a folder that is no adapter is
    that request's 400."""
    from tests.conftest import random_adapter

    adapter = random_adapter(deployment.model, tmp_path_factory.mktemp("team-adapter"))
    with deployment.client("adapter-plain") as client:  # the two replicas' names, from where plain requests went
        replicas: set[str] = set()
        for number in range(32):
            replicas.add(infill(client, f"file:///team/plain{number}.py").headers["x-canvas-replica"])
            if len(replicas) == 2:
                break
            if number >= BURST - 1:
                time.sleep(1 / RATE)  # within the user's rate
    with deployment.client("adapter-user") as client:
        first = infill(client, "file:///team/adapter0.py", adapter=str(adapter))
        holder = first.headers["x-canvas-replica"]
        documents = [f"file:///team/away{number}.py" for number in range(64)]
        away = [d for d in documents if max(replicas, key=lambda r: rendezvous(f"adapter-user\0{d}", r)) != holder]
        answers = [infill(client, document, adapter=str(adapter)) for document in away[:4]]
        without = [infill(client, document) for document in away[:4]]
    assert [(a.status_code, a.json()["adapter"]) for a in [first, *answers]] == [(200, str(adapter))] * 5
    assert [a.headers["x-canvas-replica"] for a in answers] == [holder] * 4
    assert {a.headers["x-canvas-replica"] for a in without} == replicas - {holder}  # their home, without it
    with deployment.client("adapter-wrong") as client:
        wrong = infill(client, "file:///team/adapter.py", adapter=str(tmp_path_factory.getbasetemp()))
    assert wrong.status_code == 400 and "is not a peft adapter folder" in wrong.json()["error"]


async def test_a_workspace_adapter_on_this_machine_is_sent_to_the_deployment_once(
    deployment: Deployment, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The language server's remote backend sends a workspace's adapter (a folder on this machine, which no replica
    can read) to the deployment once (`PUT /v1/adapters/{sha256}`) and names it by its digest; the answers are the
    answers of a request naming the same adapter by a folder the replicas read. A deployment that lost it (a new
    gateway) gets it again. Bytes that are not an adapter, or whose digest is not the path's, are refused."""
    from canvas_ls.engine.adapter_files import name_of, pack
    from tests.conftest import random_adapter

    folder = random_adapter(deployment.model, tmp_path_factory.mktemp("local-adapter"), seed=5)
    name = name_of(pack(folder))
    with deployment.client("upload-direct") as client:  # the same adapter by a folder the replicas can read
        direct = infill(client, "file:///team/upload.py", adapter=str(folder)).json()["text"]
        lost = infill(client, "file:///team/upload.py", adapter="sha256:" + "0" * 64)
        refused = client.put(f"/v1/adapters/{'0' * 64}", content=pack(folder))
        not_one = b"not a tar"
        junk = client.put(f"/v1/adapters/{name_of(not_one).split(':')[1]}", content=not_one)
    assert (lost.status_code, lost.json()) == (404, {"error": f"adapter sha256:{'0' * 64} is not uploaded here",
                                                     "upload": f"/v1/adapters/{'0' * 64}"})  # fmt: skip
    assert (refused.status_code, refused.json()) == (400, {"error": "the archive's SHA-256 is not the digest in the "
                                                                    "path"})  # fmt: skip
    assert junk.status_code == 400 and junk.json()["error"].startswith("not an adapter: not a tar archive")

    with deployment.client("upload-user") as client:
        token = client.headers["Authorization"].split()[1]
    backend = RemoteBackend(deployment.url, token)
    await loaded(backend)
    asked = CompletionRequest(DOC[: DOC.index("return ") + 7], "\n", Settings(max_new_tokens=4), "file:///team/upload.py",
                              adapter=str(folder))  # fmt: skip
    replies = [await backend.infill(asked, CancelFlag()) for _ in range(2)]
    assert [reply.text for reply in replies] == [direct, direct] and backend._uploaded == {name}  # type: ignore[union-attr]
    metrics = httpx.get(deployment.url + "/metrics", headers={"Authorization": f"Bearer {token}"}).text
    assert 'canvas_team_requests_total{endpoint="adapters",status="201",user="upload-user"} 1.0' in metrics
    assert 'canvas_team_requests_total{endpoint="infill",status="404",user="upload-user"}' not in metrics

    # The gateway lost an upload (restarted, or pushed out by newer ones): the backend believes it sent it
    lost = "sha256:" + "1" * 64
    backend._uploaded.add(lost)
    backend._packed[str(folder)] = (backend._packed[str(folder)][0], lost)
    again = await backend.infill(asked, CancelFlag())
    assert isinstance(again, Answer) and again.text == direct  # told 404 "upload": packed, sent again, asked again
    metrics = httpx.get(deployment.url + "/metrics", headers={"Authorization": f"Bearer {token}"}).text
    assert 'canvas_team_requests_total{endpoint="infill",status="404",user="upload-user"} 1.0' in metrics


def test_a_user_over_the_rate_limit_is_told_when_to_come_back(deployment: Deployment) -> None:
    with deployment.client("eager-user") as client:
        statuses = [infill(client, "file:///team/eager.py") for _ in range(BURST + 3)]
    assert [s.status_code for s in statuses] == [200] * BURST + [429] * 3
    assert {(s.headers["retry-after"], s.json()["error"]) for s in statuses[BURST:]} == {
        (str(int(1 / RATE)), f"over the rate limit of {RATE:g} requests a second")
    }  # fmt: skip


def test_a_killed_replica_costs_no_request_and_serve_restarts_it(deployment: Deployment) -> None:
    """One engine replica's process is killed (-9): every request after it is answered (sent again to the other
    replica where the dead one was chosen), and Serve starts a new replica."""
    with deployment.client("fault-user") as client:
        assert infill(client, "file:///team/fault.py").status_code == 200
        pids = subprocess.run(["pgrep", "-f", "ray::ServeReplica:canvas-ls:engine"], capture_output=True, text=True)
        assert len(pids.stdout.split()) == 2, pids.stdout
        os.kill(int(pids.stdout.split()[0]), signal.SIGKILL)
        after = [infill(client, f"file:///team/fault{i}.py") for i in range(6)]  # homed on both replicas
        assert [(a.status_code, a.json()["text"]) for a in after] == [(200, "Nonecodecodecode")] * 6
        killed, deadline = pids.stdout.split()[0], time.monotonic() + 120
        while True:  # a new replica process in the killed one's place, and both running again
            now = subprocess.run(["pgrep", "-f", "ray::ServeReplica:canvas-ls:engine"], capture_output=True, text=True)
            states = client.get("/health").json()["deployment"]["replicas"]
            if len(now.stdout.split()) == 2 and killed not in now.stdout.split() and states == {"RUNNING": 2}:
                break
            assert time.monotonic() < deadline, (now.stdout, states)
            time.sleep(0.5)


@pytest_lsp.fixture(config=SERVER)
async def client(lsp_client: LanguageClient):
    yield


async def test_the_language_server_completes_through_the_team_deployment(
    client: LanguageClient, deployment: Deployment
) -> None:
    """A real `canvas-ls serve` with `engine.backend: "remote"`: the whole canvas API of the deployment (the suffix
    in the canvas, the model's own answer), its model in the server's stats."""
    token = add_user(deployment.tokens, "editor-user")
    init = {"engine": {"backend": "remote", "url": deployment.url, "api_key": token},
            "completion": {"speculate": False, "max_new_tokens_single_line": 4}}  # fmt: skip
    capabilities = pytest_lsp.client_capabilities("neovim")
    await client.initialize_session(types.InitializeParams(capabilities=capabilities, initialization_options=init))
    await wait_model(client, deployment.model)
    open_doc(client, "size.py", DOC)
    answer = await fill(client, "size.py", AFTER_RETURN)
    assert (answer["source"], answer["edit"]["text"], answer["result"]["model"]) == (
        "model", "Nonecodecodecode", str(deployment.model)
    )  # fmt: skip
    assert json.loads(json.dumps(answer["result"]["gaps"]))[0]["text"] == "Nonecodecodecode"


async def test_the_configured_adapter_goes_to_the_deployment_with_every_request(
    client: LanguageClient, deployment: Deployment, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """`engine.adapter` (a folder on this machine) with `engine.backend: "remote"`: the language server sends it to
    the deployment once and every request names it; the replica answers with it (from the folder it unpacked)."""
    from canvas_ls.engine.adapter_files import name_of, pack
    from tests.conftest import random_adapter

    folder = random_adapter(deployment.model, tmp_path_factory.mktemp("configured-adapter"), seed=7)
    token = add_user(deployment.tokens, "adapted-editor")
    init = {"engine": {"backend": "remote", "url": deployment.url, "api_key": token, "adapter": str(folder)},
            "completion": {"speculate": False, "max_new_tokens_single_line": 4}}  # fmt: skip
    capabilities = pytest_lsp.client_capabilities("neovim")
    await client.initialize_session(types.InitializeParams(capabilities=capabilities, initialization_options=init))
    await wait_model(client, deployment.model)
    answers = []
    for name in ("size.py", "area.py"):  # two documents: two model calls, each naming the adapter
        open_doc(client, name, DOC)
        answers.append(await fill(client, name, AFTER_RETURN))
    digest = name_of(pack(folder)).split(":")[1]
    assert [(answer["source"], Path(answer["result"]["adapter"]).name) for answer in answers] == [("model", digest)] * 2
    metrics = httpx.get(deployment.url + "/metrics", headers={"Authorization": f"Bearer {token}"}).text
    assert 'canvas_team_requests_total{endpoint="adapters",status="201",user="adapted-editor"} 1.0' in metrics


async def test_a_repositorys_adapter_goes_to_the_deployment_with_its_documents(
    client: LanguageClient, deployment: Deployment, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A repository tuned as a LoRA adapter of the deployment's model ("Learn this workspace", `engine.model` naming
    that base): its documents are answered by the deployment with the adapter, sent from this machine; a document
    elsewhere without it. A repository tuned as a whole model cannot run there: the deployment's model answers its
    documents, and the user is told once."""
    import shutil

    from canvas_ls.engine import workspaces
    from canvas_ls.engine.adapter_files import name_of, pack
    from tests.conftest import random_adapter
    from tests.test_workspaces import AFTER_RETURN as RETURN_END
    from tests.test_workspaces import RETURN_DOC, fill_at, open_file

    folders = {name: tmp_path_factory.mktemp(name) for name in ("lora-repo", "whole-repo", "elsewhere", "runs")}
    random_adapter(deployment.model, folders["runs"] / "lora" / "adapter", seed=11)
    entry = workspaces.install(folders["lora-repo"], folders["runs"] / "lora", str(deployment.model), {},
                               {"name": "lora", "lora_rank": 4})  # fmt: skip
    shutil.copytree(deployment.model, folders["runs"] / "whole" / "model")
    workspaces.install(folders["whole-repo"], folders["runs"] / "whole", str(deployment.model), {}, {"name": "full"})
    try:
        token = add_user(deployment.tokens, "workspace-editor")
        engine = {"backend": "remote", "url": deployment.url, "api_key": token, "model": str(deployment.model)}
        init = {"engine": engine, "completion": {"speculate": False, "max_new_tokens_single_line": 4}}
        capabilities = pytest_lsp.client_capabilities("neovim")
        await client.initialize_session(types.InitializeParams(capabilities=capabilities, initialization_options=init))
        await wait_model(client, deployment.model)
        answers = {}
        for number, name in enumerate(("lora-repo", "whole-repo", "elsewhere")):  # texts of their own: no cached answer
            text = RETURN_DOC.replace("def f(", f"def f{number}(")
            answers[name] = await fill_at(client, open_file(client, folders[name] / "a.py", text), RETURN_END)
        assert {answer["source"] for answer in answers.values()} == {"model"}
        digest = name_of(pack(workspaces.read(entry).weights)).split(":")[1]
        adapters = {name: answer["result"]["adapter"] for name, answer in answers.items()}
        assert adapters["lora-repo"] is not None and Path(adapters["lora-repo"]).name == digest
        assert (adapters["whole-repo"], adapters["elsewhere"]) == (None, None)
        assert {answer["result"]["model"] for answer in answers.values()} == {str(deployment.model)}
        told = [m.message for m in client.log_messages if "whole model" in m.message]
        assert told == [f"canvas-ls: the model tuned on {folders['whole-repo'].resolve()} is a whole model, which "
                        "the team deployment cannot run (it holds LoRA adapters of its model): its documents answer "
                        "with the deployment's model"]  # fmt: skip
    finally:  # the user cache is the worker's: other tests list what is installed there
        for name in ("lora-repo", "whole-repo"):
            workspaces.remove(folders[name])
