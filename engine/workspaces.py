"""Models tuned on one workspace: where they live, what they learned, and which one a file of that workspace uses.

`canvas-ls train --workspace DIR` tunes a base model on the repository that holds DIR and installs the result under
the user's cache, one folder per repository (its root's name and a digest of its path):

    <cache>/workspaces/<name>-<digest>/
        workspace.json   what `canvas-ls models` lists: the repository, the base model, when, on how many tokens,
                         the recipe and the held-out figures before and after
        model-<time>/    a fully tuned model, or
        adapter-<time>/  a LoRA adapter (peft) over `base`: megabytes, where the merged copy would be the whole model
                         (a new name per install: an engine still serving the old weights is never mistaken for one
                         serving the new)
        run/             the training run (its corpus report, log and checkpoint: a run stopped midway resumes)

The language server asks `WorkspaceIndex.for_path` which model a document uses: the entry of the innermost
repository that holds it, when that entry was tuned from the model the editor configured. No torch here.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import secrets
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .paths import cache_dir, resolved_model

ENTRY_FILE = "workspace.json"

# Ways to tune a model on one repository, compared by `canvas-ls bench repo` (its table says which wins where). Each
# is TrainConfig overrides plus `replay`: the share of training bytes drawn from the general corpus.
_SINGLE_GAPS_ONLY = {"multi_gap_share": 0.0, "rewrite_share": 0.0}  # no several-gap or rewrite examples
RECIPES: dict[str, dict[str, Any]] = {
    "full": {"lr": 5e-4, "replay": 0.0},
    "full-editor": {"lr": 5e-4, "replay": 0.0, "editor_share": 0.5},
    # full-editor's mix of single gaps (half of them cut where the editor asks) and nothing else
    "full-lines": {"lr": 5e-4, "replay": 0.0, "editor_share": 0.5, **_SINGLE_GAPS_ONLY},
    # every example a single gap cut where the editor asks (the workspace recipe; README)
    "editor-only": {"lr": 5e-4, "replay": 0.0, "editor_share": 1.0, **_SINGLE_GAPS_ONLY},
    # editor-only at twice the learning rate: more of the repository in the same minutes
    "editor-hot": {"lr": 1e-3, "replay": 0.0, "editor_share": 1.0, **_SINGLE_GAPS_ONLY},
    # editor-only, exporting an exponential moving average of the weights (started from the base's) instead of the
    # last ones: horizons of ~200 and ~500 steps (3 and 8 minutes at 2-core CPU speed)
    "editor-ema": {"lr": 5e-4, "replay": 0.0, "editor_share": 1.0, "ema": 0.995, **_SINGLE_GAPS_ONLY},
    "editor-ema-slow": {"lr": 5e-4, "replay": 0.0, "editor_share": 1.0, "ema": 0.998, **_SINGLE_GAPS_ONLY},
    "full-replay": {"lr": 2e-4, "replay": 0.5, "patience": 2},
    "lora": {"lora_rank": 16, "lr": 2e-3, "replay": 0.25},
}
# What `train --workspace` and the editors' "Learn this workspace" use: the recipe with the best held-out line edit
# similarity on the Python repositories `bench repo` ran it on (README: "A model of your own code"; 2026-12-02:
# full-lines over full by +1.5 and +4.4 line points; editor-only over full-lines on boltons by +1.5 line and +2.9
# block points in one run, +9.0 on marshmallow against full-lines' +6.7; HumanEval similarity up, holes and
# rewrites on HumanEval within a point or two of the base, two holes' similarity up).
WORKSPACE_RECIPE = "editor-only"
WORKSPACE_MINUTES = 10.0


def recipe(name: str) -> tuple[dict[str, Any], float]:
    """A recipe as training takes it: its TrainConfig overrides, and the share of general code replayed (an
    argument of `training.run`, not a TrainConfig field)."""
    overrides = dict(RECIPES[name])
    return overrides, overrides.pop("replay", 0.0)


def workspaces_dir() -> Path:
    return cache_dir() / "workspaces"


def repository_root(folder: Path) -> Path:
    """The root of the git repository that holds `folder`, or the folder itself outside git."""
    folder = folder.expanduser().resolve()
    try:
        done = subprocess.run(["git", "-C", str(folder), "rev-parse", "--show-toplevel"], capture_output=True,
                              text=True, timeout=10, check=True)  # fmt: skip
        return Path(done.stdout.strip()).resolve()
    except (OSError, subprocess.SubprocessError):
        return folder


def entry_dir(root: Path) -> Path:
    """The cache folder of the repository at `root` (a resolved path)."""
    digest = hashlib.sha1(str(root).encode()).hexdigest()[:12]
    return workspaces_dir() / f"{root.name or 'root'}-{digest}"


def same_base(a: str | None, b: str | None) -> bool:
    """Whether two model names (None: the shipped default) are the same model: folders compare resolved."""
    if a is None or b is None:
        return a is b
    return resolved_model(a) == resolved_model(b)


@dataclass(frozen=True)
class WorkspaceModel:
    root: Path  # the repository it learned
    folder: Path  # its cache entry
    base: str | None  # the model it was tuned from (None: the shipped default)
    kind: str  # "model": a tuned model folder; "adapter": a LoRA adapter over `base`
    weights: Path  # that folder
    record: dict[str, Any]  # the whole workspace.json

    @property
    def model(self) -> str | None:
        return str(self.weights) if self.kind == "model" else None

    @property
    def adapter(self) -> str | None:
        return str(self.weights) if self.kind == "adapter" else None

    @property
    def runs_as(self) -> tuple[str | None, str | None]:
        """(model, adapter) to load: the tuned folder, or the base with the adapter."""
        return (self.model, None) if self.kind == "model" else (self.base, self.adapter)

    @functools.cached_property
    def shares_base(self) -> bool:
        """An adapter that the engine already running its base can answer with (`engine.adapters.AdapterSet`). Read
        once per entry: the router asks it for every completion of the workspace's files."""
        return self.kind == "adapter" and holds_beside_others(self.weights)


