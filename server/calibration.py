"""Calibration of the display policy: which confidence score tells good answers from bad, and the threshold to show
them. Production code: `canvas-ls train --workspace` runs `calibrate_folder` on a tuned model; `canvas-ls bench
calibrate` (bench/calibrate.py: its table and plot) runs `run_calibrate` on the shipped one.

On a calibration set (single lines of held-out files: a training corpus's held-out split, or a repository's after
`canvas-ls train --corpus`; never the evaluation set) every task (the cursor after its line's indentation, or after
its first word) is asked as the server asks while typing, and judged by what it would show (`answer_rows`). An
answer is good when it is exact (whitespace-normalised), passes the task's tests, or has edit similarity >= 0.7 with
the solution. Each request mode (a begun line, a blank line: `confidence.MODES`) gets its own score and threshold.
Per score (`engine.confidence.SCORES`): the area under the ROC curve over the answers that wrote something (0.5: no
better than chance), and precision (share of shown answers that are good) against coverage (share of all requests
that show one) over every threshold. A score's threshold is the lowest whose precision reaches the target with at
least `min_shown` answers shown, else HIDDEN (1.0: nothing is shown while typing); HIDDEN too where the half that
did not choose it shows answers under the target. The score chosen is the one that shows the most at the target,
else the best precision, the area breaking ties: judged, with several sets, on each set in turn with the threshold
the others choose (`across_sets`: a score must hold on a repository it was not chosen on), else on the choice half.
Thresholds are chosen on half the calibration tasks (every other one) and checked on the other half (which, having
vetoed the thresholds it disagrees with, no longer measures them unseen). They are then applied to the evaluation
set (HumanEval), and the answers they hide are cut to their confident heads (`confident_head`) to measure how often
a head is a correct start of the solution.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..engine.confidence import (
    HIDDEN,
    MIN_SHOWN,
    MODES,
    SCORES,
    TARGET,
    WORKSPACE_LINES,
    confident_head,
    judged_tokens,
    scores,
)
from ..engine.corpus import read_repository_report
from ..engine.settings import MODEL_SETTINGS_FILE
from ..engine.tasks import Task, edit_similarity, load_tasks, machine, normalise, passes, typed
from .completion import request_settings
from .config import CompletionOptions
from .context import Skip, build_context
from .documents import Document
from .edits import checked_edit
from .languages import language_for

if TYPE_CHECKING:
    from ..engine.engine import Engine

GOOD_SIMILARITY = 0.7


def answer_rows(engine: Engine, dataset: Path, limit: int | None, run_tests: bool,
                progress: Callable[[int, int], None] | None = None,
                options: CompletionOptions | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """Each task asked once as the server asks while typing, the cursor after its line's indentation (the line gone: a
    blank line, where the server asks for a block) or, for two tasks in four, after its first word too (a line
    begun: the rest of it), and what the server would show: its context, engine settings and edit (shaped,
    syntax-checked: an answer the server rejects shows nothing). Per task the shown text, its tokens' confidences and
    texts, scores and labels."""
    options = options or CompletionOptions()
    rows = []
    tasks = load_tasks(dataset, limit, cursor="indented")
    for number, original in enumerate(tasks, 1):
        task = original
        if task.solution.endswith("\n"):  # HumanEval's line takes its end along: the editor keeps a blank line
            task = replace(task, solution=task.solution[:-1], suffix="\n" + task.suffix)
        if number % 4 in (3, 0):  # two tasks in four with the line's first word typed: both halves get both
            task = typed(task, "word")
        document, offset = _document(task), len(task.prompt)
        context = build_context(document, offset, options)
        result = None
        if not isinstance(context, Skip):
            result = engine.infill(context.prefix, context.suffix, request_settings(context, options, False).asked())
        edit = None if result is None else checked_edit(document, context, result.text, options.max_lines)
        text = "" if edit is None else edit.text[offset - edit.start :]  # from the cursor on
        token_texts, confidence, found, support = [], [], dict.fromkeys(SCORES, 1.0), 1.0
        if result is not None:  # scored by the server's own scorer (`confidence.scores`, what `judge` compares)
            token_texts, confidence, _ = judged_tokens(result, text)
            around = (document.text[: edit.start], document.text[edit.end :]) if edit else ("", "")
            found, support = scores(result, text, around)
        written = bool(text.strip())
        solution = task.solution.rstrip("\r\n")
        exact = written and normalise(text) == normalise(solution)
        passed = None
        if run_tests and written and task.test and task.entry_point:  # the original task's program, completed
            passed = passes(original, task.prompt[len(original.prompt) :] + text + "\n")
        similarity = edit_similarity(text, solution)
        rows.append({
            "task_id": task.task_id,
            "mode": "skip" if isinstance(context, Skip) else context.mode,
            "rejected": result is not None and bool(result.text.strip()) and edit is None,  # the syntax check
            "text": text,
            "solution": solution,
            "written": written,
            "exact": exact,
            "passed": passed,
            "edit_similarity": round(similarity, 4),
            "good": written and (exact or bool(passed) or similarity >= GOOD_SIMILARITY),
            "scores": {kind: round(value, 6) for kind, value in found.items()},
            "support": round(support, 4),
            "confidence": confidence,
            "token_texts": token_texts,
            "healed": "" if result is None else result.healed,
        })  # fmt: skip
        if progress is not None:
            progress(number, len(tasks))
    return rows


def _document(task: Task) -> Document:
    """The task's file as the editor would hold it (its language from the path in its id; HumanEval's: Python)."""
    path = task.task_id.rsplit(":", 1)[0]
    language = None if language_for(None, path) != "plaintext" else "python"
    return Document.open(f"file:///calibration/{path}", task.prompt + task.suffix, 1, language)


def auroc(scores: list[float], labels: list[bool]) -> float | None:
    """Probability that a good answer outscores a bad one (ties count half); None without both kinds."""
    good = [s for s, label in zip(scores, labels, strict=True) if label]
    bad = [s for s, label in zip(scores, labels, strict=True) if not label]
    if not good or not bad:
        return None
    wins = sum((g > b) + 0.5 * (g == b) for g in good for b in bad)
    return wins / (len(good) * len(bad))


def auroc_by_score(rows: list[dict[str, Any]], mode: str) -> dict[str, float | None]:
    """Each score's `auroc` over the answers written to requests of `mode`."""
    written = [r for r in rows if r["mode"] == mode and r["written"]]
    return {kind: auroc([r["scores"][kind] for r in written], [r["good"] for r in written]) for kind in SCORES}


