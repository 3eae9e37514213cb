"""`canvas-ls bench team`: N simulated editors typing through the language server's remote backend into a Ray Serve
deployment (`canvas-ls team serve`'s application), each with its own document and user token; and, in the same run,
the same clients on one resident engine (`canvas-ls engine`) as the reference.

Each client types into its own document, one character per request, back to back, for `seconds`: what a developer's
editor sends while they type. Reported per system: latency p50/p95, requests a second, the prefix-cache hit rate (the
share of requests whose prefix KV a replica already held) and the share of prefix tokens reused, per-user fairness
(the slowest user's p95 over the fastest's), requests lost (a Failed reply: must be 0), and replicas killed
(`fault_every_s`) or replaced by a rolling upgrade (`upgrade`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..engine.tasks import machine
from .core import engine_process, filler_code, percentile

TYPED = "    total = compute(values, weights) + offset * scale\n"
PREFIX_CHARS = 1200  # about 350 tokens of real code before the cursor
KEYS_PER_VISIT = 4  # with several documents per client: characters typed into one before moving to the next
REPLICA_PROCESS = "ray::ServeReplica:canvas-ls:engine"


def run(model: str | None, clients: int = 8, replicas: int = 2, routers: tuple[str, ...] = ("affinity", "pow2"),
        seconds: float = 60.0, fault_every_s: float | None = None, upgrade: bool = False, documents: int = 1,
        progress: Callable[[str], None] = print) -> dict[str, Any]:  # fmt: skip
    cpus = max(1, (os.cpu_count() or 1) // replicas)  # the machine's cores shared out: one replica gets them all
    """The reference (one resident engine), then a deployment per router; the same clients and workload each time."""
    rows, requests = [], []
    progress(f"reference: one resident engine, {clients} clients typing for {seconds:g} s")
    with engine_process(model) as (_, socket):
        row, done = _clients("resident engine", lambda user: _resident(socket, model), clients, seconds, model,
                             documents)  # fmt: skip
        rows.append(row)
        requests += done
    for router in routers:
        progress(f"team: {replicas} replicas, router {router}, {clients} clients typing for {seconds:g} s"
                 + (f", a replica killed every {fault_every_s:g} s" if fault_every_s else "")
                 + (", a rolling upgrade midway" if upgrade else ""))  # fmt: skip
        with _deployment(model, replicas, router, cpus) as (url, tokens, redeploy):
            chaos = _Chaos(fault_every_s, redeploy if upgrade else None, seconds)
            with chaos.running():
                row, done = _clients(f"team {router} x{replicas}", lambda user: _remote(url, tokens, user), clients,
                                     seconds, model, documents)  # fmt: skip
            row.update(kills=chaos.kills, upgrades=chaos.upgrades)
        rows.append(row)
        requests += done
    reference = rows[0]
    for row in rows:
        row["p50_vs_reference"] = row["p50_ms"] / reference["p50_ms"]
        row["hit_rate_vs_reference"] = row["hit_rate"] / reference["hit_rate"] if reference["hit_rate"] else None
    return {"machine": machine(), "model": model or "(default)", "clients": clients, "replicas": replicas,
            "cpus_per_replica": cpus, "documents": documents,
            "seconds": seconds, "fault_every_s": fault_every_s, "upgrade": upgrade, "rows": rows,
            "requests": requests}  # fmt: skip


# -- the systems under test --------------------------------------------------------------------------------------


def _resident(socket: Path, model: str | None) -> Any:
    from ..server.backend import ResidentBackend

    return ResidentBackend(str(socket), model=model, device="auto")


def _remote(url: str, tokens: Path, user: str) -> Any:
    from ..engine.users import add_user
    from ..server.backend import RemoteBackend

    return RemoteBackend(url, add_user(tokens, user))


@contextlib.contextmanager
def _deployment(model: str | None, replicas: int, router: str,
                cpus: int) -> Iterator[tuple[str, Path, Callable[[], None]]]:  # fmt: skip
    """The team application on a local Ray cluster in this process: its URL, its token file, and a function that
    redeploys it with a new code version (Serve's rolling upgrade: new replicas start, old ones drain)."""
    import ray
    from ray import serve

    from ..engine.team import APP_NAME, TeamOptions, application
    from .ar import free_port

    folder = Path(tempfile.mkdtemp(prefix="canvas-ls-team-"))
    tokens = folder / "users"
    tokens.write_text("")
    port = free_port()
    options = TeamOptions(model=model, replicas=replicas, device="cpu", router=router, tokens=str(tokens),
                          cpus_per_replica=cpus, rate=1000.0, burst=1000)  # fmt: skip
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(application(options), name=APP_NAME, route_prefix="/")
        version = [0]

        def redeploy() -> None:
            version[0] += 1  # any change of the options is a new version: Serve replaces the replicas one by one
            serve.run(application(replace(options, spill_queue=options.spill_queue + version[0])), name=APP_NAME,
                      route_prefix="/", blocking=False)  # fmt: skip

        yield f"http://127.0.0.1:{port}", tokens, redeploy
    finally:
        serve.shutdown()
        ray.shutdown()


class _Chaos:
    """While the clients type: a replica's process killed every `every_s` seconds, and/or one rolling upgrade
    half-way through."""

    def __init__(self, every_s: float | None, upgrade: Callable[[], None] | None, seconds: float) -> None:
        self.every_s, self.upgrade, self.seconds = every_s, upgrade, seconds
        self.kills = self.upgrades = 0
        self.stop = threading.Event()

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        thread = threading.Thread(target=self._run, daemon=True)
        thread.start()
        try:
            yield
        finally:
            self.stop.set()
            thread.join()

    def _run(self) -> None:
        started = time.monotonic()
        next_kill = self.every_s
        upgrade_at = self.seconds / 2 if self.upgrade else None
        while not self.stop.wait(0.2):
            elapsed = time.monotonic() - started
            if next_kill is not None and elapsed >= next_kill:
                pids = subprocess.run(["pgrep", "-f", REPLICA_PROCESS], capture_output=True, text=True).stdout.split()
                if pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(random.choice(pids)), signal.SIGKILL)
                        self.kills += 1
                next_kill += self.every_s  # type: ignore[operator]
            if upgrade_at is not None and elapsed >= upgrade_at and self.upgrade is not None:
                self.upgrade()
                self.upgrades, upgrade_at = self.upgrades + 1, None


