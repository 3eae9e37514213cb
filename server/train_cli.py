"""`canvas-ls train`: the default model from the source on this machine, a model of one repository (`--workspace`:
the editors' "Learn this workspace" runs exactly this, at the lowest priority), LoRA adapters, and `--plan` (what a
run needs, before it loads anything). The workspace policy lives here once: a base too big to tune fully gets the
LoRA recipe, its base quantised to fit; the tuned model is calibrated on the repository's held-out lines and
installed for that repository."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..engine import confidence as calibration
from ..engine.paths import cache_dir, lowest_priority
from ..engine.settings import QUANTIZE_CHOICES as QUANTIZE
from ..engine.workspaces import RECIPES as RECIPE_NAMES
from .cli import CliError


def add_parser(commands: Any) -> None:
    """`canvas-ls train` on the CLI's subparsers."""
    train = commands.add_parser("train", help="train the default model on source code already on this machine")
    train.add_argument("--preset", choices=("cpu", "gpu"), default="cpu")
    train.add_argument("--out", type=Path, help="work folder (resumable; default: the cache's train/)")
    train.add_argument("--minutes", type=float, help="wall-clock budget (default: the preset's)")
    train.add_argument("--eval-dir", type=Path, help="HumanEval-Infilling folder, for the decontamination report")
    train.add_argument("--install", action="store_true", help="copy the result over the shipped default model")
    train.add_argument("--from", dest="start_from", metavar="MODEL",
                       help="continue this model folder (its tokenizer, weights) instead of a new model")  # fmt: skip
    train.add_argument("--lr", type=float, help="peak learning rate (default: the preset's; lower it with --from)")
    train.add_argument("--batch-size", type=int, help="examples per step (default: the preset's)")
    train.add_argument("--attention", choices=("sdpa", "eager"), help="attention kernels (default: sdpa)")
    train.add_argument("--experts", choices=("grouped_mm", "batched_mm", "eager"),
                       help="MoE expert kernels (default: transformers' choice)")  # fmt: skip
    train.add_argument("--fp32", action="store_true", help="no bf16 autocast")
    train.add_argument("--corpus", type=Path, metavar="DIR", help="train on this repository's own source (git's "
                       "files; vendored, generated, binary files and secrets left out)")  # fmt: skip
    train.add_argument("--held-out", type=float, default=0.2, help="with --corpus: share of whole files held out")
    train.add_argument("--replay", type=float,
                       help="with --corpus: share of training bytes from the general corpus")  # fmt: skip
    train.add_argument("--patience", type=int, help="stop after N held-out evaluations without a better loss and "
                       "keep the best weights (evaluations every 100 steps)")  # fmt: skip
    train.add_argument("--lora", type=int, metavar="RANK", help="train a LoRA adapter of this rank (peft) instead "
                       "of every weight; exports OUT/adapter and OUT/model (merged)")  # fmt: skip
    train.add_argument("--lora-experts", action="store_true", help="the adapter also adapts the MoE expert weights")
    train.add_argument("--quantize", choices=QUANTIZE[1:],
                       help="with --lora: the frozen base's layers in int8 or int4 (QLoRA-style: DiffusionGemma's "
                       "LoRA on a 24/48 GB card; int4 on NVIDIA GPUs of compute capability 8.0+); the adapter alone "
                       "is exported, to load with --adapter (default: none; with --workspace, what fits)")  # fmt: skip
    train.add_argument("--multi-gap-share", type=float, help="share of examples with 2-4 gaps in one canvas")
    train.add_argument("--rewrite-share", type=float, help="share of examples whose gap shows a corrupted middle")
    train.add_argument(
        "--editor-share",
        type=float,
        help="share of examples cut where an editor asks (the cursor after a line's indentation)",
    )
    train.add_argument("--edits", type=int, metavar="HELD_OUT", help="with --corpus or --workspace: also learn next "
                       "edits from the repository's git history, the newest HELD_OUT commits left out (what `bench "
                       "edits --commits HELD_OUT` replays)")  # fmt: skip
    train.add_argument("--edit-share", type=float, help="with --edits: share of examples that are next edits")
    train.add_argument("--workspace", type=Path, metavar="DIR",
                       help="tune the --from model (default: the shipped one) on the repository that holds DIR with "
                            "the workspace recipe, and install it for that repository: the language server uses it "
                            "for its files (`canvas-ls models` lists it)")  # fmt: skip
    train.add_argument("--recipe", choices=sorted(RECIPE_NAMES), help="with --corpus or --workspace: a tuning "
                       "recipe of `bench repo` (learning rate, replay, LoRA); flags given win over it")  # fmt: skip
    train.add_argument("--progress", choices=("bar", "json"), default="bar",
                       help="json: one progress line per second on stdout (for the editors' command)")  # fmt: skip
    train.add_argument("--low-priority", action="store_true",
                       help="run at the lowest CPU priority (SCHED_IDLE): completions keep the cores")  # fmt: skip
    train.add_argument("--plan", action="store_true", help="print the memory a run would take (full and LoRA "
                       "training of the --from model, or the preset's; --from full-width: DiffusionGemma 26B-A4B's "
                       "geometry) against what the device has free, and exit")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    return _train(args)


