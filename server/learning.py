"""Training as a library: what `canvas-ls train` runs, and so what the editors' "Learn this workspace" runs.

    TrainRequest -> policy (the recipe, the flags over it; a workspace's base too big to tune fully gets the LoRA
    recipe, its base quantised to fit) -> engine.training.run -> for a workspace: calibrate the tuned model's
    display threshold on the repository's held-out lines, install it for that repository

The command line (`server/train_cli.py`) turns its flags into a `TrainRequest` and shows what this returns; the
server's `Learner` runs that command at the lowest CPU priority (a process it can pause and stop).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..engine import confidence as calibration
from ..engine import workspaces


class LearningError(Exception):
    """A request that cannot run, or a run that failed: the message is for the user."""


@dataclass(frozen=True)
class TrainRequest:
    preset: str = "cpu"
    out: Path | None = None  # default: the cache's train/, or the workspace's run folder
    minutes: float | None = None  # default: the preset's, or the workspace's
    start_from: str | None = None  # a model folder to continue (default: a new model; the shipped one for a workspace)
    corpus: Path | None = None  # a repository's own source instead of the general corpus
    workspace: Path | None = None  # tune on the repository that holds this folder and install the model for it
    recipe: str | None = None  # a tuning recipe of `bench repo` (default: the workspace recipe for a workspace)
    flags: Mapping[str, Any] = field(default_factory=dict)  # TrainConfig fields given, over the recipe's
    replay: float | None = None  # share of general-corpus bytes (default: the recipe's)
    held_out: float = 0.2  # with a corpus: share of whole files held out
    eval_dir: Path | None = None
    install: bool = False  # write the model over the shipped one


@dataclass(frozen=True)
class Policy:
    """What a request runs: the recipe, the TrainConfig overrides (the recipe's, the flags over them, the policy's
    choices), the replay share, and what the policy chose, in words for the user."""

    recipe: str | None
    overrides: dict[str, Any]
    replay: float
    notes: tuple[str, ...] = ()


def policy(request: TrainRequest) -> Policy:
    """The recipe and settings of a request; for a workspace whose base cannot be tuned fully on this device, the
    LoRA recipe, and the widest base (none, int8, int4) whose LoRA run fits."""
    name = _asked_recipe(request)
    notes: list[str] = []
    if request.workspace and not request.recipe and "lora_rank" not in request.flags and not fits_fully(request):
        name = "lora"  # a big base (DiffusionGemma): full tuning cannot fit on this device, an adapter can
        notes.append(f"training every weight of {request.start_from} cannot fit here: tuning a LoRA adapter "
                     "(recipe lora)")  # fmt: skip
    overrides, replay = _settings(request, name)
    if request.workspace and name == "lora" and "quantize" not in request.flags:
        overrides["quantize"] = fitting_base(request)
        if overrides["quantize"] != "none":
            notes.append(f"the LoRA run's base is quantised to {overrides['quantize']} to fit here")
    return Policy(name, overrides, replay, tuple(notes))


def train(request: TrainRequest, progress: Any = None, say: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the request (`policy`, then `engine.training.run`); a workspace's model is then calibrated and installed
    (`summary["installed"]`). `progress(state, diffusion, ar, budget)` per step; `say` gets the policy's choices and
    the calibration's news. Raises LearningError."""
    from ..engine.loading import DEFAULT_MODEL_DIR
    from ..engine.paths import cache_dir
    from ..engine.training import TrainingError, run

    held_out_commits = request.flags.get("edits_held_out")
    if held_out_commits is not None and (held_out_commits < 0 or (request.corpus or request.workspace) is None):
        raise LearningError("--edits HELD_OUT (>= 0) needs --corpus or --workspace: the repository whose history "
                            "it mines")  # fmt: skip
    chosen = policy(request)
    for note in chosen.notes:
        say(note)
    corpus, out, minutes, start_from = request.corpus, request.out, request.minutes, request.start_from
    root = None
    if request.workspace is not None:
        root = workspaces.repository_root(request.workspace)
        if not root.is_dir():
            raise LearningError(f"workspace folder '{request.workspace}' does not exist")
        corpus, start_from = root, start_from or str(DEFAULT_MODEL_DIR)
        out = out or workspaces.entry_dir(root) / "run"
        minutes = workspaces.WORKSPACE_MINUTES if minutes is None else minutes
        workspaces.fresh_run(out)
    out = out or cache_dir() / "train"
    try:
        summary = run(request.preset, out, minutes, request.eval_dir, DEFAULT_MODEL_DIR if request.install else None,
                      progress, start_from, chosen.overrides, corpus, request.held_out, chosen.replay,
                      export_merged=root is None)  # fmt: skip
    except TrainingError as exc:
        raise LearningError(str(exc)) from exc
    if root is not None:
        summary["display"] = _calibrate(out, summary, say)
        recipe = {"name": chosen.recipe, **chosen.overrides, "replay": chosen.replay}
        summary["installed"] = str(workspaces.install(root, out, request.start_from, summary, recipe))
        summary["workspace"] = str(root)
    return summary


