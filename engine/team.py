"""The canvas engine as a Ray Serve application, for a team on one deployment (`canvas-ls team serve`, the
`canvas-ls[team]` extra).

    editors --HTTP--> Gateway (Serve's ingress)            --handle, routed by key--> EngineReplica x N
                      bearer tokens (users.TokenFile),                                 one Engine each, its step
                      a rate limit per user, /metrics                                  batching: the EngineService
                      per user (never code), retries                                   of `canvas-ls engine`, called
                      on a replica that died                                           in-process over ASGI

The HTTP API is the resident engine's own (/v1/infill, /v1/fill, /v1/completions with streaming, /health, /metrics):
each replica runs the same `EngineService` and the gateway hands it the request as it came, so the language
server's `remote` backend speaks to a team deployment as to `canvas-ls engine --tcp`.

Routing (`AffinityRouter`, Ray's public request-router extension): a request goes to the replica that holds its
document's prefix KV, found by rendezvous hashing of the key (user and document) over the replicas (a replica that
joins or leaves moves only its share of the keys); when that replica's queue is `spill_queue` long, the least loaded
replica of all takes it. `router="pow2"` is Serve's power-of-two-choices, the baseline it is measured against
(`canvas-ls bench team`).

Cancellation: a client that disconnects, or a newer request for the same document in the same replica, stops the
work at its next denoising step: the gateway cancels the Serve call, the replica tells the in-process request its
client went away, and the engine's own disconnect path does the rest.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import ray
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle
from ray.serve.request_router import FIFOMixin, MultiplexMixin, PendingRequest, RequestRouter, RunningReplica
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .adapter_files import ADAPTER_PREFIX, MAX_ADAPTER_BYTES, AdapterArchiveError, check, name_of, unpack
from .paths import API_HEADER, API_VERSION, MAX_BATCH, MAX_BODY_BYTES
from .users import RateLimit, TokenFile

__all__ = ["AffinityRouter", "TeamOptions", "application", "build", "rendezvous"]

log = logging.getLogger("canvas_ls.team")
APP_NAME = "canvas-ls"
RETRIES = 2  # a request whose replica died before answering is sent again, to another replica, this many times
ADAPTERS_PER_REPLICA = 4  # workspace adapters a replica holds beside its model (the engine's `AdapterSet` limit)
ADAPTERS_UPLOADED = 32  # uploaded adapters the gateway keeps in Ray's object store (the least recently used go)


@dataclass(frozen=True)
class TeamOptions:
    """A deployment's settings (`canvas-ls team serve`'s flags, or a Serve config file's `args`)."""

    model: str | None = None
    replicas: int = 1
    device: str = "auto"
    dtype: str | None = None
    quantize: str = "auto"
    compile: str = "auto"  # as `canvas-ls engine`: on the CPU the step's graphs compiled once, then loaded
    cpus_per_replica: float = 1.0
    gpus_per_replica: float = 0.0
    max_batch: int = MAX_BATCH
    router: str = "affinity"  # or "pow2"
    spill_queue: int = 4  # affinity: a home replica with this many requests in flight sends newcomers elsewhere
    tokens: str | None = None  # the users' token file; None: no authentication (loopback only, `team serve` checks)
    rate: float = 20.0  # requests a second per user on average...
    burst: int = 40  # ...and at once

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"a deployment needs at least 1 replica, got {self.replicas}")
        if self.router not in ("affinity", "pow2"):
            raise ValueError(f"router must be 'affinity' or 'pow2', got {self.router!r}")
        if self.rate <= 0 or self.burst < 1:
            raise ValueError("the rate limit needs rate > 0 and burst >= 1")


# -- routing ---------------------------------------------------------------------------------------------------


def rendezvous(key: str, replica: str) -> int:
    """The weight of `replica` for `key` (highest random weight): the replica of highest weight is the key's home,
    and removing a replica moves only the keys it was home to."""
    return int.from_bytes(hashlib.blake2b(f"{key}\0{replica}".encode(), digest_size=8).digest(), "big")


