"""`canvas-ls bench infill`: quality and speed on HumanEval-Infilling-format tasks, parallel vs left to right.

Every task is decoded twice with the same model, in the same run: the parallel diffusion decode (the engine's
settings) and the autoregressive-equivalent baseline (one token per forward, left to right, greedy). Reported per
mode: exact match (whitespace-normalised), edit similarity, pass@1 where tests exist (each program runs in its own
`python` subprocess, in a temporary folder, with a timeout and a memory limit; never in-process), median and p95
latency, mean steps, tokens per forward, and the share of empty completions; then the ratios between the modes.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ..engine.engine import Engine
from ..engine.tasks import Task, edit_similarity, load_tasks, machine, normalise, passes

MODES = {"parallel": "diffusion", "left_to_right": "left_to_right"}


def paired_interval(before: list[float], after: list[float], draws: int = 4000, seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of mean(after - before) over the same tasks (resampled together): how far a gain
    measured on this many tasks could be from the gain on the population they were drawn from. It does not hold the
    spread between two training runs of one recipe."""
    diffs = torch.tensor(after, dtype=torch.float64) - torch.tensor(before, dtype=torch.float64)
    if len(diffs) == 0:
        raise ValueError("no tasks to compare")
    picks = torch.randint(len(diffs), (draws, len(diffs)), generator=torch.Generator().manual_seed(seed))
    low, high = torch.quantile(diffs[picks].mean(dim=1), torch.tensor([0.025, 0.975], dtype=torch.float64))
    return float(low), float(high)