def _calibrate(run_dir: Path, summary: dict[str, Any], say: Callable[[str], None]) -> dict[str, Any] | None:
    """A workspace's tuned model gets its own display threshold, calibrated on the repository's held-out lines
    (`server/calibration.py:calibrate_folder`); an adapter keeps its base's, and so does an interrupted run (the user
    asked it to stop). A calibration that fails leaves the model installed with its base's threshold."""
    from .calibration import calibrate_folder

    model, held_out = run_dir / "model", run_dir / "repository_report.json"
    if summary.get("stopped") == "interrupted" or not model.is_dir() or not held_out.is_file():
        return None
    say(f"calibrating the model's display threshold on up to {calibration.WORKSPACE_LINES} held-out lines")
    try:
        return calibrate_folder(model, held_out)
    except Exception as exc:  # the model is trained: install it with its base's threshold, and say why
        say(f"calibration failed ({type(exc).__name__}: {exc}); the base's threshold stays")
        return {"error": f"{type(exc).__name__}: {exc}"}


def fits_fully(request: TrainRequest) -> bool:
    """Whether full training of the request's base fits the device (`train --plan`'s arithmetic)."""
    if not request.start_from:
        return True  # the shipped model: megabytes
    from ..engine.loading import resolve_device
    from ..engine.plan import check

    cfg = replace(plan_config(request), lora_rank=0)
    return check(run_plan(cfg, request), resolve_device(cfg.device)) is None


def fitting_base(request: TrainRequest) -> str:
    """The widest base (none, int8, int4) whose LoRA run fits the device (`train --plan`'s arithmetic); int4 only
    where it runs. None fitting: "none", and the run's own check says why."""
    from ..engine.loading import resolve_device
    from ..engine.plan import check
    from ..engine.quantize import int4_capable

    cfg = lora_plan_config(plan_config(request))
    device = resolve_device(cfg.device)
    for kind in ("none", "int8", "int4") if int4_capable(device) else ("none", "int8"):
        if check(run_plan(replace(cfg, quantize=kind), request), device) is None:
            return kind
    return "none"


def plan_config(request: TrainRequest) -> Any:
    """The TrainConfig a request would run (its preset, its recipe and the flags over them), for the memory plan."""
    from ..engine.train_config import PRESETS, TrainConfig
    from ..engine.training import as_run

    return as_run(TrainConfig(**{**PRESETS[request.preset]["train"], **_settings(request, _asked_recipe(request))[0]}))


def lora_plan_config(cfg: Any) -> Any:
    """`cfg` as a LoRA run: its own rank, or 16."""
    return replace(cfg, lora_rank=cfg.lora_rank or 16)


def run_plan(cfg: Any, request: TrainRequest) -> dict[str, Any]:
    from ..engine.train_config import PRESETS
    from ..engine.training import run_plan as plan_of

    return plan_of(cfg, request.start_from, request.preset, PRESETS[request.preset]["vocab_size"])


def _asked_recipe(request: TrainRequest) -> str | None:
    """The recipe a request names, or the workspace recipe for a workspace (before `policy`'s LoRA fallback)."""
    return request.recipe or (workspaces.WORKSPACE_RECIPE if request.workspace else None)


def _settings(request: TrainRequest, name: str | None) -> tuple[dict[str, Any], float]:
    """Recipe `name`'s TrainConfig overrides with the request's flags over them, and the replay share (the recipe's
    unless the request gives one)."""
    recipe, replay = workspaces.recipe(name) if name else ({}, 0.0)
    return {**recipe, **request.flags}, replay if request.replay is None else request.replay
