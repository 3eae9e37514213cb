"""`canvas-ls bench calibrate`: which confidence score tells good answers from bad, and the threshold to show them.

On a calibration set (single lines of held-out files: a training corpus's held-out split, or a repository's after
`canvas-ls train --corpus`; never the evaluation set) every task is completed as the server asks while typing (one
line, the cursor after the indentation). An answer is good when it is exact (whitespace-normalised), passes the
task's tests, or has edit similarity >= 0.7 with the solution. Per score (`engine.confidence.SCORES`): the area
under the ROC curve over the answers that wrote something (0.5: no better than chance), and precision (share of
shown answers that are good) against coverage (share of all requests that show one) over every threshold. Each
score's threshold is the lowest whose precision reaches the target (with at least `min_shown` answers shown), else
the one with the best precision; the score chosen is the one that shows the most at the target (what the editor
gets from it), else the best precision, the area breaking ties; the report says when the target was missed. (The
area ranks answers over all thresholds; the editor sees one: a score can rank the bulk better and the few it shows
worse.) Score and threshold are chosen on half the calibration tasks (every other one) and checked on
the other half, which they never saw. The same threshold is then applied to the evaluation set (HumanEval), and the
answers it hides are cut to their confident heads (`confident_head`) to measure how often a head is a correct start
of the solution.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from canvas_ls.engine.bench import edit_similarity, figure, load_tasks, machine, normalise, passes
from canvas_ls.engine.confidence import (
    MIN_SHOWN,
    SCORES,
    TARGET,
    WORKSPACE_LINES,
    confident_head,
    copy_support,
    sequence_score,
    shown_tokens,
)
from canvas_ls.engine.corpus import read_repository_report
from canvas_ls.engine.engine import Engine
from canvas_ls.engine.settings import MODEL_SETTINGS_FILE

GOOD_SIMILARITY = 0.7
# What the server asks for while typing a line (server.config.CompletionOptions' single-line defaults).
TYPING = {"single_line": True, "gap_tokens": 16, "max_new_tokens": 48}


def answer_rows(engine: Engine, dataset: Path, limit: int | None, run_tests: bool,
                progress: Callable[[int, int], None] | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """Each task completed once; its text, per-token confidences and texts, scores and labels."""
    tasks = load_tasks(dataset, limit, cursor="indented")
    rows = []
    for number, task in enumerate(tasks, 1):
        result = engine.infill(task.prompt, task.suffix, TYPING)
        text = result.text.split("\n", 1)[0]  # what the editor shows of a one-line completion
        count = shown_tokens(result.token_texts, result.healed, text)  # the tokens that write it
        confidence, token_texts = result.confidence[:count], result.token_texts[:count]
        written = bool(text.strip())
        solution = task.solution.rstrip("\r\n")
        exact = written and normalise(text) == normalise(solution)
        passed = passes(task, text + "\n") if run_tests and written and task.test and task.entry_point else None
        similarity = edit_similarity(text, solution)
        support = copy_support(text, task.prompt, task.suffix)  # the document: the task's prompt and suffix
        rows.append({
            "task_id": task.task_id,
            "text": text,
            "solution": solution,
            "written": written,
            "exact": exact,
            "passed": passed,
            "edit_similarity": round(similarity, 4),
            "good": written and (exact or bool(passed) or similarity >= GOOD_SIMILARITY),
            "scores": {kind: round(sequence_score(confidence, kind, text, support), 6) for kind in SCORES},
            "support": round(support, 4),
            "confidence": confidence,
            "token_texts": token_texts,
            "healed": result.healed,
        })  # fmt: skip
        if progress is not None:
            progress(number, len(tasks))
    return rows


def auroc(scores: list[float], labels: list[bool]) -> float | None:
    """Probability that a good answer outscores a bad one (ties count half); None without both kinds."""
    good = [s for s, label in zip(scores, labels, strict=True) if label]
    bad = [s for s, label in zip(scores, labels, strict=True) if not label]
    if not good or not bad:
        return None
    wins = sum((g > b) + 0.5 * (g == b) for g in good for b in bad)
    return wins / (len(good) * len(bad))


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


def at_threshold(rows: list[dict[str, Any]], kind: str, threshold: float) -> dict[str, Any]:
    """Coverage and precision when answers scoring under `threshold` are hidden; and their confident heads."""
    shown = [r for r in rows if r["written"] and r["scores"][kind] >= threshold]
    hidden = [r for r in rows if r["written"] and r["scores"][kind] < threshold]
    heads = [(r, confident_head(r["token_texts"], r["confidence"], kind, threshold, r["healed"], r.get("support", 1.0)))
             for r in hidden]  # fmt: skip
    heads = [(r, head) for r, head in heads if head.strip()]
    right = [r for r, head in heads if normalise(r["solution"]).startswith(normalise(head))]
    return {
        "threshold": threshold,
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


def choose(points: list[dict[str, float]], target: float, min_shown: int) -> tuple[float, bool]:
    """The lowest threshold reaching `target` precision with at least `min_shown` answers; else the best
    precision's (lowest threshold among ties). Returns (threshold, target met)."""
    supported = [p for p in points if p["shown"] >= min_shown] or points
    if not supported:
        return 0.0, False
    for point in supported:
        if point["precision"] >= target:
            return point["threshold"], True
    best = max(p["precision"] for p in supported)
    return next(p["threshold"] for p in supported if p["precision"] == best), False