class AffinityRouter(FIFOMixin, MultiplexMixin, RequestRouter):
    """A document's requests to the replica that holds its prefix KV (its home by `rendezvous`), unless that
    replica's queue is `spill_queue` long: then the least loaded replica. Requests without a key go to the least
    loaded one. A request for a workspace's adapter looks among the replicas that hold that adapter first (Serve's
    multiplexing), then the others."""

    def initialize_state(self, spill_queue: int = 4, **_: Any) -> None:
        self.spill_queue = spill_queue

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        key = pending_request.kwargs.get("route_key") if pending_request is not None else None
        if pending_request is not None and pending_request.metadata.multiplexed_model_id:
            holding = self.apply_multiplex_routing(pending_request=pending_request)
            candidate_replicas = [r for r in candidate_replicas if r.replica_id in holding] or candidate_replicas
        if not key or len(candidate_replicas) < 2:
            return [candidate_replicas]
        ranked = sorted(candidate_replicas, key=lambda r: rendezvous(key, r.replica_id.unique_id), reverse=True)
        queue = self.replica_queue_len_cache.get(ranked[0].replica_id)
        if queue is not None and queue >= self.spill_queue:
            return [ranked]  # one rank: Serve takes its least loaded replica
        return [[ranked[0]], ranked[1:]]  # the home first; the others only if it refuses (its queue is full)


# -- the replicas ------------------------------------------------------------------------------------------------


async def asgi_request(app: Any, method: str, path: str, body: bytes,
                       headers: dict[str, str]) -> AsyncIterator[tuple[int, dict[str, str]] | bytes]:  # fmt: skip
    """Run one HTTP request through an ASGI app in this process: first (status, headers), then the body's chunks as
    the app sends them (a stream's events one by one). Closing the iterator early is the client going away: the app
    is told (`http.disconnect`), so an engine request stops at its next step."""
    messages: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        messages.put_nowait(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "client": None,
        "server": None, "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()],
    }  # fmt: skip
    task = asyncio.ensure_future(app(scope, receive, send))
    task.add_done_callback(lambda _: messages.put_nowait(None))
    try:
        while (message := await messages.get()) is not None:
            if message["type"] == "http.response.start":
                yield message["status"], {k.decode("latin-1"): v.decode("latin-1") for k, v in message["headers"]}
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body"):
                    return
    finally:
        gone.set()  # done, or the caller went away: either way the app's request has no client any more
        if not task.done():
            _background.add(task)
            task.add_done_callback(_background.discard)


_background: set[asyncio.Future[Any]] = set()  # apps still finishing after their caller left (kept referenced)


class EngineReplica:
    """One replica: one `Engine` and the resident engine's `EngineService` (its batching, cancellation, metrics)."""

    def __init__(self, options: dict[str, Any]) -> None:
        # Ray sets OMP_NUM_THREADS to the replica's CPUs: a bound, not a fixed choice. The engine's thread governor
        # (`threads.py`) takes it as its most and uses fewer while other processes (Ray's own among them) keep cores
        # busy, rather than spin-waiting on a core it cannot get.
        cap = os.environ.pop("OMP_NUM_THREADS", None)
        import torch

        if cap and cap.isdigit() and int(cap) > 0:
            torch.set_num_threads(int(cap))
        from .engine import Engine
        from .service import EngineService

        self.options = TeamOptions(**options)
        device = None if self.options.device == "auto" else self.options.device
        engine = Engine.load(self.options.model, device, dtype=self.options.dtype,
                             quantize=self.options.quantize,
                             compile=self.options.compile)  # fmt: skip
        self.service = EngineService(engine, max_batch=self.options.max_batch)
        self.name = serve.get_replica_context().replica_id.unique_id
        self.uploads = Path(tempfile.mkdtemp(prefix="canvas-ls-adapters-"))  # uploaded adapters, unpacked
        self.uploaded: dict[str, Any] = {}  # an uploaded adapter's name -> its bytes' reference, while it loads

    @serve.multiplexed(max_num_models_per_replica=ADAPTERS_PER_REPLICA)
    async def adapter(self, name: str) -> str:
        """Serve's record of the workspace adapters this replica holds, so that its router sends an adapter's requests
        where it is held: the folder the engine loads it from (`AdapterSet`, as many held), with the first request
        that names it. A folder the replicas can read is itself; an uploaded adapter (`sha256:...`) is unpacked
        from the gateway's object store into this replica's folder. A folder that is not an adapter of this model
        is that request's 400."""
        if not name.startswith(ADAPTER_PREFIX):
            return name
        folder = self.uploads / name.removeprefix(ADAPTER_PREFIX)
        if not folder.is_dir():
            unpack(await self.uploaded[name], folder)
        return str(folder)

    async def call(self, method: str, path: str, body: bytes, route_key: str | None = None,
                   uploaded: list[Any] | None = None) -> AsyncIterator[tuple[int, dict[str, str]] | bytes]:  # fmt: skip
        """The request through this replica's engine service: (status, headers) first, then the body's chunks.
        `route_key` is for the router (`AffinityRouter`) only; `uploaded`: the reference to an uploaded adapter's
        bytes, in a list (Ray leaves it unresolved: only a replica that does not hold it yet reads it)."""
        name = serve.get_multiplexed_model_id()
        if name:
            if uploaded:
                self.uploaded[name] = uploaded[0]
            try:
                folder = await self.adapter(name)
            finally:  # unpacked or not needed: the gateway's object goes when the gateway lets it go
                self.uploaded.pop(name, None)
            if folder != name:  # the engine reads the adapter from where this replica unpacked it
                body = json.dumps({**json.loads(body), "adapter": folder}).encode()
        async for item in asgi_request(self.service.app, method, path, body, {"content-type": "application/json"}):
            if isinstance(item, tuple):
                item = (item[0], {**item[1], "x-canvas-replica": self.name})
            yield item

    def __del__(self) -> None:  # Serve stops the replica: the adapters it unpacked go with it
        shutil.rmtree(getattr(self, "uploads", ""), ignore_errors=True)

    async def health(self) -> dict[str, Any]:
        response = await self.service.health(None)  # type: ignore[arg-type]  # it reads nothing of the request
        return {**json.loads(response.body), "replica": self.name}

    def check_health(self) -> None:
        """Serve's periodic health check: a replica whose step thread died is restarted."""
        if not self.service.batcher.alive():
            raise RuntimeError("the engine's step thread is gone")