def _train(args: argparse.Namespace) -> int:
    if args.plan:
        return _train_plan(args)
    if args.low_priority:
        lowest_priority()
    from ..engine import workspaces
    from ..engine.loading import DEFAULT_MODEL_DIR
    from ..engine.training import TrainingError, run

    name = _recipe_name(args)
    if args.workspace and not args.recipe and args.lora is None and not _fits_fully(args):
        name = "lora"  # a big base (DiffusionGemma): full tuning cannot fit on this device, an adapter can
        print(f"canvas-ls: training every weight of {args.start_from} cannot fit here: tuning a LoRA adapter "
              "(recipe lora)", file=sys.stderr)  # fmt: skip
    overrides, replay = _recipe_settings(args, name)
    if args.workspace and name == "lora" and args.quantize is None:
        overrides["quantize"] = _fitting_base(args)
        if overrides["quantize"] != "none":
            print(f"canvas-ls: the LoRA run's base is quantised to {overrides['quantize']} to fit here",
                  file=sys.stderr)  # fmt: skip
    corpus, out, minutes, start_from = args.corpus, args.out, args.minutes, args.start_from
    root = None
    if args.workspace is not None:
        root = workspaces.repository_root(args.workspace)
        if not root.is_dir():
            raise CliError(f"workspace folder '{args.workspace}' does not exist")
        corpus, start_from = root, start_from or str(DEFAULT_MODEL_DIR)
        out = out or workspaces.entry_dir(root) / "run"
        minutes = workspaces.WORKSPACE_MINUTES if minutes is None else minutes
        workspaces.fresh_run(out)
    if args.edits is not None and (corpus is None or args.edits < 0):
        raise CliError("--edits HELD_OUT (>= 0) needs --corpus or --workspace: the repository whose history it mines")
    out = out or cache_dir() / "train"
    report = _JsonProgress() if args.progress == "json" else _BarProgress()
    try:
        summary = run(args.preset, out, minutes, args.eval_dir, DEFAULT_MODEL_DIR if args.install else None,
                      report, start_from, overrides, corpus, args.held_out, replay,
                      export_merged=root is None)  # fmt: skip
    except TrainingError as exc:
        if args.progress == "json":
            _emit({"error": str(exc)})
        raise CliError(str(exc)) from exc
    finally:
        if isinstance(report, _BarProgress):
            report.close()
    if root is not None:
        summary["display"] = _calibrate_workspace_model(out, summary, report)
        folder = workspaces.install(root, out, args.start_from, summary, {"name": name, **overrides, "replay": replay})
        summary["installed"] = str(folder)
    shown = {k: v for k, v in summary.items() if k != "config"}
    if args.progress == "json":
        _emit({"done": shown})
    else:
        print(json.dumps(shown, indent=2))
        if root is not None:
            print(f"installed for {root}: {folder} (the language server uses it for that repository's files)")
    return 0


def _calibrate_workspace_model(run_dir: Path, summary: dict[str, Any], report: Any) -> dict[str, Any] | None:
    """A workspace's tuned model gets its own display threshold, calibrated on the repository's held-out lines
    (`server/calibration.py:calibrate_folder`); an adapter keeps its base's, and so does an interrupted run (the user
    asked it to stop). A calibration that fails leaves the model installed with its base's threshold."""
    from .calibration import calibrate_folder

    model, held_out = run_dir / "model", run_dir / "repository_report.json"
    if summary.get("stopped") == "interrupted" or not model.is_dir() or not held_out.is_file():
        return None
    if isinstance(report, _JsonProgress):
        _emit({"calibrating": {"lines": calibration.WORKSPACE_LINES}})
    else:
        print(f"canvas-ls: calibrating the model's display threshold on up to {calibration.WORKSPACE_LINES} held-out "
              "lines", file=sys.stderr)  # fmt: skip
    try:
        return calibrate_folder(model, held_out)
    except Exception as exc:  # the model is trained: install it with its base's threshold, and say why
        print(f"canvas-ls: calibration failed ({type(exc).__name__}: {exc}); the base's threshold stays",
              file=sys.stderr)  # fmt: skip
        return {"error": f"{type(exc).__name__}: {exc}"}


def _fits_fully(args: argparse.Namespace) -> bool:
    """Whether full training of the --from model fits the device (`train --plan`'s arithmetic)."""
    if not args.start_from:
        return True  # the shipped model: megabytes
    from ..engine.loading import resolve_device
    from ..engine.plan import check

    cfg = replace(_plan_config(args), lora_rank=0)
    return check(_run_plan(cfg, args), resolve_device(cfg.device)) is None


def _fitting_base(args: argparse.Namespace) -> str:
    """The widest base (none, int8, int4) whose LoRA run fits the device (`train --plan`'s arithmetic); int4 only
    where it runs. None fitting: "none", and the run's own check says why."""
    from ..engine.loading import resolve_device
    from ..engine.plan import check
    from ..engine.quantize import int4_capable

    cfg = _lora_plan_config(_plan_config(args))
    device = resolve_device(cfg.device)
    for kind in ("none", "int8", "int4") if int4_capable(device) else ("none", "int8"):
        if check(_run_plan(replace(cfg, quantize=kind), args), device) is None:
            return kind
    return "none"