def pick(points: dict[str, list[dict[str, float]]], areas: dict[str, float | None], target: float, min_shown: int,
         kinds: Sequence[str] = SCORES) -> tuple[str, float, bool]:  # fmt: skip
    """The score, its threshold (`choose`) and whether it met `target`: of the scores that meet it, the one that
    shows the most; else the best precision; the area under the ROC curve breaks ties."""

    def merit(kind: str) -> tuple[bool, float, float]:
        threshold, met = choose(points[kind], target, min_shown)
        point = next((p for p in points[kind] if p["threshold"] == threshold), {"shown": 0, "precision": 0.0})
        return met, point["shown"] if met else point["precision"], areas[kind] or 0.0

    kind = max(kinds, key=merit)
    return (kind, *choose(points[kind], target, min_shown))


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
    labels = [r["good"] for r in fit if r["written"]]
    areas = {kind: auroc([r["scores"][kind] for r in fit if r["written"]], labels) for kind in SCORES}
    points = {k: curve(fit, k) for k in SCORES}
    kind, threshold, met = pick(points, areas, target, min_shown)
    report: dict[str, Any] = {
        "model": engine.name,
        "dtype": engine.dtype,
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "target_precision": target,
        "min_shown": min_shown,
        "good_means": f"exact, passing, or edit similarity >= {GOOD_SIMILARITY}",
        "score": kind,
        "threshold": threshold,
        "target_met": met,
        "calibration": {
            "dataset": "; ".join(parts),
            "auroc": areas,
            "at_threshold": at_threshold(fit, kind, threshold),
            "shown_all": at_threshold(fit, kind, 0.0),
            "curves": points,
            "rows": rows,
        },
        "held_out": {  # the calibration tasks the choice never saw
            "at_threshold": at_threshold(check, kind, threshold),
            "shown_all": at_threshold(check, kind, 0.0),
            "auroc": {
                k: auroc([r["scores"][k] for r in check if r["written"]], [r["good"] for r in check if r["written"]])
                for k in SCORES
            },
            "sets": {name: at_threshold(part[1::2], kind, threshold) for name, part in parts.items()},
        },
    }
    if evaluation is not None:
        eval_rows = answer_rows(engine, evaluation, limit, run_tests, step("evaluation"))
        eval_labels = [r["good"] for r in eval_rows if r["written"]]
        report["evaluation"] = {
            "dataset": str(evaluation),
            "auroc": {k: auroc([r["scores"][k] for r in eval_rows if r["written"]], eval_labels) for k in SCORES},
            "at_threshold": at_threshold(eval_rows, kind, threshold),
            "shown_all": at_threshold(eval_rows, kind, 0.0),
            "curves": {kind: curve(eval_rows, kind)},
            "rows": eval_rows,
        }
    return report


def calibrate_folder(model_dir: Path, calibration: Path, limit: int = WORKSPACE_LINES) -> dict[str, Any]:
    """Calibrate a model folder on held-out lines (a workspace run's `repository_report.json`: the repository's own
    code, with its document's token cache as the server answers it) and write its display threshold; what was
    chosen, and how it held on the half that did not choose it."""
    engine = Engine.load(str(model_dir))
    report = run_calibrate(engine, [calibration], None, limit, TARGET, MIN_SHOWN, run_tests=False)
    write_threshold(model_dir, report)
    held = report["held_out"]["at_threshold"]
    return {"score": report["score"], "min_confidence": report["threshold"], "target_met": report["target_met"],
            "lines": len(report["calibration"]["rows"]), "held_out_precision": held["precision"],
            "held_out_coverage": held["coverage"]}  # fmt: skip