def curve(rows: list[dict[str, Any]], kind: str) -> list[dict[str, float]]:
    """Precision and coverage at each threshold (each written answer's score), from showing all to showing one."""
    written = sorted((r for r in rows if r["written"]), key=lambda r: -r["scores"][kind])
    points, good = [], 0
    for shown, row in enumerate(written, 1):
        good += row["good"]
        nxt = written[shown]["scores"][kind] if shown < len(written) else None
        if nxt == row["scores"][kind]:
            continue  # a threshold shows every answer with this score or more
        points.append({"threshold": row["scores"][kind], "shown": shown, "coverage": shown / max(len(rows), 1),
                       "precision": good / shown})  # fmt: skip
    return points[::-1]  # lowest threshold (most shown) first


def at_policy(rows: list[dict[str, Any]], policy: dict[str, tuple[str, float]]) -> dict[str, Any]:
    """Coverage and precision when each answer scoring under its request mode's (score, threshold) is hidden; and
    the hidden ones' confident heads."""

    judged = [(r, *policy.get(r["mode"], policy[MODES[0]])) for r in rows if r["written"]]  # (row, kind, threshold)
    shown = [r for r, kind, threshold in judged if r["scores"][kind] >= threshold]
    hidden = [(r, kind, threshold) for r, kind, threshold in judged if r["scores"][kind] < threshold]
    heads = [(r, confident_head(r["token_texts"], r["confidence"], kind, threshold, r["healed"], r.get("support", 1.0)))
             for r, kind, threshold in hidden]  # fmt: skip
    heads = [(r, head) for r, head in heads if head.strip()]
    right = [r for r, head in heads if normalise(r["solution"]).startswith(normalise(head))]
    return {
        "policy": {mode: list(chosen) for mode, chosen in policy.items()},
        "tasks": len(rows),
        "written": sum(r["written"] for r in rows),
        "shown": len(shown),
        "coverage": len(shown) / max(len(rows), 1),
        "precision": statistics.fmean(r["good"] for r in shown) if shown else None,
        "precision_all_written": statistics.fmean(r["good"] for r in rows if r["written"]) if any(
            r["written"] for r in rows) else None,
        "exact_shown": sum(r["exact"] for r in shown),
        "heads_shown": len(heads),
        "heads_correct_start": len(right),
        "mean_head_chars": statistics.fmean(len(h) for _, h in heads) if heads else None,
    }  # fmt: skip


def at_threshold(rows: list[dict[str, Any]], kind: str, threshold: float) -> dict[str, Any]:
    """`at_policy` with one score and threshold for every request."""
    return at_policy(rows, {mode: (kind, threshold) for mode in MODES})


def choose(points: list[dict[str, float]], target: float, min_shown: int) -> tuple[float, bool]:
    """The lowest threshold reaching `target` precision with at least `min_shown` answers shown; else HIDDEN: a
    model that stands behind none of its answers shows none of them while typing. Returns (threshold, target met)."""
    for point in points:
        if point["shown"] >= min_shown and point["precision"] >= target:
            return point["threshold"], True
    return HIDDEN, False