def _emit(record: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):  # the editor went away (a broken pipe): the run goes on, installs its model
        print(json.dumps(record), flush=True)


class _BarProgress:
    """tqdm on stderr over the wall-clock budget (so its ETA is the time left): step, losses."""

    def __init__(self) -> None:
        self.bar: Any = None  # made at the first step, when the budget is known

    def __call__(self, state: dict, diffusion: float, ar: float, budget: float) -> None:
        if self.bar is None:
            from tqdm import tqdm

            shape = "{l_bar}{bar}| {n:.0f}/{total:.0f} s [{elapsed}<{remaining}{postfix}]"
            self.bar = tqdm(total=budget, file=sys.stderr, dynamic_ncols=True, mininterval=5.0, bar_format=shape)
        self.bar.update(min(state["elapsed"], budget) - self.bar.n)
        self.bar.set_postfix(step=state["step"], diff=f"{diffusion:.3f}", ar=f"{ar:.3f}", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class _JsonProgress:
    """One line a second on stdout: {"progress": {step, elapsed_s, budget_s, loss}}."""

    def __init__(self) -> None:
        self.last = float("-inf")

    def __call__(self, state: dict, diffusion: float, ar: float, budget: float) -> None:
        if (now := time.monotonic()) - self.last >= 1.0:
            self.last = now
            _emit({"progress": {"step": state["step"], "elapsed_s": round(state["elapsed"], 1),
                                "budget_s": round(budget, 1), "loss": round(diffusion, 4)}})  # fmt: skip


def _train_overrides(args: argparse.Namespace) -> dict[str, Any]:
    overrides = {
        "lr": args.lr,
        "batch_size": args.batch_size,
        "multi_gap_share": args.multi_gap_share,
        "rewrite_share": args.rewrite_share,
        "editor_share": args.editor_share,
        "edits_held_out": args.edits,
        "edit_share": args.edit_share,
        "attention": args.attention,
        "experts": args.experts,
        "bf16": False if args.fp32 else None,
        "lora_rank": args.lora,
        "lora_experts": True if args.lora_experts else None,
        "quantize": args.quantize,
        "patience": args.patience,
    }
    return {k: v for k, v in overrides.items() if v is not None}


def _recipe_name(args: argparse.Namespace) -> str | None:
    """The tuning recipe a `train` command runs: `--recipe`, or the workspace recipe with `--workspace`."""
    from ..engine import workspaces

    return args.recipe or (workspaces.WORKSPACE_RECIPE if args.workspace else None)


def _recipe_settings(args: argparse.Namespace, name: str | None) -> tuple[dict[str, Any], float]:
    """A `train` command's TrainConfig overrides (recipe `name`'s, the flags over them) and its general-code replay
    share (the recipe's unless `--replay`)."""
    from ..engine import workspaces

    recipe, replay = workspaces.recipe(name) if name else ({}, 0.0)
    return {**recipe, **_train_overrides(args)}, replay if args.replay is None else args.replay


def _plan_config(args: argparse.Namespace) -> Any:
    """The TrainConfig a `train` command would run (its preset, its recipe and the flags over them), for the memory
    plan."""
    from ..engine.training import PRESETS, TrainConfig

    return TrainConfig(**{**PRESETS[args.preset]["train"], **_recipe_settings(args, _recipe_name(args))[0]})


def _lora_plan_config(cfg: Any) -> Any:
    """`cfg` as a LoRA run: its own rank, or 16."""
    return replace(cfg, lora_rank=cfg.lora_rank or 16)


def _run_plan(cfg: Any, args: argparse.Namespace) -> dict[str, Any]:
    from ..engine.training import PRESETS, run_plan

    return run_plan(cfg, args.start_from, args.preset, PRESETS[args.preset]["vocab_size"])


def _train_plan(args: argparse.Namespace) -> int:
    """Full and LoRA training of the run's model, side by side, against the device's free memory."""
    from ..engine.loading import resolve_device
    from ..engine.plan import GIB, available_bytes, format_plan

    base = _plan_config(args)
    lora = _lora_plan_config(base)
    plans = [_run_plan(replace(base, lora_rank=0), args), _run_plan(replace(lora, quantize="none"), args)]
    if not lora.lora_experts:  # quantised bases take adapters of the attention and dense MLP
        plans += [_run_plan(replace(lora, quantize=kind), args) for kind in ("int8", "int4")]
    free, where = available_bytes(resolve_device(base.device))
    name = args.start_from or f"the {args.preset} preset's model"
    print(format_plan(plans, where, name))
    for plan in plans:
        fits = "fits" if plan["total_bytes"] <= free else "does NOT fit: refused"
        print(f"{plan['mode']}: {plan['total_bytes'] / GIB:.1f} GiB, {fits}")
    return 0