def holds_beside_others(adapter: Path) -> bool:
    """Whether peft can hold this LoRA adapter folder beside others on one model: adapters of `nn.Linear` layers
    can; one of DiffusionGemma's fused expert parameters (`target_parameters`) cannot ("Trying to target the same
    nn.Parameter twice")."""
    try:
        config = json.loads((adapter / "adapter_config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and not config.get("target_parameters")


def read(folder: Path) -> WorkspaceModel | None:
    """The entry in `folder`, or None when it holds none (or a half-written one)."""
    try:
        record = json.loads((folder / ENTRY_FILE).read_text())
        root = Path(record["workspace"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    kind, weights = record.get("kind"), folder / str(record.get("path"))
    marker = {"model": "config.json", "adapter": "adapter_config.json"}.get(str(kind))
    if marker is None or not (weights / marker).is_file():
        return None
    return WorkspaceModel(root, folder, record.get("base"), str(kind), weights, record)


def installed() -> list[WorkspaceModel]:
    """Every workspace model of this user, newest first."""
    base = workspaces_dir()
    entries = [e for f in sorted(base.iterdir()) if f.is_dir() and (e := read(f))] if base.is_dir() else []
    return sorted(entries, key=lambda e: e.record.get("created", ""), reverse=True)


def install(root: Path, run_dir: Path, base: str | None, summary: dict[str, Any], recipe: dict[str, Any]) -> Path:
    """Move a finished training run's result (run_dir/model, or run_dir/adapter for LoRA) into the repository's
    entry and write its workspace.json last (an entry without one is not used)."""
    folder = entry_dir(root)
    kind = "adapter" if recipe.get("lora_rank") else "model"
    created = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    name = f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
    shutil.copytree(run_dir / kind, folder / name)
    replaced = read(folder)
    repository = summary.get("repository", {})
    record = {
        "workspace": str(root),
        "base": base,
        "kind": kind,
        "path": name,
        "created": created,
        "files": repository.get("files"),
        "tokens": repository.get("train_tokens"),
        "steps": summary.get("step"),
        "examples": summary.get("examples"),
        "minutes": round(summary.get("elapsed", 0.0) / 60, 2),
        "stopped": summary.get("stopped"),
        "recipe": recipe,
        "held_out": {"before": _evals(summary, "eval_before_"), "after": _evals(summary, "eval_")},
        "display": summary.get("display"),  # its own display threshold (`calibration.calibrate_folder`), if any
    }
    temporary = folder / f".{ENTRY_FILE}.tmp"
    temporary.write_text(json.dumps(record, indent=2))
    os.replace(temporary, folder / ENTRY_FILE)
    if replaced is not None:  # an engine still running the old weights has them in memory already
        shutil.rmtree(replaced.weights, ignore_errors=True)
    return folder


def _evals(summary: dict[str, Any], prefix: str) -> dict[str, float]:
    """A training summary's held-out figures under `prefix` ("eval_before_": before the run; "eval_": after)."""
    return {k.removeprefix(prefix): v for k, v in summary.items()
            if k.startswith(prefix) and not (prefix == "eval_" and k.startswith("eval_before_"))}  # fmt: skip


def fresh_run(run_dir: Path) -> None:
    """Before a workspace run: a run that was interrupted resumes; one that ended starts anew (the repository has
    changed since, and its budget is spent)."""
    try:
        last = json.loads((run_dir / "log.jsonl").read_text().splitlines()[-1])
    except (OSError, ValueError, IndexError):
        return
    if isinstance(last, dict) and last.get("final", {}).get("stopped") != "interrupted":
        shutil.rmtree(run_dir)


def remove(root: Path) -> bool:
    """Delete the repository's entry; False when it had none."""
    folder = entry_dir(root)
    if not folder.is_dir():
        return False
    shutil.rmtree(folder)
    return True


class WorkspaceIndex:
    """Which workspace model a file uses. `for_path` reads memory only (the completion cache's key asks it on every
    keystroke); `refresh` re-reads the entries when one was added, replaced or removed (the language server calls
    it on a timer: a training run that ends while the editor is open takes effect without a restart)."""

    def __init__(self) -> None:
        self._stamp: tuple[Any, ...] = ()
        self._entries: list[WorkspaceModel] = []
        self.refresh()

    def _stamp_now(self) -> tuple[Any, ...]:
        base = workspaces_dir()
        try:
            return tuple((f.name, (f / ENTRY_FILE).stat().st_mtime_ns) for f in sorted(base.iterdir())
                         if (f / ENTRY_FILE).is_file())  # fmt: skip
        except OSError:
            return ()

    def refresh(self) -> bool:
        """Re-read the entries if they changed on disk; whether they did."""
        stamp = self._stamp_now()
        if stamp == self._stamp:
            return False
        self._stamp, self._entries = stamp, installed()
        for entry in self._entries:
            if entry.base is not None:
                resolved_model(entry.base)
        return True

    def for_path(self, path: Path, base: str | None) -> WorkspaceModel | None:
        """The model of the innermost repository holding `path` that was tuned from `base`; None: use `base`."""
        fitting = [e for e in self._entries if path.is_relative_to(e.root) and same_base(e.base, base)]
        return max(fitting, key=lambda e: len(e.root.parts), default=None)
