"""`canvas-ls`: the command line.

    canvas-ls complete FILE --line L --character C [--model PATH_OR_ID] [--adapter DIR] [--json]
    canvas-ls fill FILE --hole L:C-L:C [--hole ...] [--rewrite L:C-L:C --strength S] [--json]
    canvas-ls serve [--tcp HOST:PORT]            the language server (stdio by default)
    canvas-ls engine [--socket PATH | --tcp HOST:PORT] [--compile auto|on|off]   the resident engine
    canvas-ls train [--preset cpu|gpu] [--from MODEL] [--corpus DIR] [--workspace DIR] [--lora RANK] [--minutes M]
    canvas-ls models [--json] [--remove DIR]      the workspace models installed
    canvas-ls make-tiny-model DIR                 a tiny random model (tests, the editors' end-to-end runs)
    canvas-ls bench infill|holes|calibrate|crossfile|repo|neovim|lsp|soak|sampler|engine|step|warmup|train ...

Every option: docs/pages/cli.md (written from this parser). Errors are one line on stderr (`canvas-ls: error: ...`)
and exit status 2; stdout carries only the answer.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..engine.addresses import ServeError, check_address, check_host, check_socket
from ..engine.model_source import model_source
from ..engine.paths import IDLE_EXIT_S, MAX_BATCH, MAX_BODY_BYTES, PREFIX_CACHE_MB, default_socket, installation
from .arguments import CliError, host_port, load_engine, model_arguments, parse_settings, settings_argument
from .positions import PositionError, offset_at


def parser(bench: bool = True) -> argparse.ArgumentParser:
    """The whole command line; without `bench`, `canvas-ls bench`'s subcommands left out (every other command:
    `canvas-ls serve` loads nothing of the benchmarks)."""
    parser = argparse.ArgumentParser(prog="canvas-ls", description=__doc__.split("\n\n")[0])
    found = installation()
    version = f"canvas-ls {found['version']} ({found['installation']})"
    parser.add_argument("--version", action="version", version=version)
    commands = parser.add_subparsers(dest="command", required=True)

    complete = commands.add_parser("complete", help="fill the gap at a position in a file and print it")
    complete.add_argument("file", type=Path)
    complete.add_argument("--line", type=int, required=True, help="0-based line (LSP)")
    complete.add_argument("--character", type=int, required=True, help="0-based UTF-16 column (LSP)")
    model_arguments(complete)
    complete.add_argument("--layout", choices=("canvas", "prompt"), help="override the model's layout")
    complete.add_argument("--gap-tokens", type=int)
    complete.add_argument("--max-steps", type=int)
    complete.add_argument("--max-new-tokens", type=int)
    complete.add_argument("--seed", type=int)
    settings_argument(complete)
    complete.add_argument("--json", action="store_true", help="print the whole result object")

    fill = commands.add_parser("fill", help="fill several holes (and rewrite spans) of a file in one canvas")
    fill.add_argument("file", type=Path)
    fill.add_argument("--hole", action="append", default=[], type=_span, metavar="L:C-L:C",
                      help="a range to fill (LSP positions: 0-based line, UTF-16 column; repeatable)")  # fmt: skip
    fill.add_argument("--rewrite", action="append", default=[], type=_span, metavar="L:C-L:C",
                      help="a range to rewrite in place, starting from its current text (repeatable)")  # fmt: skip
    fill.add_argument("--strength", type=float, default=0.5,
                      help="share of a rewrite's tokens renoised before denoising (1: a plain hole)")  # fmt: skip
    model_arguments(fill)
    fill.add_argument("--seed", type=int)
    settings_argument(fill)
    fill.add_argument("--json", action="store_true", help="print each region's answer and the whole result")

    serve = commands.add_parser("serve", help="run the language server (stdio unless --tcp)")
    serve.add_argument("--stdio", action="store_true", help="talk LSP over stdin/stdout (the default)")
    serve.add_argument(
        "--tcp",
        metavar="HOST:PORT",
        help="listen on a TCP address instead (loopback; LSP over TCP has "
        "no authentication: anyone who can connect drives the server)",
    )
    serve.add_argument("--allow-remote", action="store_true", help="let --tcp listen on a non-loopback address")
    serve.add_argument("--log-file", type=Path, help="write logs here instead of stderr")
    serve.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))

    engine = commands.add_parser("engine", help="run the resident engine: one model for every editor")
    engine.add_argument(
        "--socket", type=Path, help="unix socket path (default: in the user's runtime folder, one per model and device)"
    )
    engine.add_argument("--tcp", metavar="HOST:PORT", help="listen on TCP instead (needs --token)")
    engine.add_argument(
        "--token", help="bearer token for TCP (visible in `ps`: prefer $CANVAS_LS_TOKEN or --token-file)"
    )
    engine.add_argument("--token-file", type=Path, help="read the bearer token from this file")
    engine.add_argument("--allow-remote", action="store_true", help="allow a non-loopback --tcp address")
    model_arguments(engine)
    engine.add_argument(
        "--idle-exit", type=float, default=IDLE_EXIT_S, help="exit after this many idle seconds (0: never)"
    )
    engine.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                        help="the engine's own records on stderr (its thread count, compiled graphs, token caches); "
                             "libraries' warnings only")  # fmt: skip
    engine.add_argument("--max-body", type=int, default=MAX_BODY_BYTES, help="largest request body, in bytes")
    engine.add_argument("--max-batch", type=int, default=MAX_BATCH, help="requests that may share decoder forwards")
    engine.add_argument("--prefix-cache-mb", type=int, default=PREFIX_CACHE_MB, help="prefix KV cache bound (0: off)")
    engine.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                        help="compile the batched step's decoder after start (requests run eager meanwhile); auto: "
                             "on, on the CPU by a background process only (1-2 min once, then loaded in ~3 s); "
                             "CANVAS_LS_COMPILE=on|off stands in for auto")  # fmt: skip

    from .train_cli import add_parser as add_train_parser

    add_train_parser(commands)
    from .team_cli import add_parser as add_team_parser

    add_team_parser(commands)
    if bench:  # the benchmarks' parser imports their code's package: only for `canvas-ls bench ...`
        from ..bench.cli import add_parser as add_bench_parser

        add_bench_parser(commands)
    else:
        commands.add_parser("bench", help="benchmarks (figures, not pass/fail)")

    stats = commands.add_parser("stats", help="what canvas-ls showed you and what you took: acceptance, latency, per "
                                "language and model (local only, no code)")  # fmt: skip
    stats.add_argument("--since", help="only the last N days or hours (7d, 12h; default: everything)")
    stats.add_argument("--json", action="store_true", help="the statistics as JSON")
    stats.add_argument("--clear", action="store_true", help="delete every recorded event")
    stats.add_argument("--reset-threshold", action="store_true", help="the display thresholds learned from your "
                       "accepts start again from the models' own (the events stay)")  # fmt: skip
    stats.add_argument("--plot", type=Path, metavar="FILE", help="draw shown and accepted per day and the learned "
                       "thresholds over time into FILE (PNG; needs matplotlib: the bench extra)")  # fmt: skip

    doctor = commands.add_parser("doctor", help="check this installation: Python, torch, the model, the engine, the "
                                 "editors; each problem with its fix")  # fmt: skip
    doctor.add_argument("--model", help="the model to check (default: the shipped one)")
    doctor.add_argument("--device", default="auto", help="cpu, cuda or auto (default)")
    doctor.add_argument("--json", action="store_true", help="the checks as JSON")

    models = commands.add_parser("models", help="the models installed: the shipped default and those tuned on a "
                                 "workspace (`train --workspace`)")  # fmt: skip
    models.add_argument("--remove", type=Path, metavar="DIR", help="delete the model tuned on the repository of DIR")
    models.add_argument("--json", action="store_true")

    tiny = commands.add_parser("make-tiny-model", help="write a random tiny model (for trying the pipeline)")
    tiny.add_argument("out", type=Path)
    tiny.add_argument("--layout", choices=("canvas", "prompt"), default="canvas")
    tiny.add_argument("--writes", nargs="+", default=[], metavar="TEXT",
                      help="texts of one token each: the model writes the first in every slot, whatever the context, "
                      "and the next where the first is barred (for end-to-end editor tests: answers known in "
                      "advance; e.g. --writes code ' None')")  # fmt: skip
    tiny.add_argument("--max-new-tokens", type=int, help="the model's answer length cap (its canvas_ls.json)")
    return parser


def _complete(args: argparse.Namespace) -> int:

    text = _read(args.file)
    try:
        offset = offset_at(text, args.line, args.character, strict=True)
    except PositionError as exc:
        raise CliError(f"{args.file}: {exc}") from exc
    overrides = {
        "layout": args.layout,
        "gap_tokens": args.gap_tokens,
        "max_steps": args.max_steps,
        "max_new_tokens": args.max_new_tokens,
        "seed": args.seed,
        **parse_settings(args.settings),
    }
    engine = load_engine(args, overrides)
    result = engine.infill(text[:offset], text[offset:])
    if args.json:
        print(json.dumps(result.to_dict(), indent=2, ensure_ascii=False))
    else:
        print(result.text)
    return 0


def _span(value: str) -> tuple[int, int, int, int]:
    """'L:C-L:C' -> (line, character, line, character)."""
    try:
        start, end = value.split("-")
        return (*map(int, start.split(":")), *map(int, end.split(":")))  # type: ignore[return-value]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{value}' is not a range L:C-L:C (0-based line and column)") from None


def _fill(args: argparse.Namespace) -> int:
    from ..engine import FillError
    from ..engine.regions import Region, regions_to_parts, split_parts

    text = _read(args.file)
    spans = [(span, 1.0) for span in args.hole] + [(span, args.strength) for span in args.rewrite]
    if not spans:
        raise CliError("nothing to fill: give at least one --hole or --rewrite")
    try:
        regions = [Region(offset_at(text, a, b, strict=True), offset_at(text, c, d, strict=True), strength)
                   for (a, b, c, d), strength in spans]  # fmt: skip
        prefix, middle, suffix = split_parts(regions_to_parts(text, regions))
    except (PositionError, FillError) as exc:
        raise CliError(f"{args.file}: {exc}") from exc
    engine = load_engine(args, {"seed": args.seed, **parse_settings(args.settings)})
    try:
        result = engine.fill(prefix, middle, suffix)
    except FillError as exc:
        raise CliError(f"{args.file}: {exc}") from exc
    ordered = sorted(range(len(regions)), key=lambda i: (regions[i].start, regions[i].end))
    answers = dict(zip(ordered, result.gaps, strict=True))  # region as given -> its gap's answer
    if args.json:
        ranges = [
            {"start": {"line": a, "character": b}, "end": {"line": c, "character": d}} for (a, b, c, d), _ in spans
        ]
        regions_out = [{"range": ranges[i], "strength": spans[i][1], **asdict(answers[i])} for i in range(len(spans))]
        print(json.dumps({"regions": regions_out, "result": result.to_dict()}, indent=2, ensure_ascii=False))
        return 0
    position, pieces = 0, []
    for i in ordered:
        pieces += [text[position : regions[i].start], answers[i].text]
        position = regions[i].end
    print("".join([*pieces, text[position:]]), end="")
    return 0


def _read(path: Path) -> str:
    """A source file's text: UTF-8, or the encoding a Python file declares on its first lines (PEP 263)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CliError(f"cannot read {path}: {exc}") from exc
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        declared = _declared_encoding(data)
        if declared is not None:
            try:
                return data.decode(declared)
            except (UnicodeDecodeError, LookupError) as again:
                raise CliError(f"cannot read {path} as the {declared} its coding line declares: {again}") from again
        raise CliError(
            f"{path} is not UTF-8 (byte 0x{data[exc.start]:02x} at offset {exc.start}); canvas-ls reads UTF-8, or the "
            f"encoding a Python file declares (# -*- coding: latin-1 -*-): convert it, e.g. "
            f"iconv -f latin1 -t utf-8 {path} > {path.with_name(path.stem + '.utf8' + path.suffix)}"
        ) from exc


