"""`canvas-ls bench repo`: which way of tuning a model on one repository helps on that repository's unseen files,
and what it costs in general ability.

The repository is split by whole files (80/20, seeded: the split `train --corpus` makes). Each recipe
(`engine.workspaces.RECIPES`: learning rate, share of general code replayed, full weights or a LoRA adapter) tunes
the base model for the same wall-clock minutes, exporting snapshots on the way. The base model and every snapshot
are then measured on the held-out files:

    lines      single lines, the cursor after the indentation (an editor after Enter), the rest of the file after
    blocks     runs of 2-4 lines, same cursor, the multi-line settings
    humaneval  HumanEval single-line infilling (what tuning costs outside the repository)

each with exact match (whitespace-normalised), edit similarity, the share of empty answers and tokens per decoder
forward; and the held-out diffusion loss the training logged at each snapshot. Table, JSON, and a PNG of held-out
loss and exact match against minutes, one curve per recipe.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..engine import corpus, training, workspaces
from ..engine.engine import Engine
from ..engine.tasks import Task, block_tasks, line_tasks, load_tasks, machine
from .core import answer_row, figure, paired_interval, summarise

# What the server asks for at a single-line and a multi-line hole (server.config.CompletionOptions).
SETTINGS = {"lines": {"max_new_tokens": 48}, "blocks": {"gap_tokens": 32, "max_new_tokens": 128},
            "humaneval": {"max_new_tokens": 48}}  # fmt: skip


def measure(
    engine: Engine, tasks: list[Task], overrides: dict[str, Any], workspace: str | None = None
) -> dict[str, Any]:
    """`bench.summarise` of the engine's answers (exact match, edit similarity, empty share, tokens per forward...)."""
    rows = []
    for task in tasks:
        started = time.perf_counter()
        result = engine.infill(task.prompt, task.suffix, overrides, workspace=workspace)
        rows.append(answer_row(task, result, (time.perf_counter() - started) * 1000))
    # each task's edit similarity, in the tasks' order: gains are compared task by task (`line_gain`)
    return {**summarise(rows), "similarities": [row["edit_similarity"] for row in rows]}