# -- the clients -------------------------------------------------------------------------------------------------


def _clients(name: str, backend_of: Callable[[str], Any], clients: int, seconds: float, model: str | None,
             documents: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:  # fmt: skip
    """`clients` editors typing for `seconds` into `documents` files each, each through its own backend (its own
    user) asking for `model`: the row and every request."""
    return asyncio.run(_typing(name, backend_of, clients, seconds, model, documents))


async def _typing(name: str, backend_of: Callable[[str], Any], clients: int, seconds: float, model: str | None,
                  documents: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:  # fmt: skip
    from ..engine.results import InfillResult
    from ..server.backend import Answer, CancelFlag, CompletionRequest, Failed, Settings

    filler = filler_code()
    backends = [backend_of(f"editor{i}") for i in range(clients)]
    loop = asyncio.get_running_loop()
    for backend in backends:
        done = asyncio.Event()
        backend.load(model, "auto", lambda _, done=done: loop.call_soon_threadsafe(done.set))
        await done.wait()
        if backend.state != "ready":
            raise RuntimeError(f"{name}: the backend did not connect: {backend.error}")
    requests: list[dict[str, Any]] = []
    deadline = time.monotonic() + seconds

    async def editor(index: int) -> None:
        """Types a few characters into one of its documents, then moves on to the next (a developer between
        files); with one document, types into it throughout."""
        bases = []
        for number in range(documents):
            start = ((index * documents + number) * 7919) % (len(filler) - PREFIX_CHARS)
            bases.append(f"# editor {index}, file {number}\n" + filler[start : start + PREFIX_CHARS])
        typed = [0] * documents
        request = 0
        while time.monotonic() < deadline:
            number = (request // KEYS_PER_VISIT) % documents
            request += 1
            prefix = bases[number] + TYPED[: typed[number] % len(TYPED) + 1]
            typed[number] += 1
            started = time.perf_counter()
            asked = CompletionRequest(prefix, "\n", Settings(max_new_tokens=16), f"file:///team/{index}/{number}.py")
            reply = await backends[index].infill(asked, CancelFlag())
            ms = (time.perf_counter() - started) * 1000
            row = {"system": name, "user": index, "ms": ms, "ok": isinstance(reply, Answer),
                   "failed": reply.reason if isinstance(reply, Failed) else None}  # fmt: skip
            if isinstance(reply, Answer) and isinstance(reply.raw, InfillResult):
                row.update(prefix_tokens=reply.raw.prefix_tokens, reused=reply.raw.prefix_reused_tokens,
                           overhead_ms=ms - (reply.engine_ms or 0.0))  # fmt: skip
            requests.append(row)

    started = time.perf_counter()
    await asyncio.gather(*(editor(i) for i in range(clients)))
    elapsed = time.perf_counter() - started
    for backend in backends:
        backend.shutdown()
    answered = [r for r in requests if r["ok"]]
    ms = [r["ms"] for r in answered] or [float("nan")]
    p95s = [percentile([r["ms"] for r in answered if r["user"] == u], 0.95) for u in range(clients)
            if any(r["user"] == u for r in answered)]  # fmt: skip
    prefix = sum(r.get("prefix_tokens", 0) for r in answered)
    row = {"system": name, "requests": len(requests), "answered": len(answered),
           "lost": sum(1 for r in requests if r["failed"] is not None),
           "first_failures": sorted({r["failed"] for r in requests if r["failed"]})[:3],
           "requests_per_s": len(answered) / elapsed, "p50_ms": percentile(ms, 0.5), "p95_ms": percentile(ms, 0.95),
           "overhead_p50_ms": percentile([r["overhead_ms"] for r in answered if "overhead_ms" in r], 0.5),
           "hit_rate": sum(1 for r in answered if r.get("reused")) / max(1, len(answered)),
           "reused_share": sum(r.get("reused", 0) for r in answered) / max(1, prefix),
           "fairness": max(p95s) / min(p95s) if p95s else None}  # fmt: skip
    return row, requests


# -- the report --------------------------------------------------------------------------------------------------


def format_team(report: dict[str, Any]) -> str:
    lines = [f"{report['machine']}; model {report['model']}; {report['clients']} clients typing into "
             f"{report.get('documents', 1)} document(s) each for "
             f"{report['seconds']:g} s; {report['replicas']} replicas of {report['cpus_per_replica']} CPU"
             + (f"; a replica killed every {report['fault_every_s']:g} s" if report["fault_every_s"] else "")
             + ("; a rolling upgrade midway" if report["upgrade"] else ""), "",
             f"{'system':<22}{'requests':>9}{'lost':>6}{'req/s':>8}{'p50 ms':>9}{'p95 ms':>9}{'p50/ref':>9}"
             f"{'beyond':>8}{'hit rate':>10}{'hit/ref':>9}{'reused':>8}{'fairness':>10}{'kills':>7}"]  # fmt: skip
    for row in report["rows"]:
        hit_ref = f"{row['hit_rate_vs_reference']:.2f}" if row["hit_rate_vs_reference"] is not None else "-"
        fairness = f"{row['fairness']:.2f}" if row["fairness"] is not None else "-"
        lines.append(f"{row['system']:<22}{row['requests']:>9}{row['lost']:>6}{row['requests_per_s']:>8.1f}"
                     f"{row['p50_ms']:>9.1f}{row['p95_ms']:>9.1f}{row['p50_vs_reference']:>9.2f}"
                     f"{row['overhead_p50_ms']:>8.1f}"
                     f"{row['hit_rate']:>10.1%}{hit_ref:>9}{row['reused_share']:>8.1%}{fairness:>10}"
                     f"{row.get('kills', 0):>7}")  # fmt: skip
        for failure in row["first_failures"]:
            lines.append(f"    lost: {failure}")
    lines.append(
        "(hit rate: requests whose prefix KV the engine already held; reused: prefix tokens not re-encoded; "
        "fairness: the slowest user's p95 over the fastest's; lost: requests answered with an error)"
    )
    return "\n".join(lines)


def plot_team(report: dict[str, Any], path: Path) -> Path:
    """Each system's latency per request over the run (a strip per system)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = [row["system"] for row in report["rows"]]
    figure, axis = plt.subplots(figsize=(8, 4))
    axis.boxplot([[r["ms"] for r in report["requests"] if r["system"] == s and r["ok"]] for s in systems],
                 tick_labels=systems)  # fmt: skip
    axis.set_ylabel("ms per request")
    axis.set_title(f"{report['clients']} clients typing; {report['replicas']} replicas", fontsize=9)
    figure.suptitle(report["machine"], fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