def _declared_encoding(data: bytes) -> str | None:
    """The encoding a PEP 263 coding line on the first two lines declares, if any (the standard library's rule)."""
    import io
    import tokenize

    lines = data.splitlines(keepends=True)[:2]
    if not any(b"coding" in line for line in lines):
        return None
    try:
        return tokenize.detect_encoding(io.BytesIO(b"".join(lines)).readline)[0]
    except SyntaxError:  # an unknown encoding named
        return None


def _make_tiny_model(args: argparse.Namespace) -> int:
    from ..engine.architecture import build_tiny_model

    # A tokenizer needs text to learn from: the Python standard library's json package is always there.
    sources = sorted(Path(json.__file__).parent.glob("*.py"))
    infill: dict[str, Any] = {"layout": args.layout}
    if args.max_new_tokens is not None:
        infill["max_new_tokens"] = args.max_new_tokens
    texts = [p.read_text(encoding="utf-8") for p in sources]
    try:
        build_tiny_model(args.out, texts, infill=infill, writes=tuple(args.writes))
    except ValueError as exc:
        raise CliError(f"make-tiny-model: {exc}") from None
    print(args.out)
    return 0


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


def _serve(args: argparse.Namespace) -> int:
    import logging

    handler = logging.FileHandler(args.log_file) if args.log_file else logging.StreamHandler(sys.stderr)
    logging.basicConfig(level=args.log_level, handlers=[handler], format=LOG_FORMAT)
    if args.log_level != "DEBUG":
        for chatty in ("pygls", "httpx"):  # each logs every message it sends at INFO
            logging.getLogger(chatty).setLevel(logging.WARNING)
    if args.tcp:
        host, port = host_port(args.tcp)
        try:  # any client that connects may point the server at any folder or engine: loopback unless told
            check_host(host, args.allow_remote)
        except ServeError as exc:
            raise CliError(f"{exc} (LSP over TCP has no authentication)") from exc
    from .lsp import server

    if args.tcp:
        server.start_tcp(host, port)
    else:
        server.start_io()
    return 0