class Load:
    """Other processes keeping cores busy (a spin loop each), as many as a run asks for each of its items: one count
    for the whole run (`busy_cores`), or several interleaved in blocks of `block` items (`--busy-cores 0,1`), so that
    an idle and a busy machine are compared in one run, on the same engine, the same caches and the machine's state of
    the moment (two runs one after another differ in all three). After a change the run waits for the engine's thread
    count to follow (`settle`): it measures a steady load, not the second after one starts or stops."""

    def __init__(self, counts: tuple[int, ...], block: int = 4, settle: bool = True):
        if not counts or min(counts) < 0 or block < 1:
            raise ValueError(f"busy cores {counts} in blocks of {block}: counts of 0 or more, blocks of 1 or more")
        self.counts, self.block, self.settle = counts, block, settle
        self.spinners: list[subprocess.Popen[bytes]] = []

    def of(self, index: int) -> int:
        """The busy cores for item `index` of the run."""
        return self.counts[(index // self.block) % len(self.counts)]

    def at(self, index: int) -> int:
        """Make the machine as busy as item `index` asks (waiting to settle after a change); returns the count."""
        count = self.of(index)
        if count != len(self.spinners):
            rising = count > len(self.spinners)
            while len(self.spinners) < count:
                self.spinners.append(subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                                      stdin=subprocess.DEVNULL))  # fmt: skip
            while len(self.spinners) > count:
                self._stop(self.spinners.pop())
            if self.settle:
                time.sleep(settle_s(rising))
        return count

    def close(self) -> None:
        while self.spinners:
            self._stop(self.spinners.pop())

    def __enter__(self) -> Load:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def _stop(spinner: subprocess.Popen[bytes]) -> None:
        spinner.kill()
        spinner.wait()


def settle_s(rising: bool) -> float:
    """How long the engine's thread count takes to follow a load that rose (fewer threads after the first whole sample
    of it: up to two) or fell (more only after `RAISE_AFTER` samples in a row allow them), half a sample to spare."""
    from ..engine.threads import RAISE_AFTER, SAMPLE_S

    return SAMPLE_S * (2.5 if rising else RAISE_AFTER + 1.5)


@contextlib.contextmanager
def busy_cores(count: int) -> Iterator[None]:
    """`count` other processes each keeping a core busy for the block: the machine as busy as a developer's usually is
    (`--busy-cores K`; the run's own warm-up comes after they start)."""
    with Load((count,), settle=False) as load:
        load.at(0)
        yield


def by_load(rows: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Per busy-core count (`row["busy_cores"]`), each of `keys`' p50 and p95 over the rows, and their ratios to the
    first count's (an interleaved run's idle baseline, `--busy-cores 0,1`)."""
    counts = list(dict.fromkeys(row["busy_cores"] for row in rows))
    table: dict[str, dict[str, Any]] = {}
    for count in counts:
        entry: dict[str, Any] = {"n": sum(row["busy_cores"] == count for row in rows)}
        for key in keys:
            entry[key] = latency([row[key] for row in rows if row["busy_cores"] == count and row.get(key) is not None])
            base = table[str(counts[0])][key] if table else entry[key]
            if entry[key]["n"] and base["n"]:
                entry[key]["ratio_p50"] = round(entry[key]["p50_ms"] / base["p50_ms"], 3)
                entry[key]["ratio_p95"] = round(entry[key]["p95_ms"] / base["p95_ms"], 3)
        table[str(count)] = entry
    return table


def format_by_load(table: dict[str, dict[str, Any]], keys: tuple[str, ...]) -> list[str]:
    """`by_load`'s table as lines: per count and key, p50 and p95 and their ratios to the first count."""
    lines = []
    for count, entry in table.items():
        for key in keys:
            s = entry[key]
            if s["n"]:  # no ratio where the first count had none of these requests
                p50, p95 = (f" ({s[ratio]:.2f}x)" if ratio in s else "" for ratio in ("ratio_p50", "ratio_p95"))
                lines.append(f"{count} busy  {key:<10} n={s['n']:<4} p50 {s['p50_ms']:8.1f} ms{p50}"
                             f"   p95 {s['p95_ms']:8.1f} ms{p95}")  # fmt: skip
    return lines


def latency(values: list[float]) -> dict[str, Any]:
    """How many, p50 and p95 of request times in ms (only the count where there are none)."""
    if not values:
        return {"n": 0}
    return {"n": len(values), "p50_ms": statistics.median(values), "p95_ms": percentile(values, 0.95)}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def run_infill(
    engine: Engine,
    dataset: Path,
    limit: int | None = None,
    run_tests: bool = True,
    progress: Callable[[int, int], None] | None = None,
    cursor: str = "task",
) -> dict[str, Any]:
    tasks = load_tasks(dataset, limit, cursor)
    rows: list[dict[str, Any]] = []
    for index, task in enumerate(tasks):
        row: dict[str, Any] = {"task_id": task.task_id}
        for mode, order in MODES.items():
            started = time.perf_counter()
            result = engine.infill(task.prompt, task.suffix, {"order": order})
            latency = (time.perf_counter() - started) * 1000
            passed = passes(task, result.text) if run_tests and task.test and task.entry_point else None
            row[mode] = answer_row(task, result, latency, passed)
        rows.append(row)
        if progress is not None:
            progress(index + 1, len(tasks))
    report: dict[str, Any] = {
        "dataset": str(dataset),
        "tasks": len(tasks),
        "cursor": cursor,
        "model": engine.name,
        "dtype": engine.dtype,
        "quantize": engine.loaded.quantized,
        "settings": engine.settings.to_dict(),
        "machine": machine(),
    }
    for mode in MODES:
        report[mode] = summarise([row[mode] for row in rows])
    par, seq = report["parallel"], report["left_to_right"]
    report["ratios"] = {
        "forward_passes_left_to_right_over_parallel": seq["forward_passes"] / max(par["forward_passes"], 1),
        "wall_time_left_to_right_over_parallel": seq["total_latency_ms"] / max(par["total_latency_ms"], 1e-9),
        "exact_match_difference_points": 100 * (par["exact_match"] - seq["exact_match"]),
        "pass_at_1_difference_points": (
            100 * (par["pass_at_1"] - seq["pass_at_1"]) if par["pass_at_1"] is not None else None
        ),
    }
    report["rows"] = rows
    return report


def answer_row(task: Task, result: Any, latency_ms: float, passed: bool | None = None) -> dict[str, Any]:
    """One answer, judged against the task's solution: what `summarise` adds up."""
    return {
        "text": result.text,
        "exact": normalise(result.text) == normalise(task.solution),
        "edit_similarity": edit_similarity(result.text, task.solution),
        "passed": passed,
        "latency_ms": latency_ms,
        "steps": result.steps,
        "forward_passes": result.forward_passes,
        "produced": result.tokens_per_forward * result.forward_passes,
        "empty": result.text.strip() == "",
        "min_confidence": min(result.confidence, default=None),  # for calibrating a display threshold
    }


def summarise(results: list[dict[str, Any]]) -> dict[str, Any]:
    latencies = [r["latency_ms"] for r in results]
    tested = [r["passed"] for r in results if r["passed"] is not None]
    forwards = sum(r["forward_passes"] for r in results)
    written = [r for r in results if not r["empty"]]  # where the model wrote something: the parallel decode's case
    return {
        "exact_match": statistics.fmean(r["exact"] for r in results),
        "edit_similarity": statistics.fmean(r["edit_similarity"] for r in results),
        "pass_at_1": statistics.fmean(tested) if tested else None,
        # passes by answers that wrote something (an empty answer passes when the tests do not need its line)
        "pass_at_1_written": (
            statistics.fmean(bool(r["passed"]) and not r["empty"] for r in results if r["passed"] is not None)
            if tested
            else None
        ),
        "median_latency_ms": statistics.median(latencies),
        "p95_latency_ms": percentile(latencies, 0.95),
        "total_latency_ms": sum(latencies),
        "mean_steps": statistics.fmean(r["steps"] for r in results),
        "forward_passes": forwards,
        "tokens_per_forward": sum(r["produced"] for r in results) / max(forwards, 1),
        "tokens_per_forward_nonempty": (
            sum(r["produced"] for r in written) / max(sum(r["forward_passes"] for r in written), 1) if written else None
        ),
        "empty_share": statistics.fmean(r["empty"] for r in results),
    }


def prefix_latency(engine: Engine, filler: str, prefix_tokens: int, runs: int = 7) -> dict[str, Any]:
    """Median single-line completion latency with a prefix of about `prefix_tokens` tokens."""
    ids = engine.tokenizer.encode(filler * (1 + 4 * prefix_tokens // max(1, len(filler))), add_special_tokens=False)
    prefix = engine.tokenizer.decode(ids[-prefix_tokens:]) + "\n    "
    overrides = {"max_prefix_tokens": prefix_tokens + 8, "max_new_tokens": engine.settings.gap_tokens}
    engine.infill(prefix, "\n", overrides)  # warm-up, reported apart
    times = []
    for seed in range(runs):
        started = time.perf_counter()
        engine.infill(prefix, "\n", {**overrides, "seed": seed})
        times.append((time.perf_counter() - started) * 1000)
    return {"prefix_tokens": prefix_tokens, "runs": runs, "median_ms": statistics.median(times), "all_ms": times}


@contextlib.contextmanager
def figure(path: Path, size: tuple[float, float], columns: int = 1) -> Any:
    """A benchmark's PNG: yields (figure, axes) from matplotlib (one axis, or a list of `columns`); on leaving,
    every axis gets a light grid and its legend, and the figure is laid out and written to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn, axes = plt.subplots(1, columns, figsize=size)
    try:
        yield drawn, axes
        for axis in axes if columns > 1 else [axes]:
            axis.grid(alpha=0.3)
            axis.legend(fontsize=8)
        drawn.tight_layout()
        drawn.savefig(path, dpi=120)
    finally:
        plt.close(drawn)


def format_table(report: dict[str, Any]) -> str:
    model = f"model {report['model']} ({report.get('dtype', '?')})"
    where = "" if report.get("cursor", "task") == "task" else f" (cursor: {report['cursor']})"
    lines = [f"{report['tasks']} tasks from {report['dataset']}{where}", model, report["machine"], ""]
    header = f"{'':<16}{'exact':>8}{'edit sim':>10}{'pass@1':>8}{'(written)':>10}{'p50 ms':>9}{'p95 ms':>9}{'steps':>7}"
    header += f"{'tok/fwd':>9}{'(written)':>10}{'empty':>7}"
    lines.append(header)
    for mode in MODES:
        s = report[mode]
        pass_at_1 = f"{100 * s['pass_at_1']:.1f}" if s["pass_at_1"] is not None else "-"
        pass_written = f"{100 * s['pass_at_1_written']:.1f}" if s.get("pass_at_1_written") is not None else "-"
        nonempty = s.get("tokens_per_forward_nonempty")
        written = f"{nonempty:.2f}" if nonempty is not None else "-"
        lines.append(
            f"{mode:<16}{100 * s['exact_match']:>8.1f}{100 * s['edit_similarity']:>10.1f}"
            f"{pass_at_1:>8}{pass_written:>10}"
            f"{s['median_latency_ms']:>9.1f}{s['p95_latency_ms']:>9.1f}{s['mean_steps']:>7.2f}"
            f"{s['tokens_per_forward']:>9.2f}{written:>10}{100 * s['empty_share']:>7.1f}"
        )
    r = report["ratios"]
    lines.append("")
    lines.append(f"forward passes, left-to-right / parallel: {r['forward_passes_left_to_right_over_parallel']:.2f}x")
    lines.append(f"wall time, left-to-right / parallel:      {r['wall_time_left_to_right_over_parallel']:.2f}x")
    lines.append(f"exact match, parallel - left-to-right:    {r['exact_match_difference_points']:+.1f} points")
    if r["pass_at_1_difference_points"] is not None:
        lines.append(f"pass@1, parallel - left-to-right:         {r['pass_at_1_difference_points']:+.1f} points")
    if "prefix_latency" in report:
        p = report["prefix_latency"]
        lines.append(f"single-line completion, {p['prefix_tokens']}-token prefix: median {p['median_ms']:.1f} ms")
    return "\n".join(lines)


# -- `canvas-ls bench sampler`: the per-step sampler work, torch vs the fused kernel ------------------------------


def _torch_step(logits: torch.Tensor, temperature: float, generator: torch.Generator, sampler, stopping) -> None:
    """What transformers' DiffusionGemma step does with the logits: scale, softmax, sample, argmax, accept, stop."""
    scaled = logits / temperature
    probs = torch.softmax(scaled, dim=-1, dtype=torch.float32)
    sample = torch.multinomial(probs.view(-1, probs.shape[-1]), 1, generator=generator).view(probs.shape[:-1])
    argmax = scaled.argmax(dim=-1)
    sampler.accept_canvas(argmax, sample, scaled, 1)
    stopping(argmax, scaled)


def _fused_step(logits: torch.Tensor, temperature: float, generator: torch.Generator, sampler, stopping) -> None:
    from ..engine.sampling import step_stats_fused

    stats = step_stats_fused(logits.view(-1, logits.shape[-1]), temperature, generator)
    shape = logits.shape[:-1]
    sampler.accept_entropy(stats.argmax.view(shape), stats.sample.view(shape), stats.entropy.view(shape))
    stopping(stats.argmax.view(shape), token_entropy=stats.entropy.view(shape))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device, runs: int, warmup: int = 2) -> float:
    """Median milliseconds of `runs` calls after `warmup` untimed ones (the GPU synchronised around each)."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        synchronize(device)
        samples.append((time.perf_counter() - started) * 1000)
    return statistics.median(samples)


def run_sampler(device: str | None = None, canvases: tuple[int, ...] = (64, 256),
                vocabs: tuple[int, ...] = (8192, 262144), steps: int = 20) -> dict[str, Any]:  # fmt: skip
    """Median milliseconds per step, torch vs fused (fused only where the kernel runs: CUDA with triton)."""
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

    from ..engine.sampling import EntropyStableAndConfident, SeededEntropyBoundSampler, fused_available

    target = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    fused_ok = fused_available(target) and target.type == "cuda"
    rows = []
    for canvas in canvases:
        for vocab in vocabs:
            generator = torch.Generator(device=target).manual_seed(0)
            logits = torch.randn(1, canvas, vocab, device=target, generator=generator) * 3
            config = EntropyBoundSamplerConfig(entropy_bound=0.1)
            row: dict[str, Any] = {"canvas": canvas, "vocab": vocab}
            for name, step in (("torch", _torch_step), ("fused", _fused_step)):
                if name == "fused" and not fused_ok:
                    row[name + "_ms"] = None
                    continue
                sampler = SeededEntropyBoundSampler(config, canvas, vocab, steps, generator)
                stopping = EntropyStableAndConfident(1, 0.005)
                call = functools.partial(step, logits, 0.7, generator, sampler, stopping)
                row[name + "_ms"] = timed(call, target, steps, warmup=1)  # the warm-up compiles the kernel
            row["speedup"] = row["torch_ms"] / row["fused_ms"] if row["fused_ms"] else None
            rows.append(row)
    return {"device": str(target), "machine": machine(), "steps": steps, "rows": rows}


def format_sampler(report: dict[str, Any]) -> str:
    lines = [report["machine"], f"device {report['device']}, median of {report['steps']} steps", ""]
    lines.append(f"{'canvas':>7}{'vocab':>9}{'torch ms':>11}{'fused ms':>11}{'speedup':>9}")
    for row in report["rows"]:
        fused = f"{row['fused_ms']:.3f}" if row["fused_ms"] is not None else "-"
        speedup = f"{row['speedup']:.2f}x" if row["speedup"] else "-"
        lines.append(f"{row['canvas']:>7}{row['vocab']:>9}{row['torch_ms']:>11.3f}{fused:>11}{speedup:>9}")
    if any(row["fused_ms"] is None for row in report["rows"]):
        lines.append("\nfused: the Triton kernel runs on CUDA only (its CPU interpreter is for tests, not timing)")
    return "\n".join(lines)


# -- `canvas-ls bench engine`: the resident engine over its socket: prefix reuse and concurrency ------------------


def filler_code() -> str:
    """Real Python code to make long prefixes of: this package's own canvas module (it ships in every install, where
    the repository's fixtures do not)."""
    from ..engine import canvas

    return Path(canvas.__file__).read_text(encoding="utf-8")


def run_engine_bench(
    model: str | None,
    prefixes: tuple[int, ...] = (256, 1024, 4096),
    clients: tuple[int, ...] = (1, 4, 8),
    runs: int = 5,
    per_client: int = 8,
    dtype: str = "auto",
    settings: dict[str, Any] | None = None,
    engine_args: list[str] | None = None,
) -> dict[str, Any]:
    """Start `canvas-ls engine` (with `engine_args`, e.g. an adapter or compile) on a private socket and measure it
    as editors would use it (every request with `settings` on top of the benchmark's own)."""

    import httpx

    filler = filler_code()
    with engine_process(model, dtype, engine_args) as (client, socket):
        tokenizer_ratio = 3.3  # characters per token, for sizing the prefixes (the result reports exact counts)

        def prefix_of(tokens: int, tag: str) -> str:
            text = filler * (1 + int(tokens * tokenizer_ratio) // len(filler))
            return f"# {tag}\n" + text[-int(tokens * tokenizer_ratio) :] + "\n    "

        def infill(prefix: str, http: httpx.Client = client, **extra: Any) -> tuple[float, dict[str, Any]]:
            sent = {"max_prefix_tokens": 8192, "max_new_tokens": 16, "gap_tokens": 16, **(settings or {}), **extra}
            started = time.perf_counter()
            result = http.post("/v1/infill", json={"prefix": prefix, "suffix": "\n", "settings": sent}).json()
            return (time.perf_counter() - started) * 1000, result

        infill(prefix_of(64, "warm-up"))
        prefix_rows = []
        for size in prefixes:
            # One keystroke after a request on the same document, timed twice on the very same text: warm (the
            # snapshot the previous request left is reused) and cold (reuse off: the whole prefix encoded). Same
            # text and seed, so both denoise alike and the difference is the prefix work; the order alternates.
            cold, warm, reused, same, tokens = [], [], [], 0, 0
            for run in range(runs):
                base = prefix_of(size, f"document {size} {run}")  # a first line never seen: nothing to reuse
                infill(base)  # the previous keystroke's request
                typed = base + "x"
                timed = [("cold", {"reuse_prefix": False}), ("warm", {})]
                answers = {}
                for kind, extra in timed if run % 2 == 0 else timed[::-1]:
                    ms, answers[kind] = infill(typed, **extra)
                    (cold if kind == "cold" else warm).append(ms)
                tokens = answers["cold"]["prefix_tokens"]
                reused.append(answers["warm"]["prefix_reused_tokens"])
                same += answers["cold"]["tokens"] == answers["warm"]["tokens"]
            cold_ms, warm_ms = statistics.median(cold), statistics.median(warm)
            row = {"prefix_tokens": tokens, "cold_ms": cold_ms, "warm_ms": warm_ms, "same_answer": same / runs}
            prefix_rows.append({**row, "warm_over_cold": warm_ms / cold_ms, "reused_tokens": statistics.median(reused)})
        throughput_rows = [
            {"mode": mode, "clients": count, **_throughput(socket, count, per_client, mode, prefix_of, infill)}
            for mode in ("new", "typing")
            for count in clients
        ]
        for row in throughput_rows:
            single = next(r for r in throughput_rows if r["mode"] == row["mode"] and r["clients"] == clients[0])
            row["vs_one_client"] = row["requests_per_s"] / single["requests_per_s"]
        health = client.get("/health").json()
        return {"machine": machine(), "model": model or "(default)", "dtype": health["dtype"],
                "settings": settings or {}, "prefix": prefix_rows, "throughput": throughput_rows,
                "steps": _step_costs(client.get("/metrics").text)}  # fmt: skip


@contextlib.contextmanager
def engine_process(model: str | None, dtype: str = "auto", engine_args: list[str] | None = None,
                   timeout_s: float = 300) -> Iterator[tuple[Any, Path]]:  # fmt: skip
    """`canvas-ls engine` (with `engine_args`: an adapter, --compile...) on a private socket, up and its decoder
    compiled when asked to, before anything is timed: its HTTP client and socket; killed after."""
    import httpx

    folder = Path(tempfile.mkdtemp(prefix="canvas-ls-bench-"))
    socket = folder / "engine.sock"
    command = [sys.executable, "-m", "canvas_ls.server.cli", "engine", "--socket", str(socket), "--idle-exit", "0",
               "--dtype", dtype]  # fmt: skip
    command += (["--model", model] if model else []) + (engine_args or [])
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL)
    client = _engine_client(socket)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(httpx.HTTPError):
                health = client.get("/health")
                if health.status_code == 200 and health.json()["compile"]["state"] != "warming":
                    break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the engine did not come up ({' '.join(command)}: exit {process.poll()})")
            time.sleep(0.1)
        yield client, socket
    finally:
        client.close()
        process.kill()
        process.wait()


TYPED = "total = compute(values, weights)"


def engine_compile(model: str | None, device: str | None = None) -> dict[str, Any] | None:
    """The resident engine's compiled-step report (its /health) for this model and device: its state ("warming"
    until its graphs are loaded or compiled), which steps ran compiled. None where no engine answers."""
    from ..engine.paths import default_socket
    from ..server.backend import engine_health

    health = engine_health(default_socket(model, device), timeout=5.0)
    return health.get("compile") if health else None


def wait_compiled(model: str | None, device: str | None = None, timeout_s: float = 600.0) -> None:
    """Until the resident engine of this model and device has its compiled step (loaded, compiled, or off): a new
    engine serves eager steps until its graphs load (seconds) or compile (a minute or two the first time on a
    machine), and a bench measures the steady state (`bench warmup` times the start)."""
    deadline = time.monotonic() + timeout_s
    while (engine_compile(model, device) or {}).get("state") == "warming":
        if time.monotonic() > deadline:
            raise TimeoutError(f"the engine's compiled step was not ready after {timeout_s:.0f} s")
        time.sleep(0.5)


def _engine_client(socket: Path) -> Any:
    """An HTTP client for the engine on its unix socket (one per benchmark client thread)."""
    import httpx

    return httpx.Client(transport=httpx.HTTPTransport(uds=str(socket)), base_url="http://engine", timeout=600)


def _step_costs(metrics: str) -> list[dict[str, Any]]:
    """Mean denoising-step time by rows in the batch, from the engine's own /metrics: what a shared forward costs
    as it carries more requests (the ceiling on what batching can give on this machine)."""
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[int, dict[str, float]] = {}
    for family in text_string_to_metric_families(metrics):
        if family.name != "canvas_step_seconds":
            continue
        for sample in family.samples:
            kind = sample.name.removeprefix("canvas_step_seconds_")
            if kind in ("sum", "count"):
                sums.setdefault(int(sample.labels["rows"]), {})[kind] = sample.value
    rows = [{"rows": n, "steps": int(v["count"]), "mean_ms": 1000 * v["sum"] / v["count"]}
            for n, v in sorted(sums.items()) if v.get("count")]  # fmt: skip
    one = next((r["mean_ms"] for r in rows if r["rows"] == 1), None)
    for row in rows:
        row["per_row_vs_one"] = row["mean_ms"] / row["rows"] / one if one else None
    return rows


def _throughput(socket: Path, count: int, per_client: int, mode: str, prefix_of: Callable[[int, str], str],
                infill: Callable[..., tuple[float, dict[str, Any]]]) -> dict[str, Any]:  # fmt: skip
    """`count` clients, each sending `per_client` requests back to back on 256-token prefixes. "new": every request
    a document never seen (the whole prefix encoded). "typing": each client types into its own document, one
    character per request (its first, cold request is sent before the clock starts)."""
    import concurrent.futures

    def document(index: int) -> str:
        return prefix_of(256, f"{mode} {count} {index}")

    def warm(index: int) -> None:
        with _engine_client(socket) as http:
            infill(document(index), http)

    def one_client(index: int) -> int:
        with _engine_client(socket) as http:
            for request in range(per_client):
                if mode == "typing":
                    infill(document(index) + TYPED[: request + 1], http)
                else:
                    infill(prefix_of(256, f"{mode} {count} {index} {request}"), http)
        return per_client

    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        if mode == "typing":
            list(pool.map(warm, range(count)))
        started = time.perf_counter()
        done = sum(pool.map(one_client, range(count)))
        seconds = time.perf_counter() - started
    return {"requests": done, "seconds": seconds, "requests_per_s": done / seconds}


def format_engine(report: dict[str, Any]) -> str:
    lines = [
        f"model {report['model']} ({report.get('dtype', '?')}), settings {report.get('settings') or 'default'}",
        report["machine"],
        "",
        "prefix reuse (median ms per request):",
    ]
    lines.append(f"{'tokens':>8}{'cold':>10}{'warm':>10}{'warm/cold':>11}{'reused':>9}{'same answer':>13}")
    for row in report["prefix"]:
        times = f"{row['cold_ms']:>10.1f}{row['warm_ms']:>10.1f}{row['warm_over_cold']:>11.2f}"
        lines.append(f"{row['prefix_tokens']:>8}{times}{row['reused_tokens']:>9.0f}{row['same_answer']:>13.0%}")
    lines += ["", "throughput (256-token prefixes; new: a new document per request, typing: a keystroke each):"]
    lines.append(f"{'mode':>8}{'clients':>9}{'req/s':>9}{'vs 1':>7}")
    for row in report["throughput"]:
        lines.append(f"{row['mode']:>8}{row['clients']:>9}{row['requests_per_s']:>9.2f}{row['vs_one_client']:>7.2f}")
    lines += ["", "denoising step by rows sharing it (the engine's /metrics):", f"{'rows':>6}{'steps':>8}{'ms':>8}"
              f"{'per row vs 1':>14}"]  # fmt: skip
    for row in report.get("steps", []):
        ratio = f"{row['per_row_vs_one']:.2f}" if row["per_row_vs_one"] else "-"
        lines.append(f"{row['rows']:>6}{row['steps']:>8}{row['mean_ms']:>8.1f}{ratio:>14}")
    return "\n".join(lines)


# -- `canvas-ls bench train`: what one training step costs ----------------------------------------------------------


def run_train_bench(preset: str = "cpu", steps: int = 5, runs: int = 3) -> dict[str, Any]:
    """Seconds per training step of the preset's model (fresh weights, the shipped tokenizer, batches cut from this
    machine's sources as `canvas-ls train` cuts them), with the LM head's loss fused (engine/loss.py) and plain.
    The two alternate on the same batches, `runs` times `steps` steps each, after one warm-up step each."""
    from transformers import AutoTokenizer

    from ..engine import DEFAULT_MODEL_DIR, corpus
    from ..engine.examples import ExampleSampler, collate
    from ..engine.loading import quiet_libraries, resolve_device
    from ..engine.training import PRESETS, TrainConfig, preset_model, train_step

    quiet_libraries()
    cfg = TrainConfig(**PRESETS[preset]["train"])
    device = resolve_device(cfg.device)
    tokenizer = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR))
    torch.manual_seed(0)
    model = preset_model(preset, len(tokenizer)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sampler = ExampleSampler(corpus.collect(4_000_000), tokenizer, 0, cfg.prefix_tokens, cfg.head_tokens)
    batches = [
        (collate([sampler.example(gap) for _ in range(cfg.batch_size)], tokenizer.pad_token_id).to(device), self_cond)
        for gap in cfg.gap_choices
        for self_cond in (False, True)
    ]
    generator = torch.Generator(device=device).manual_seed(0)

    def step(index: int, fused: bool) -> float:
        batch, self_condition = batches[index % len(batches)]
        started = time.perf_counter()
        train_step(model, optimizer, batch, generator, cfg, self_condition, fused_head=fused)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - started

    seconds: dict[str, list[float]] = {"fused": [], "plain": []}
    for fused in (True, False):
        step(0, fused)
    for run in range(runs):
        for name in ("fused", "plain") if run % 2 == 0 else ("plain", "fused"):
            seconds[name].append(statistics.fmean(step(i, name == "fused") for i in range(steps)))
    rows = {name: statistics.median(values) for name, values in seconds.items()}
    tokens = statistics.fmean(int(b.prefix_mask.sum()) + b.gap.numel() + int(b.head_mask.sum()) for b, _ in batches)
    return {
        "machine": machine(),
        "preset": preset,
        "parameters": sum(p.numel() for p in model.parameters()),
        "batch_size": cfg.batch_size,
        "tokens_per_step": tokens,
        "device": str(device),
        "seconds_per_step": rows,
        "runs": seconds,
        "plain_over_fused": rows["plain"] / rows["fused"],
    }


def format_train(report: dict[str, Any]) -> str:
    lines = [
        f"preset {report['preset']}: {report['parameters'] / 1e6:.1f} M parameters, batch {report['batch_size']}, "
        f"{report['tokens_per_step']:.0f} tokens per step",
        f"{report['machine']}; on {report['device']}",
        "",
        f"{'LM head loss':<14}{'s/step':>8}{'examples/s':>12}{'tokens/s':>10}",
    ]
    for name, seconds in report["seconds_per_step"].items():
        rate = report["batch_size"] / seconds
        lines.append(f"{name:<14}{seconds:>8.3f}{rate:>12.1f}{report['tokens_per_step'] / seconds:>10.0f}")
    lines.append(f"\nplain / fused: {report['plain_over_fused']:.2f}x")
    return "\n".join(lines)