# -- the gateway -------------------------------------------------------------------------------------------------


class _Refused(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.headers = status, headers or {}


class Gateway:
    """Serve's HTTP ingress: who asks (bearer token), how often (rate limit), which replica (the route key), and
    the per-user counts in /metrics. It never logs or counts code: only users, endpoints, statuses and sizes."""

    def __init__(self, engines: DeploymentHandle, options: dict[str, Any]) -> None:
        self.options = TeamOptions(**options)
        self.engines = engines
        self.users = TokenFile(self.options.tokens) if self.options.tokens else None
        self.limit = RateLimit(self.options.rate, self.options.burst)
        registry = self.registry = CollectorRegistry()
        self.m_requests = Counter("canvas_team_requests", "Requests by user, endpoint and status",
                                  ["user", "endpoint", "status"], registry=registry)  # fmt: skip
        self.m_latency = Histogram("canvas_team_latency_seconds", "Latency through the gateway by user", ["user"],
                                   registry=registry, buckets=(0.025, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10))  # fmt: skip
        self.m_tokens = Counter("canvas_team_tokens", "Tokens answered by user", ["user"], registry=registry)
        self.m_replica = Counter("canvas_team_replica_requests", "Requests answered by replica", ["replica"],
                                 registry=registry)  # fmt: skip
        self.m_reused = Counter("canvas_team_prefix_reused_tokens", "Prefix tokens a replica's cache did not "
                                "re-encode", registry=registry)  # fmt: skip
        self.m_prefix = Counter("canvas_team_prefix_tokens", "Prefix tokens of answered requests", registry=registry)
        self.m_retries = Counter("canvas_team_retries", "Requests sent again after their replica died",
                                 registry=registry)  # fmt: skip
        self.uploads: OrderedDict[str, Any] = OrderedDict()  # an uploaded adapter's name -> its bytes in Ray's store

    def __serve_build_asgi_app__(self) -> Starlette:
        return Starlette(routes=[
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            *(Route(path, self.forward, methods=["POST"]) for path in ("/v1/infill", "/v1/fill", "/v1/completions")),
            Route("/v1/adapters/{digest}", self.upload, methods=["PUT"]),
        ])  # fmt: skip

    def _user(self, request: Request, endpoint: str) -> str:
        if self.users is None:
            return "local"
        user = self.users.user(request.headers.get("authorization"))
        if user is None:
            self.m_requests.labels("", endpoint, "401").inc()
            raise _Refused(401, "missing, wrong or revoked bearer token")
        return user

    async def health(self, request: Request) -> Response:
        try:
            self._user(request, "health")
        except _Refused as exc:
            return _refusal(exc)
        try:
            replica = await asyncio.wait_for(self.engines.health.remote(), timeout=10)
        except Exception as exc:  # no replica ready: say so with what Serve knows
            return JSONResponse({"status": "unavailable", "api": API_VERSION, "error": str(exc).splitlines()[0],
                                 "deployment": _deployment_status()}, 503)  # fmt: skip
        return JSONResponse({**replica, "deployment": _deployment_status(), "router": self.options.router})

    async def metrics(self, request: Request) -> Response:
        try:
            self._user(request, "metrics")
        except _Refused as exc:
            return _refusal(exc)
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    async def upload(self, request: Request) -> Response:
        """`PUT /v1/adapters/{sha256}`: a workspace's LoRA adapter (`adapter_files.pack`'s archive), kept in Ray's
        object store for the replicas (the newest `ADAPTERS_UPLOADED`); requests then name it `sha256:{digest}`."""
        try:
            user = self._user(request, "adapters")
            data = await _body(request, MAX_ADAPTER_BYTES)
            name = ADAPTER_PREFIX + request.path_params["digest"]
            if name_of(data) != name:
                raise _Refused(400, "the archive's SHA-256 is not the digest in the path")
            check(data)
        except AdapterArchiveError as exc:
            self.m_requests.labels(user, "adapters", "400").inc()
            return _refusal(_Refused(400, f"not an adapter: {exc}"))
        except _Refused as exc:
            return _refusal(exc)
        self.uploads[name] = ray.put(data)
        self.uploads.move_to_end(name)
        while len(self.uploads) > ADAPTERS_UPLOADED:
            self.uploads.popitem(last=False)
        self.m_requests.labels(user, "adapters", "201").inc()
        return JSONResponse({"adapter": name, "bytes": len(data)}, 201)

    async def forward(self, request: Request) -> Response:
        endpoint = request.url.path.rsplit("/", 1)[-1]
        started = time.perf_counter()
        try:
            user = self._user(request, endpoint)
            wait = self.limit.take(user)
            if wait > 0:
                self.m_requests.labels(user, endpoint, "429").inc()
                raise _Refused(429, f"over the rate limit of {self.options.rate:g} requests a second",
                               {"retry-after": str(math.ceil(wait))})  # fmt: skip
            body = await _body(request)
        except _Refused as exc:
            return _refusal(exc)
        document, adapter = _routing(body)
        uploaded = None
        if adapter.startswith(ADAPTER_PREFIX):  # an uploaded adapter: its bytes go along, for a replica without it
            if adapter not in self.uploads:
                self.m_requests.labels(user, endpoint, "404").inc()
                upload = f"/v1/adapters/{adapter.removeprefix(ADAPTER_PREFIX)}"
                return JSONResponse({"error": f"adapter {adapter} is not uploaded here", "upload": upload}, 404)
            self.uploads.move_to_end(adapter)
            uploaded = [self.uploads[adapter]]
        first, rest = await self._send(request, endpoint, body, f"{user}\0{document}", adapter, uploaded)
        if first is None:
            self.m_requests.labels(user, endpoint, "499").inc()
            return Response(status_code=499)
        status, headers = first
        self.m_requests.labels(user, endpoint, str(status)).inc()
        passed = {name: headers[name] for name in ("x-canvas-replica", API_HEADER) if name in headers}
        if headers.get("content-type", "").startswith("text/event-stream"):
            return StreamingResponse(_chunks(rest), status, media_type="text/event-stream", headers=passed)
        content = b"".join([chunk async for chunk in _chunks(rest)])
        self.m_latency.labels(user).observe(time.perf_counter() - started)
        self._count(user, headers.get("x-canvas-replica", ""), status, content)
        return Response(content, status, media_type=headers.get("content-type"), headers=passed)

    async def _send(self, request: Request, endpoint: str, body: bytes, route_key: str, adapter: str,
                    uploaded: list[Any] | None = None) -> tuple[tuple[int, dict[str, str]] | None, Any]:  # fmt: skip
        """The replica's first answer (status, headers) and the stream of the rest; (None, None) when the client
        left first (the Serve call is cancelled: the replica's engine stops the work). A replica that died before
        answering: the request goes again, to another replica, up to RETRIES times."""
        for attempt in range(RETRIES + 1):
            engines = self.engines.options(stream=True, multiplexed_model_id=adapter)
            stream = engines.call.remote("POST", request.url.path, body, route_key=route_key, uploaded=uploaded)
            first = asyncio.ensure_future(stream.__anext__())
            gone = asyncio.ensure_future(_disconnected(request))
            try:
                await asyncio.wait({first, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
            if not first.done():
                first.cancel()
                stream.cancel()
                return None, None
            try:
                return first.result(), stream
            except RayActorError as exc:  # the replica died (killed, out of memory): Serve restarts it
                if attempt == RETRIES:
                    return (503, {"content-type": "application/json"}), _one(json.dumps(
                        {"error": f"the deployment's replicas failed {RETRIES + 1} times: {exc}".splitlines()[0]}
                    ).encode())  # fmt: skip
                self.m_retries.inc()
                log.warning("replica died before answering (%s); sending the %s request again", type(exc).__name__,
                            endpoint)  # fmt: skip
        raise AssertionError("unreachable")

    def _count(self, user: str, replica: str, status: int, content: bytes) -> None:
        if replica:
            self.m_replica.labels(replica).inc()
        if status != 200:
            return
        try:
            result = json.loads(content)
        except ValueError:
            return
        if "tokens" in result:  # /v1/infill and /v1/fill: the engine's InfillResult
            self.m_tokens.labels(user).inc(len(result["tokens"]))
            self.m_reused.inc(result.get("prefix_reused_tokens", 0))
            self.m_prefix.inc(result.get("prefix_tokens", 0))
        elif "usage" in result:  # /v1/completions
            self.m_tokens.labels(user).inc(result["usage"].get("completion_tokens", 0))


async def _chunks(stream: Any) -> AsyncIterator[bytes]:
    try:
        async for chunk in stream:
            yield chunk
    finally:
        if hasattr(stream, "cancel"):
            stream.cancel()  # a client that left mid-stream: the replica stops the work


async def _one(content: bytes) -> AsyncIterator[bytes]:
    yield content


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _body(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise _Refused(413, f"request body of {declared} bytes is over the limit of {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _Refused(413, f"request body over the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _routing(body: bytes) -> tuple[str, str]:
    """The request's document (its routing key with the user) and adapter folder (its replicas); "" for either when
    there is none or the body is not JSON (the replica's engine answers that 400 itself)."""
    try:
        data = json.loads(body)
        document, adapter = data.get("document"), data.get("adapter")
    except (ValueError, AttributeError):
        return "", ""
    return document if isinstance(document, str) else "", adapter if isinstance(adapter, str) else ""


def _refusal(exc: _Refused) -> JSONResponse:
    return JSONResponse({"error": str(exc)}, exc.status, headers=exc.headers)


def _deployment_status() -> dict[str, Any]:
    """The engine deployment's state as Serve reports it (replicas by state, and its message: a replica that
    cannot load its model says why here)."""
    try:
        status = serve.status().applications[APP_NAME].deployments["engine"]
    except Exception as exc:  # the controller unreachable: what we know is that we do not know
        return {"status": "unknown", "message": str(exc).splitlines()[0] if str(exc) else type(exc).__name__}
    state = str(getattr(status.status, "value", status.status))
    return {"status": state, "replicas": {str(k): v for k, v in status.replica_states.items()},
            "message": status.message}  # fmt: skip


# -- the application ---------------------------------------------------------------------------------------------


def application(options: TeamOptions) -> Any:
    """The Serve application: the gateway bound to `options.replicas` engine replicas."""
    router = None
    if options.router == "affinity":
        router = RequestRouterConfig(request_router_class=AffinityRouter,
                                     request_router_kwargs={"spill_queue": options.spill_queue})  # fmt: skip
    engine = serve.deployment(
        EngineReplica, name="engine", num_replicas=options.replicas,
        max_ongoing_requests=max(2 * options.max_batch, 4), health_check_period_s=5,
        ray_actor_options={"num_cpus": options.cpus_per_replica, "num_gpus": options.gpus_per_replica},
        **({"request_router_config": router} if router is not None else {}),
    )  # fmt: skip
    gateway = serve.deployment(serve.ingress()(Gateway), name="gateway", num_replicas=1, max_ongoing_requests=256,
                               ray_actor_options={"num_cpus": 0})  # fmt: skip
    return gateway.bind(engine.bind(asdict(options)), asdict(options))


def build(args: dict[str, Any]) -> Any:
    """The application builder for Serve's own tools: `serve run canvas_ls.engine.team:build model=... replicas=2`
    or a config file's `import_path: canvas_ls.engine.team:build` with `args:` (TeamOptions' fields)."""
    numbers = {"replicas": int, "cpus_per_replica": float, "gpus_per_replica": float, "max_batch": int,
               "spill_queue": int, "rate": float, "burst": int}  # fmt: skip
    return application(TeamOptions(**{k: numbers[k](v) if k in numbers else v for k, v in args.items()}))