def held_up(choice: dict[str, Any], check: list[dict[str, Any]], target: float) -> dict[str, Any]:
    """A mode's choice ({"score", "threshold", "target_met"}), or HIDDEN where the answers of the half that did not
    choose it (`check`) above its threshold fall under the target (kept in "withdrawn")."""
    held = at_threshold(check, choice["score"], choice["threshold"])
    if not choice["target_met"] or not held["shown"] or held["precision"] >= target:
        return choice
    gone = {"threshold": choice["threshold"], "held_out_shown": held["shown"],
            "held_out_precision": held["precision"]}  # fmt: skip
    return {"score": choice["score"], "threshold": HIDDEN, "target_met": False, "withdrawn": gone}


def best_precision(points: list[dict[str, float]], min_shown: int) -> float:
    """The best precision a threshold gives with at least `min_shown` answers shown (0 when none shows as many)."""
    return max((p["precision"] for p in points if p["shown"] >= min_shown), default=0.0)


def pick(points: dict[str, list[dict[str, float]]], areas: dict[str, float | None], target: float, min_shown: int,
         kinds: Sequence[str] = SCORES, across: dict[str, dict[str, Any]] | None = None,
         ) -> tuple[str, float, bool]:  # fmt: skip
    """The score, its threshold (`choose`) and whether it met `target`: of the scores that meet it, the one that
    shows the most; else the one whose best threshold comes closest; the area under the ROC curve breaks ties.
    With several sets (`across`, `across_sets`) a score is judged on the sets it was not chosen on."""

    def merit(kind: str) -> tuple[bool, float, float]:
        if across is not None:
            held = across[kind]
            met = held["shown"] >= min_shown and (held["precision"] or 0.0) >= target
            return met, held["shown"] if met else held["precision"] or 0.0, areas[kind] or 0.0
        threshold, met = choose(points[kind], target, min_shown)
        shown = next((p["shown"] for p in points[kind] if p["threshold"] == threshold), 0)
        return met, shown if met else best_precision(points[kind], min_shown), areas[kind] or 0.0

    kind = max(kinds, key=merit)
    return (kind, *choose(points[kind], target, min_shown))


def across_sets(parts: list[list[dict[str, Any]]], mode: str, target: float, min_shown: int) -> dict[str, Any]:
    """Per score, each set held out in turn: the threshold `choose` finds on the other sets' answers (of this
    request mode), applied to the held set's; shown and good answers pooled over the sets, and per set. What a
    score does on a repository it was not chosen on: alternate lines of the same files (the check half) share
    their names and idioms, and overrate a score that rewards short copies."""
    found: dict[str, Any] = {}
    for kind in SCORES:
        folds = []
        for index, held in enumerate(parts):
            others = [r for other, part in enumerate(parts) if other != index for r in part if r["mode"] == mode]
            threshold, met = choose(curve(others, kind), target, min_shown)
            shown = [r for r in held if r["mode"] == mode and r["written"] and r["scores"][kind] >= threshold]
            folds.append({"threshold": threshold, "met": met, "shown": len(shown),
                          "good": sum(r["good"] for r in shown)})  # fmt: skip
        shown, good = sum(f["shown"] for f in folds), sum(f["good"] for f in folds)
        found[kind] = {"shown": shown, "good": good, "precision": good / shown if shown else None, "folds": folds}
    return found


def set_name(path: Path) -> str:
    """A calibration set's name: a repository run's report by its repository, a file by its name."""
    if path.suffix == ".json":
        return f"{Path(str(read_repository_report(path)['root'])).name} (held-out files)"
    return path.name