def write_threshold(model_dir: Path, report: dict[str, Any]) -> Path:
    """The chosen score and threshold into the model folder's canvas_ls.json ("display"), with how they were found."""
    path = model_dir / MODEL_SETTINGS_FILE
    record = json.loads(path.read_text()) if path.is_file() else {}
    found = report["calibration"]["at_threshold"]
    record["display"] = {
        "score": report["score"],
        "min_confidence": report["threshold"],
        "calibrated": {
            "date": report["date"],
            "set": report["calibration"]["dataset"],
            "tasks": found["tasks"],
            "target_precision": report["target_precision"],
            "target_met": report["target_met"],
            "precision": found["precision"],
            "coverage": found["coverage"],
            "held_out_precision": report["held_out"]["at_threshold"]["precision"],
            "held_out_coverage": report["held_out"]["at_threshold"]["coverage"],
            "auroc": report["calibration"]["auroc"],
        },
    }
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def format_calibrate(report: dict[str, Any]) -> str:
    lines = [f"model {report['model']} ({report['dtype']}); {report['machine']}",
             f"good = {report['good_means']}; target precision {_pct(report['target_precision'])}%", ""]  # fmt: skip
    sets = [("calib. fit", report["calibration"]), ("calib. held", report["held_out"])]
    sets += [("evaluation", report["evaluation"])] if "evaluation" in report else []
    lines.append(f"{'AUROC':<18}" + "".join(f"{kind:>11}" for kind in SCORES))
    for name, part in sets:
        lines.append(f"{name:<18}" + "".join(f"{_pct(part['auroc'][k]):>11}" for k in SCORES))
    met = "met" if report["target_met"] else "MISSED: the best precision any threshold gives"
    lines += ["", f"chosen: score '{report['score']}', threshold {report['threshold']:.4f} (target {met})", ""]
    header = f"{'':<18}{'threshold':>10}{'tasks':>7}{'written':>9}{'shown':>7}{'coverage':>10}{'precision':>11}"
    lines.append(header + f"{'exact':>7}{'heads':>7}{'head ok':>9}")
    for name, part in sets:
        for label, row in (("all", part["shown_all"]), ("threshold", part["at_threshold"])):
            lines.append(
                f"{name + ' ' + label[:3]:<18}{row['threshold']:>10.4f}{row['tasks']:>7}{row['written']:>9}"
                f"{row['shown']:>7}{_pct(row['coverage']):>10}{_pct(row['precision']):>11}{row['exact_shown']:>7}"
                f"{row['heads_shown']:>7}{row['heads_correct_start']:>9}"
            )
    if len(report["held_out"].get("sets", {})) > 1:
        lines += ["", "calib. held at the threshold, per set:"]
        for name, row in report["held_out"]["sets"].items():
            lines.append(f"  {name}: shown {row['shown']} of {row['tasks']} ({_pct(row['coverage'])}%), "
                         f"precision {_pct(row['precision'])}%, exact {row['exact_shown']}")  # fmt: skip
    return "\n".join(lines)


def plot_calibrate(report: dict[str, Any], path: Path) -> Path:
    """Precision against coverage, each score on the calibration set and the chosen one on the evaluation set."""
    with figure(path, (6.4, 4.2)) as (_, axis):
        _draw_calibration(report, axis)
    return path


def _draw_calibration(report: dict[str, Any], axis: Any) -> None:
    for kind in SCORES:
        points = report["calibration"]["curves"][kind]
        axis.plot([p["coverage"] for p in points], [p["precision"] for p in points], label=f"calibration, {kind}")
    if "evaluation" in report:
        points = report["evaluation"]["curves"][report["score"]]
        axis.plot([p["coverage"] for p in points], [p["precision"] for p in points], "k--",
                  label=f"evaluation, {report['score']}")  # fmt: skip
    chosen = report["calibration"]["at_threshold"]
    if chosen["precision"] is not None:
        axis.plot([chosen["coverage"]], [chosen["precision"]], "ro", label=f"threshold {report['threshold']:.3f}")
    axis.axhline(report["target_precision"], color="grey", linewidth=0.8, linestyle=":")
    axis.set_xlabel("coverage (share of requests that show an answer)")
    axis.set_ylabel("precision (share of shown answers that are good)")
    axis.set_ylim(0, 1.02)
    axis.set_title(f"confidence calibration ({report['model']})", fontsize=10)