def _engine(args: argparse.Namespace) -> int:
    import logging

    from ..engine.compile_child import start_early

    # Its stderr is its log (the file a language server starts it with): what it decides (threads, compiled graphs,
    # token caches) at --log-level, the libraries' warnings and errors only
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format=LOG_FORMAT)
    logging.getLogger("canvas_ls").setLevel(args.log_level)  # every module's logger is named by the module
    token = _token(args)
    host, port = host_port(args.tcp) if args.tcp else (None, None)
    socket = None if args.tcp else (args.socket or default_socket(args.model, args.device, args.adapter,
                                                                   args.quantize))  # fmt: skip
    try:  # before anything starts or loads (the compiling process, torch: seconds): a refusal is immediate
        if socket is None:
            check_address(host or "", token, args.allow_remote)
        else:
            check_socket(socket)
    except ServeError as exc:
        raise CliError(str(exc)) from exc
    model_source(args.model)
    # On a new machine the CPU's compiled step comes from a child process: started before the engine's own imports
    # (torch, transformers: seconds), which its own then overlap; the warm-up reads it, or stops it if not needed
    early = start_early(args.model, args.device, args.dtype, args.compile, args.quantize)
    try:
        from ..engine.service import EngineService, serve

        engine = load_engine(args, prefix_cache_mb=args.prefix_cache_mb, compile=args.compile)
    except BaseException:
        if early is not None:
            early.stop()
        raise
    engine.early_compiler = early
    service = EngineService(engine, token if args.tcp else None, args.max_body, args.idle_exit or None, args.max_batch)
    if not args.tcp:  # the user's own engine: its /metrics also counts their suggestions' fates (`acceptance.py`)
        from .acceptance import StatisticsCollector

        service.registry.register(StatisticsCollector())
    where = f"{engine.name} on {engine.loaded.device} ({engine.dtype})"
    if engine.threads is not None:  # a change later is in the log (`engine/threads.py`) and /health
        where += f", threads {engine.threads.describe()}"
    print(f"canvas-ls engine: {where}, listening on {socket or args.tcp}", file=sys.stderr, flush=True)
    try:
        serve(service, socket, host, port, allow_remote=args.allow_remote)
    except ServeError as exc:
        raise CliError(str(exc)) from exc
    return 0