def run_calibrate(engine: Engine, calibration: list[Path], evaluation: Path | None, limit: int | None,
                  target: float, min_shown: int, run_tests: bool,
                  progress: Callable[[str, int, int], None] | None = None) -> dict[str, Any]:  # fmt: skip
    """`calibration`: one or more sets, `limit` tasks of each, pooled; every other task of each set chooses the
    score and threshold, the rest checks them (`held_out`, also per set)."""

    def step(name: str) -> Callable[[int, int], None] | None:
        return None if progress is None else lambda done, total: progress(name, done, total)

    parts = {set_name(path): answer_rows(engine, path, limit, run_tests, step(f"calibration {set_name(path)}"))
             for path in calibration}  # fmt: skip
    rows = [row for part in parts.values() for row in part]
    fit = [row for part in parts.values() for row in part[::2]]
    check = [row for part in parts.values() for row in part[1::2]]
    chosen, fit_areas, points, across = {}, {}, {}, {}
    for mode in MODES:  # each kind of request its own score and threshold, chosen on its own answers
        fit_areas[mode] = auroc_by_score(fit, mode)
        points[mode] = {k: curve([r for r in fit if r["mode"] == mode], k) for k in SCORES}
        across[mode] = across_sets(list(parts.values()), mode, target, min_shown) if len(parts) > 1 else None
        kind, threshold, met = pick(points[mode], fit_areas[mode], target, min_shown, across=across[mode])
        chosen[mode] = held_up({"score": kind, "threshold": threshold, "target_met": met},
                               [r for r in check if r["mode"] == mode], target)  # fmt: skip
    policy = {mode: (c["score"], c["threshold"]) for mode, c in chosen.items()}

    def by_mode(some: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        return {mode: at_policy([r for r in some if r["mode"] == mode], policy) for mode in MODES}

    report: dict[str, Any] = {
        "model": engine.name,
        "dtype": engine.dtype,
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "target_precision": target,
        "min_shown": min_shown,
        "good_means": f"exact, passing, or edit similarity >= {GOOD_SIMILARITY}",
        "display": chosen,  # per request mode
        "target_met": all(c["target_met"] for c in chosen.values()),
        "calibration": {
            "dataset": "; ".join(parts),
            "auroc": fit_areas,
            "at_threshold": at_policy(fit, policy),
            "shown_all": at_threshold(fit, SCORES[0], 0.0),
            "modes": by_mode(fit),
            "across_sets": across,  # per mode: each score judged on the sets it was not chosen on (None: one set)
            "curves": points,
            "rows": rows,
        },
        "held_out": {  # the calibration tasks the choice never saw
            "at_threshold": at_policy(check, policy),
            "shown_all": at_threshold(check, SCORES[0], 0.0),
            "auroc": {mode: auroc_by_score(check, mode) for mode in MODES},
            "modes": by_mode(check),
            "sets": {name: at_policy(part[1::2], policy) for name, part in parts.items()},
        },
    }
    if evaluation is not None:
        eval_rows = answer_rows(engine, evaluation, limit, run_tests, step("evaluation"))
        report["evaluation"] = {
            "dataset": str(evaluation),
            "auroc": {mode: auroc_by_score(eval_rows, mode) for mode in MODES},
            "at_threshold": at_policy(eval_rows, policy),
            "shown_all": at_threshold(eval_rows, SCORES[0], 0.0),
            "modes": by_mode(eval_rows),
            "curves": {
                mode: curve([r for r in eval_rows if r["mode"] == mode], kind) for mode, (kind, _) in policy.items()
            },
            "rows": eval_rows,
        }
    return report


def calibrate_folder(model_dir: Path, calibration: Path, limit: int = WORKSPACE_LINES) -> dict[str, Any]:
    """Calibrate a model folder on held-out lines (a workspace run's `repository_report.json`: the repository's own
    code, with its document's token cache as the server answers it) and write its display policy; what was chosen,
    and how it held on the half that did not choose it."""
    from ..engine import Engine  # torch: only where a calibration runs

    engine = Engine.load(str(model_dir))
    report = run_calibrate(engine, [calibration], None, limit, TARGET, MIN_SHOWN, run_tests=False)
    write_threshold(model_dir, report)
    held = report["held_out"]["at_threshold"]
    return {"policy": report["display"], "target_met": report["target_met"],
            "lines": len(report["calibration"]["rows"]), "held_out_precision": held["precision"],
            "held_out_coverage": held["coverage"]}  # fmt: skip


def write_threshold(model_dir: Path, report: dict[str, Any]) -> Path:
    """The chosen scores and thresholds into the model folder's canvas_ls.json ("display", `Display`'s record: a
    begun line's at the top, a blank line's under "multi_line"), with how they were found."""
    path = model_dir / MODEL_SETTINGS_FILE
    record = json.loads(path.read_text()) if path.is_file() else {}
    found, held = report["calibration"]["at_threshold"], report["held_out"]["at_threshold"]
    line, block = report["display"]["single_line"], report["display"]["multi_line"]
    record["display"] = {
        "score": line["score"],
        "min_confidence": line["threshold"],
        "multi_line": {"score": block["score"], "min_confidence": block["threshold"]},
        "calibrated": {
            "date": report["date"],
            "set": report["calibration"]["dataset"],
            "tasks": found["tasks"],
            "target_precision": report["target_precision"],
            "target_met": {mode: c["target_met"] for mode, c in report["display"].items()},
            "precision": found["precision"],
            "coverage": found["coverage"],
            "held_out_precision": held["precision"],
            "held_out_coverage": held["coverage"],
            "auroc": report["calibration"]["auroc"],
        },
    }
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path
