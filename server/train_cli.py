"""`canvas-ls train`: the default model from the source on this machine, a model of one repository (`--workspace`:
the editors' "Learn this workspace" runs exactly this, at the lowest priority), LoRA adapters, and `--plan` (what a
run needs, before it loads anything). Its flags become a `learning.TrainRequest`; the policy (recipes, a LoRA adapter
where the base is too big to tune fully, the calibration and install of a workspace's model) is `server/learning.py`'s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..engine.paths import lowest_priority
from ..engine.workspaces import RECIPES as RECIPE_NAMES
from . import learning
from .arguments import CliError


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
    train.add_argument("--quantize", choices=("none", "int8", "int4"),
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
    """`canvas-ls train`: the flags as a `TrainRequest`, run by `server/learning.py`; its summary on stdout (JSON),
    or with `--progress json` one JSON line per second and the summary as the last line."""
    if args.plan:
        return _train_plan(args)
    if args.low_priority:
        lowest_priority()
    report = _JsonProgress() if args.progress == "json" else _BarProgress()

    def say(text: str) -> None:
        print(f"canvas-ls: {text}", file=sys.stderr)

    try:
        summary = learning.train(request(args), report, say)
    except learning.LearningError as exc:
        if args.progress == "json":
            _emit({"error": str(exc)})
        raise CliError(str(exc)) from exc
    finally:
        if isinstance(report, _BarProgress):
            report.close()
    shown = {k: v for k, v in summary.items() if k not in ("config", "workspace")}
    if args.progress == "json":
        _emit({"done": shown})
    else:
        print(json.dumps(shown, indent=2))
        if "installed" in summary:
            print(f"installed for {summary['workspace']}: {summary['installed']} (the language server uses it for "
                  "that repository's files)")  # fmt: skip
    return 0


def request(args: argparse.Namespace) -> learning.TrainRequest:
    """What a `canvas-ls train` command asks for."""
    return learning.TrainRequest(
        preset=args.preset, out=args.out, minutes=args.minutes, start_from=args.start_from, corpus=args.corpus,
        workspace=args.workspace, recipe=args.recipe, flags=_train_overrides(args), replay=args.replay,
        held_out=args.held_out, eval_dir=args.eval_dir, install=args.install,
    )  # fmt: skip


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


def _train_plan(args: argparse.Namespace) -> int:
    """Full and LoRA training of the run's model, side by side, against the device's free memory."""
    from ..engine.loading import resolve_device
    from ..engine.plan import GIB, available_bytes, format_plan

    asked = request(args)
    base = learning.plan_config(asked)
    lora = learning.lora_plan_config(base)
    kinds = ("none", "int8", "int4") if not lora.lora_experts else ("none",)  # quantised bases: no expert adapters
    plans = [learning.run_plan(replace(base, lora_rank=0), asked)]
    plans += [learning.run_plan(replace(lora, quantize=kind), asked) for kind in kinds]
    free, where = available_bytes(resolve_device(base.device))
    name = args.start_from or f"the {args.preset} preset's model"
    print(format_plan(plans, where, name))
    for plan in plans:
        fits = "fits" if plan["total_bytes"] <= free else "does NOT fit: refused"
        print(f"{plan['mode']}: {plan['total_bytes'] / GIB:.1f} GiB, {fits}")
    return 0