def _token(args: argparse.Namespace) -> str | None:
    """The bearer token from --token-file, --token (which `ps` shows) or $CANVAS_LS_TOKEN."""
    if args.token_file is not None:
        try:
            return args.token_file.read_text(encoding="utf-8").strip() or None
        except OSError as exc:
            raise CliError(f"cannot read the token file: {exc}") from exc
    return args.token or os.environ.get("CANVAS_LS_TOKEN")


def _models(args: argparse.Namespace) -> int:
    """The shipped model and every workspace model: for which repository, from which base, when, on how much."""
    from ..engine import workspaces
    from ..engine.settings import MODEL_SETTINGS_FILE

    if args.remove is not None:
        root = workspaces.repository_root(args.remove)
        if not workspaces.remove(root):
            raise CliError(f"no workspace model for {root}")
        print(f"removed the model tuned on {root}")
        return 0
    from ..engine.loading import DEFAULT_MODEL_DIR  # a path constant; loading imports torch: after --remove

    shipped = json.loads((DEFAULT_MODEL_DIR / MODEL_SETTINGS_FILE).read_text()).get("trained", {})
    rows = [{"workspace": "(everywhere else)", "model": str(DEFAULT_MODEL_DIR), "kind": "shipped",
             "created": None, "files": None, "tokens": None, "steps": shipped.get("step"),
             "minutes": round(shipped.get("elapsed", 0) / 60, 1) or None, "held_out": None,
             "bytes": _folder_bytes(DEFAULT_MODEL_DIR)}]  # fmt: skip
    for entry in workspaces.installed():
        record = entry.record
        rows.append({"workspace": str(entry.root), "model": str(entry.weights), "kind": entry.kind,
                     "base": entry.base, "created": record.get("created"), "files": record.get("files"),
                     "tokens": record.get("tokens"), "steps": record.get("steps"), "minutes": record.get("minutes"),
                     "recipe": record.get("recipe", {}).get("name"), "held_out": record.get("held_out"),
                     "base_weights": record.get("recipe", {}).get("quantize", "none"),  # a LoRA run's frozen base
                     "display": record.get("display"), "bytes": _folder_bytes(entry.weights)})  # fmt: skip
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'workspace':<40} {'kind':<8} {'created':<20} {'files':>6} {'tokens':>9} {'steps':>6} {'held-out loss':>15}"
          f" {'MB':>6}")  # fmt: skip
    for row in rows:
        held = row["held_out"] or {}
        # the held-out lines cut where the editor asks (what the workspace recipe trains on); older entries: spans
        key = "editor_diffusion" if "editor_diffusion" in held.get("after", {}) else "diffusion"
        before, after = held.get("before", {}).get(key), held.get("after", {}).get(key)
        loss = f"{before:.3f} -> {after:.3f}" if before is not None and after is not None else "-"
        print(f"{row['workspace'][-40:]:<40} {row['kind']:<8} {(row['created'] or '-')[:19]:<20} "
              f"{row['files'] or '-':>6} {row['tokens'] or '-':>9} {row['steps'] or '-':>6} {loss:>15} "
              f"{row['bytes'] / 1e6:>6.1f}")  # fmt: skip
    if len(rows) == 1:
        print("\nno workspace models: `canvas-ls train --workspace DIR`, or \"canvas-ls: Learn this workspace\" in "
              "an editor")  # fmt: skip
    return 0


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if folder.is_dir() else 0