def evaluate(model: str | None, adapter: str | None, sets: dict[str, list[Task]], cached: list[str] | None = None,
             overrides: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """Each set's figures (the model's settings: each task's document is its own token cache, `overrides` aside);
    with the token cache of the `cached` texts (the repository's training files, in this model's tokens) on its
    held-out lines and blocks (HumanEval, code from outside the repository, runs without it, as a document outside
    the workspace does); then also `token_cache`: its tokens and seconds to build."""
    engine = Engine.load(model, adapter=adapter)
    built = {}
    if cached is not None:
        started = time.perf_counter()
        tokens = engine.token_caches.add(CACHED, cached).tokens
        built = {"token_cache": {"tokens": tokens, "seconds": round(time.perf_counter() - started, 2)}}
    started = time.perf_counter()
    figures = {name: measure(engine, tasks, {**SETTINGS[name], **(overrides or {})},
                             CACHED if cached is not None and name != "humaneval" else None)
               for name, tasks in sets.items()}  # fmt: skip
    return {**figures, **built, "seconds": round(time.perf_counter() - started, 1)}


CACHED = "repository"  # the workspace name the evaluated requests give for the repository's token cache


def _losses(run_dir: Path) -> tuple[dict[float, float], dict[str, Any]]:
    """The held-out diffusion loss at each snapshot (minutes -> loss), and the run's final summary."""
    at, final = {}, {}
    for line in (run_dir / "log.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "snapshot" in record:
            at[float(record["snapshot"])] = record["eval_diffusion"]
        elif "final" in record:
            final = record["final"]
    return at, final


def run(
    repository: Path,
    work: Path,
    base: str | None = None,
    recipes: list[str] | None = None,
    minutes: float = 8.0,
    points: tuple[float, ...] = (2.0, 4.0),
    limits: dict[str, int] | None = None,
    humaneval: Path | None = None,
    progress: Callable[[str], None] = print,
    checkpoint: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    # One run's sequence (~80 lines): the repository split, the base measured, then each recipe trained and measured
    # at each snapshot, the report checkpointed after each.
    from ..engine.loading import DEFAULT_MODEL_DIR

    base = base or str(DEFAULT_MODEL_DIR)
    limits = {"lines": 150, "blocks": 60, "humaneval": 100, **(limits or {})}
    files, described = corpus.collect_repository(repository)
    held, training_files = corpus.split_repository(files)
    pairs = [(f.path, f.text) for f in held]
    sets = {"lines": line_tasks(pairs, limits["lines"]), "blocks": block_tasks(pairs, limits["blocks"])}
    if humaneval is not None and limits["humaneval"]:
        sets["humaneval"] = load_tasks(humaneval, limits["humaneval"])
    report: dict[str, Any] = {
        "repository": str(described["root"]), "files": described["files"], "held_out_files": len(held),
        "languages": described["by_language"], "base": base, "minutes": minutes, "points": list(points),
        "tasks": {name: len(tasks) for name, tasks in sets.items()}, "machine": machine(), "recipes": {},
    }  # fmt: skip
    progress(f"{described['root']}: {len(files)} files, {len(held)} held out; tasks {report['tasks']}")
    report["base_figures"] = evaluate(base, None, sets)
    progress(f"base: {_brief(report['base_figures'])}")
    report["base_without_cache"] = evaluate(base, None, sets, overrides={"workspace_cache": 0})  # as the base
    progress(f"base without the document's token cache: {_brief(report['base_without_cache'])}")
    cached = [f.text for f in training_files]  # what a workspace's token cache holds
    ordered: list[str] = []
    for name in recipes or list(workspaces.RECIPES):  # "X+cache" evaluates X's model: X trains first
        for step in (name.removesuffix("+cache"), name):
            if step not in ordered:
                ordered.append(step)
    for name in ordered:
        trained = name.removesuffix("+cache")
        if name == "cache":  # no training: the base model with the repository's token cache
            point = {"minutes": 0.0, "held_out_loss": None, **evaluate(base, None, sets, cached)}
            built = point["token_cache"]
            report["recipes"][name] = {"recipe": {"token_cache_tokens": built["tokens"]}, "steps": 0,
                                       "stopped": "no training", "wall_s": built["seconds"],
                                       "curve": [{"minutes": 0.0, "held_out_loss": None, **report["base_figures"]},
                                                 point]}  # fmt: skip
            progress(f"cache ({built['tokens']} tokens, {built['seconds']} s): {_brief(point)}")
            continue
        recipe, replay = workspaces.recipe(trained)
        out = work / trained
        if trained != name:  # the model X trained (just before), with the cache
            done = report["recipes"][trained]
            point = {**done["curve"][-1], **evaluate(str(out / "model"), None, sets, cached)}
            report["recipes"][name] = {**done, "curve": [done["curve"][0], point]}
            progress(f"{name} final: {_brief(point)}")
            continue
        shutil.rmtree(out, ignore_errors=True)  # a fresh run (an old one would resume with its budget spent)
        started = time.perf_counter()
        summary = training.run("cpu", out, minutes, start_from=base, overrides={**recipe, "snapshot_minutes": points},
                               repository=repository, replay=replay)  # fmt: skip
        trained_s = time.perf_counter() - started
        at, final = _losses(out)
        curve = [{"minutes": 0.0, "held_out_loss": summary.get("eval_before_diffusion"), **report["base_figures"]}]
        for point in sorted(at):
            snapshot = out / "snapshots" / f"{point:g}"
            adapter = snapshot / "adapter"
            model, adapter_arg = (base, str(adapter)) if adapter.is_dir() else (str(snapshot / "model"), None)
            curve.append({"minutes": point, "held_out_loss": at[point], **evaluate(model, adapter_arg, sets)})
            progress(f"{name} at {point:g} min: {_brief(curve[-1])}")
        curve.append({"minutes": round(final.get("elapsed", 0.0) / 60, 2), "held_out_loss": final.get("eval_diffusion"),
                      **evaluate(str(out / "model"), None, sets)})  # fmt: skip
        progress(f"{name} final: {_brief(curve[-1])}")
        report["recipes"][name] = {"recipe": {**recipe, "replay": replay}, "steps": final.get("step"),
                                   "stopped": final.get("stopped"), "wall_s": round(trained_s, 1),
                                   "curve": curve}  # fmt: skip
        if checkpoint is not None:
            checkpoint(report)
    report["scores"] = recipe_scores(report)
    report["best"] = best_recipe(report["scores"])
    return report


def _brief(figures: dict[str, Any]) -> str:
    return ", ".join(f"{name} exact {100 * f['exact_match']:.1f}% sim {100 * f['edit_similarity']:.1f}%"
                     for name, f in figures.items() if isinstance(f, dict) and "exact_match" in f)  # fmt: skip


def line_gain(base: dict[str, Any], point: dict[str, Any]) -> dict[str, Any]:
    """A point's held-out line edit similarity against the base's, in points, with its 95% interval over the lines
    (paired: the same lines; None for reports written before the per-task figures were kept)."""
    before, after = base["lines"], point["lines"]
    gain = {"gain": 100 * (after["edit_similarity"] - before["edit_similarity"]), "interval": None}
    if before.get("similarities") and after.get("similarities"):
        low, high = paired_interval(before["similarities"], after["similarities"])
        gain["interval"] = [100 * low, 100 * high]
    return gain


def recipe_scores(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each recipe's final model against the base, in points: held-out line similarity (with its interval, `line_gain`)
    and exact match, and HumanEval exact match where measured."""
    base = report["base_figures"]
    scores = {}
    for name, result in report["recipes"].items():
        last = result["curve"][-1]
        lines = line_gain(base, last)
        exact = 100 * (last["lines"]["exact_match"] - base["lines"]["exact_match"])
        general = 100 * (last["humaneval"]["exact_match"] - base["humaneval"]["exact_match"]) if "humaneval" in last \
            else None  # fmt: skip
        scores[name] = {"recipe": name, "lines_similarity_gain": lines["gain"], "lines_similarity_interval":
                        lines["interval"], "lines_exact_gain": exact, "humaneval_exact_change": general,
                        "keeps_exact": exact >= 0}  # fmt: skip
        if "base_without_cache" in report:  # against the model without any token cache (the base)
            scores[name]["lines_similarity_gain_over_no_cache"] = line_gain(report["base_without_cache"], last)["gain"]
    return scores


def best_recipe(scores: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """Of `recipe_scores`, the recipe whose final held-out line edit similarity is highest among those that keep line
    exact match at least the base's (the issue's rule)."""
    scored = list(scores.values())
    kept = [s for s in scored if s["keeps_exact"]] or scored
    return max(kept, key=lambda s: s["lines_similarity_gain"], default=None)


def format_repo(report: dict[str, Any]) -> str:
    sets = list(report["tasks"])
    header = (
        f"{'recipe':<12} {'min':>5} {'loss':>6} "
        + " ".join(f"{name + ' ex':>11} {name + ' sim':>12}" for name in sets)
        + f" {'empty':>6} {'tok/fwd':>7}"
    )
    lines = [f"bench repo: {report['repository']} ({report['files']} files, {report['held_out_files']} held out; "
             f"tasks {report['tasks']}), base {report['base']}", f"machine: {report['machine']}", header]  # fmt: skip

    def row(name: str, point: dict[str, Any]) -> str:
        loss = point.get("held_out_loss")
        cells = " ".join(f"{100 * point[s]['exact_match']:>10.1f}% {100 * point[s]['edit_similarity']:>11.1f}%"
                         for s in sets)  # fmt: skip
        shown = "-" if loss is None else f"{loss:.3f}"
        lines_set = point["lines"]
        return (f"{name:<12} {point['minutes']:>5.1f} {shown:>6} {cells} {100 * lines_set['empty_share']:>5.1f}% "
                f"{lines_set['tokens_per_forward']:>7.2f}")  # fmt: skip

    first = next(iter(report["recipes"].values()), None)  # every recipe's curve starts at the base's loss
    before = first["curve"][0]["held_out_loss"] if first else None
    if "base_without_cache" in report:  # reports before the document's token cache was on by default
        lines.append(row("base-nocache", {"minutes": 0.0, "held_out_loss": before, **report["base_without_cache"]}))
    lines.append(row("base", {"minutes": 0.0, "held_out_loss": before, **report["base_figures"]}))
    if "base_without_cache" in report:
        own = line_gain(report["base_without_cache"], report["base_figures"])
        shown = _gain(own["gain"], own["interval"])
        lines.append(f"{'':<12} (the document's own token cache: line similarity {shown})")
    scores = report.get("scores") or recipe_scores(report)  # reports written before scores were kept
    for name, result in report["recipes"].items():
        for point in result["curve"][1:]:
            lines.append(row(name, point))
        final = scores[name]
        lines.append(f"{'':<12} ({result['steps']} steps, stopped: {result['stopped']}, line similarity "
                     f"{_gain(final['lines_similarity_gain'], final['lines_similarity_interval'])}, "
                     f"recipe {result['recipe']})")  # fmt: skip
    best = report.get("best")
    if best:
        general = best["humaneval_exact_change"]
        lines.append(f"best: {best['recipe']}: held-out line similarity "
                     f"{_gain(best['lines_similarity_gain'], best.get('lines_similarity_interval'))}, "
                     f"exact {best['lines_exact_gain']:+.1f}, HumanEval exact "
                     f"{'n/a' if general is None else f'{general:+.1f}'} points"
                     + (f"; over the model without token caches {best['lines_similarity_gain_over_no_cache']:+.1f}"
                        if "lines_similarity_gain_over_no_cache" in best else ""))  # fmt: skip
        if best.get("lines_similarity_interval"):
            lines.append("(intervals: 95% over the held-out lines, paired with the base; the spread between two "
                         "training runs of one recipe comes on top)")  # fmt: skip
    return "\n".join(lines)


def _gain(gain: float, interval: list[float] | None) -> str:
    shown = f"{gain:+.1f} points"
    return shown if interval is None else f"{shown} (95% {interval[0]:+.1f} to {interval[1]:+.1f})"


def plot_repo(report: dict[str, Any], path: Path) -> Path:
    with figure(path, (10, 3.6), columns=3) as (drawn, axes):
        for name, result in report["recipes"].items():
            curve = result["curve"]
            minutes = [p["minutes"] for p in curve]
            axes[0].plot(minutes, [p["held_out_loss"] for p in curve], marker="o", label=name)
            axes[1].plot(minutes, [100 * p["lines"]["exact_match"] for p in curve], marker="o", label=name)
            axes[2].plot(minutes, [100 * p["lines"]["edit_similarity"] for p in curve], marker="o", label=name)
        for axis, title in zip(axes, ("held-out diffusion loss", "held-out line exact match (%)",
                                      "held-out line edit similarity (%)"), strict=True):  # fmt: skip
            axis.set_xlabel("training minutes")
            axis.set_title(title, fontsize=9)
        drawn.suptitle(f"bench repo: {Path(report['repository']).name}", fontsize=10)
    return path