def _train(args: argparse.Namespace) -> int:
    from .train_cli import run

    return run(args)


def _stats(args: argparse.Namespace) -> int:
    import json as json_module
    import re

    from .acceptance import clear, connect, default_path, format_summary, plot_summary, summary
    from .personal import reset

    path = default_path()
    if args.clear:
        clear(path)
        print(f"cleared {path}", file=sys.stderr)
        return 0
    if args.reset_threshold:
        db = connect(path)
        try:
            reset(db)
        finally:
            db.close()
        print("the display thresholds start again from the models' own (a running server: at its next look, or "
              "at once with its canvas-ls.resetThreshold command)", file=sys.stderr)  # fmt: skip
        return 0
    since = None
    if args.since is not None:
        found = re.fullmatch(r"(\d+(?:\.\d+)?)([dh])", args.since)
        if found is None:
            raise CliError(f"--since wants days or hours such as 7d or 12h, got '{args.since}'")
        since = float(found[1]) * (86400 if found[2] == "d" else 3600)
    try:
        report = summary(path, since)
    except sqlite3.DatabaseError as exc:
        raise CliError(f"the statistics database {path} cannot be read ({exc}); the language server moves it aside "
                       "and starts a new one, or `canvas-ls stats --clear`") from exc  # fmt: skip
    print(json_module.dumps(report, indent=2) if args.json else format_summary(report))
    if args.plot is not None:
        try:
            print(f"plot: {plot_summary(report, args.plot)}", file=sys.stderr)
        except ImportError as exc:
            raise CliError("--plot needs matplotlib: pip install 'canvas-ls[bench]'") from exc
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from . import doctor

    checks = doctor.run(args.model, args.device)
    print(doctor.report(checks, args.json))
    return 1 if any(check.status == doctor.BROKEN for check in checks) else 0


def _team(args: argparse.Namespace) -> int:
    from .team_cli import run

    return run(args)


def _bench(args: argparse.Namespace) -> int:
    from ..bench.cli import run

    return run(args)


def main(argv: list[str] | None = None) -> int:
    from ..engine import ModelLoadError, SettingsError

    argv = sys.argv[1:] if argv is None else argv
    args = parser(bench=argv[:1] == ["bench"]).parse_args(argv)
    handlers = {
        "complete": _complete,
        "fill": _fill,
        "serve": _serve,
        "engine": _engine,
        "train": _train,
        "bench": _bench,
        "team": _team,
        "doctor": _doctor,
        "stats": _stats,
        "make-tiny-model": _make_tiny_model,
        "models": _models,
    }
    try:
        return handlers[args.command](args)
    except (CliError, ModelLoadError, SettingsError) as exc:
        print(f"canvas-ls: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
