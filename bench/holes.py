"""`canvas-ls bench holes`: several holes in one canvas vs one at a time, and span rewrites, on HumanEval programs.

The multi-hole set comes from a HumanEval-SingleLineInfilling-format file: the rows of one problem are the same
program with one line removed each, so removing k of those lines (pairwise apart, not adjacent) gives a program with
k holes whose tests still run. Each hole is a line's code after its indentation (an editor's placeholder spot).

Compared, in one run, with the same model and settings:
    joint       all holes in one canvas (`Engine.fill`): each sees the code on both sides and the other holes' drafts
    sequential  holes filled one at a time, left to right, each seeing the earlier fills and the later holes empty
Reported per mode and number of holes: pass@1 (all holes right), per-hole exact match (whitespace-normalised),
decoder forward passes, wall time, and the ratios. Then a rewrite table: a line with one token corrupted (a wrong
operator, or a variable misspelt), rewritten at strengths 0.3 / 0.6 / 1.0: the share restored exactly.
"""

from __future__ import annotations

import itertools
import re
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..engine.engine import Engine
from ..engine.regions import Hole
from ..engine.tasks import Task, edit_similarity, load_tasks, machine, normalise, passes, spread
from .core import figure

MODES = ("joint", "sequential")
STRENGTHS = (0.3, 0.6, 1.0)


@dataclass(frozen=True)
class HoleTask:
    task_id: str
    program: str  # the whole solution
    holes: tuple[tuple[int, int], ...]  # [start, end) of each removed line's code (after its indentation)
    test: str | None
    entry_point: str | None

    def solution(self, index: int) -> str:
        start, end = self.holes[index]
        return self.program[start:end]


def _line_number(task_id: str) -> int:
    return int(task_id.rsplit("/L", 1)[1])


def hole_tasks(dataset: Path, holes: int, limit: int | None = None) -> list[HoleTask]:
    """Programs with `holes` separate lines removed: per problem, the evenly spread choice of its removed lines
    that are pairwise at least one line apart and not blank."""
    problems: dict[str, list[Task]] = {}
    for task in load_tasks(dataset):
        problems.setdefault(task.task_id.rsplit("/L", 1)[0], []).append(task)
    out: list[HoleTask] = []
    for name, rows in problems.items():
        # The rows of a problem hold the same program, but for a blank line some rows drop: keep the most common.
        programs = Counter(r.prompt + r.solution + r.suffix for r in rows)
        program = programs.most_common(1)[0][0]
        rows = sorted((r for r in rows if r.solution.strip() and r.prompt + r.solution + r.suffix == program),
                      key=lambda r: _line_number(r.task_id))  # fmt: skip
        if len(rows) < holes:
            continue
        chosen = _spread(rows, holes)
        if chosen is None:
            continue
        spans = []
        for row in chosen:
            start = len(row.prompt) + len(row.solution) - len(row.solution.lstrip(" \t"))
            spans.append((start, len(row.prompt) + len(row.solution.rstrip("\n"))))
        out.append(HoleTask(f"{name}/holes{holes}", program, tuple(spans), rows[0].test, rows[0].entry_point))
    return spread(out, limit)


def _spread(rows: list[Task], k: int) -> list[Task] | None:
    lines = [_line_number(r.task_id) for r in rows]
    if k == 1:
        return [rows[len(rows) // 2]]
    evenly = [round(i * (len(rows) - 1) / (k - 1)) for i in range(k)]
    for picks in itertools.chain([evenly], itertools.combinations(range(len(rows)), k)):
        if len(set(picks)) == k and all(lines[b] - lines[a] >= 2 for a, b in itertools.pairwise(sorted(picks))):
            return [rows[i] for i in sorted(picks)]
    return None


def _joint(engine: Engine, task: HoleTask, settings: dict[str, Any]) -> tuple[list[str], int, float]:
    parts: list[str | Hole] = []
    position = 0
    for start, end in task.holes:
        parts += [task.program[position:start], Hole()]
        position = end
    started = time.perf_counter()
    result = engine.fill(parts[0], parts[1:], task.program[position:], settings)  # type: ignore[arg-type]
    return [gap.text for gap in result.gaps], result.forward_passes, time.perf_counter() - started


def _sequential(engine: Engine, task: HoleTask, settings: dict[str, Any]) -> tuple[list[str], int, float]:
    answers: list[str] = []
    forwards, seconds = 0, 0.0
    for index in range(len(task.holes)):
        # The earlier holes hold their answers; this one and the later ones are empty.
        document, starts = _document(task, {**dict(enumerate(answers)), **dict.fromkeys(range(index, 99), "")})
        started = time.perf_counter()
        result = engine.infill(document[: starts[index]], document[starts[index] :], settings)
        seconds += time.perf_counter() - started
        forwards += result.forward_passes
        answers.append(result.text)
    return answers, forwards, seconds


def _document(task: HoleTask, fills: dict[int, str]) -> tuple[str, list[int]]:
    """The program with hole i replaced by fills[i] (a hole not in `fills` keeps its code), and where each hole
    starts in it."""
    pieces, starts, position, length = [], [], 0, 0
    for index, (start, end) in enumerate(task.holes):
        pieces += [task.program[position:start], fills.get(index, task.program[start:end])]
        starts.append(length + start - position)
        length += len(pieces[-2]) + len(pieces[-1])
        position = end
    return "".join([*pieces, task.program[position:]]), starts


def run_holes(engine: Engine, dataset: Path, counts: tuple[int, ...] = (2, 3), limit: int | None = None,
              run_tests: bool = True, settings: dict[str, Any] | None = None,
              rewrite_limit: int | None = None) -> dict[str, Any]:  # fmt: skip
    settings = settings or {}
    report: dict[str, Any] = {"dataset": str(dataset), "model": engine.name, "dtype": engine.dtype,
                              "settings": engine.settings.merged(settings).to_dict(), "machine": machine(),
                              "holes": {}}  # fmt: skip
    for count in counts:
        tasks = hole_tasks(dataset, count, limit)
        rows = []
        for task in tasks:
            row: dict[str, Any] = {"task_id": task.task_id}
            for mode, run in (("joint", _joint), ("sequential", _sequential)):
                answers, forwards, seconds = run(engine, task, settings)
                exact = [normalise(a) == normalise(task.solution(i)) for i, a in enumerate(answers)]
                similarity = [edit_similarity(a.strip(), task.solution(i)) for i, a in enumerate(answers)]
                filled = _document(task, dict(enumerate(answers)))[0]
                program = Task(task.task_id, filled, "", "", task.test, task.entry_point)
                tested = run_tests and task.test and task.entry_point
                row[mode] = {"answers": answers, "exact": exact, "edit_similarity": similarity,
                             "forward_passes": forwards, "seconds": seconds,
                             "passed": passes(program, "") if tested else None}  # fmt: skip
            rows.append(row)
        report["holes"][str(count)] = {"tasks": len(rows), **_summary(rows), "rows": rows}
    report["rewrite"] = run_rewrites(engine, dataset, rewrite_limit if rewrite_limit is not None else limit, settings)
    return report


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in MODES:
        results = [row[mode] for row in rows]
        tested = [r["passed"] for r in results if r["passed"] is not None]
        out[mode] = {
            "pass_at_1": statistics.fmean(tested) if tested else None,
            "hole_exact": statistics.fmean(e for r in results for e in r["exact"]) if results else 0.0,
            "hole_edit_similarity": statistics.fmean(e for r in results for e in r["edit_similarity"])
            if results
            else 0.0,
            "hole_empty": statistics.fmean(not a.strip() for r in results for a in r["answers"]) if results else 0.0,
            "forward_passes": sum(r["forward_passes"] for r in results),
            "seconds": sum(r["seconds"] for r in results),
        }
    joint, sequential = out["joint"], out["sequential"]
    out["ratios"] = {
        "forward_passes_joint_over_sequential": joint["forward_passes"] / max(sequential["forward_passes"], 1),
        "wall_time_joint_over_sequential": joint["seconds"] / max(sequential["seconds"], 1e-9),
        "hole_exact_difference_points": 100 * (joint["hole_exact"] - sequential["hole_exact"]),
    }
    return out


# One token corrupted: an operator swapped, else a variable misspelt (its last letter dropped).
_SWAPS = {"==": "!=", "!=": "==", "<=": ">", ">=": "<", "+": "-", "-": "+", "<": ">", ">": "<", "*": "/"}
_OPERATOR = re.compile(r"==|!=|<=|>=|(?<![*/<>=!+\-])[+\-*<>](?![*/<>=+\-])")
_NAME = re.compile(r"\b(?!(?:return|for|in|if|else|elif|while|and|or|not|is|None|True|False|def|lambda)\b)"
                   r"[a-z_][a-z_0-9]{2,}\b")  # fmt: skip


def corrupt(line: str) -> str | None:
    """The line with one token corrupted, or None when it has no operator or variable to corrupt."""
    match = _OPERATOR.search(line)
    if match is not None:
        return line[: match.start()] + _SWAPS[match.group()] + line[match.end() :]
    match = _NAME.search(line)
    if match is not None:
        return line[: match.start()] + match.group()[:-1] + line[match.end() :]
    return None


def run_rewrites(engine: Engine, dataset: Path, limit: int | None, settings: dict[str, Any]) -> dict[str, Any]:
    tasks = [t for t in load_tasks(dataset, None, "indented") if corrupt(t.solution.rstrip("\n"))]
    tasks = spread(tasks, limit)
    rows = []
    for task in tasks:
        original = task.solution.rstrip("\n")
        broken = corrupt(original)
        row: dict[str, Any] = {"task_id": task.task_id, "original": original, "corrupted": broken}
        for strength in STRENGTHS:
            suffix = task.solution[len(original) :] + task.suffix
            result = engine.fill(task.prompt, [Hole(broken or "", strength)], suffix, settings)
            text = result.gaps[0].text
            row[str(strength)] = {"text": text, "restored": normalise(text) == normalise(original),
                                  "kept_corruption": normalise(text) == normalise(broken or ""),
                                  "similarity": edit_similarity(text, original),
                                  "forward_passes": result.forward_passes}  # fmt: skip
        rows.append(row)
    summary = {
        str(s): {
            "restored": statistics.fmean(r[str(s)]["restored"] for r in rows) if rows else 0.0,
            "kept_corruption": statistics.fmean(r[str(s)]["kept_corruption"] for r in rows) if rows else 0.0,
            "similarity": statistics.fmean(r[str(s)]["similarity"] for r in rows) if rows else 0.0,
            "forward_passes": sum(r[str(s)]["forward_passes"] for r in rows),
        }
        for s in STRENGTHS
    }
    return {"tasks": len(rows), "by_strength": summary, "rows": rows}


def format_holes(report: dict[str, Any]) -> str:
    lines = [f"{report['dataset']}, model {report['model']} ({report['dtype']})", report["machine"], ""]
    lines.append(f"{'holes':<7}{'mode':<12}{'tasks':>6}{'pass@1':>8}{'hole exact':>12}{'edit sim':>10}{'empty':>7}"
                 f"{'forwards':>10}{'wall s':>9}")  # fmt: skip
    for count, block in report["holes"].items():
        for mode in MODES:
            s = block[mode]
            pass_at_1 = f"{100 * s['pass_at_1']:.1f}" if s["pass_at_1"] is not None else "-"
            lines.append(f"{count:<7}{mode:<12}{block['tasks']:>6}{pass_at_1:>8}{100 * s['hole_exact']:>12.1f}"
                         f"{100 * s['hole_edit_similarity']:>10.1f}{100 * s['hole_empty']:>7.1f}"
                         f"{s['forward_passes']:>10}{s['seconds']:>9.2f}")  # fmt: skip
        r = block["ratios"]
        lines.append(f"{'':<7}joint / sequential: forward passes {r['forward_passes_joint_over_sequential']:.2f}x, "
                     f"wall time {r['wall_time_joint_over_sequential']:.2f}x, hole exact "
                     f"{r['hole_exact_difference_points']:+.1f} points")  # fmt: skip
    rewrite = report["rewrite"]
    lines += ["", f"rewrite of a line with one token corrupted ({rewrite['tasks']} lines)",
              f"{'strength':<10}{'restored':>10}{'kept as is':>12}{'edit sim':>10}{'forwards':>10}"]  # fmt: skip
    for strength, s in rewrite["by_strength"].items():
        lines.append(f"{strength:<10}{100 * s['restored']:>9.1f}%{100 * s['kept_corruption']:>11.1f}%"
                     f"{100 * s['similarity']:>9.1f}%{s['forward_passes']:>10}")  # fmt: skip
    return "\n".join(lines)


def plot_holes(report: dict[str, Any], path: Path) -> Path:
    """Forward passes and wall time per task by number of holes, joint vs sequential."""
    counts = [int(c) for c in report["holes"]]
    with figure(path, (9, 3.6), columns=2) as (drawn, axes):
        for axis, key, label in ((axes[0], "forward_passes", "decoder forward passes per task"),
                                 (axes[1], "seconds", "wall time per task (s)")):  # fmt: skip
            for mode, marker in zip(MODES, ("o", "s"), strict=True):
                values = [report["holes"][str(c)][mode][key] / max(report["holes"][str(c)]["tasks"], 1)
                          for c in counts]  # fmt: skip
                axis.plot(counts, values, marker=marker, label=mode)
            axis.set_xlabel("holes per program")
            axis.set_xticks(counts)
            axis.set_title(label)
        drawn.suptitle(f"several holes in one canvas vs one at a time ({report['model']})", fontsize=10)
    return path


__all__ = ["HoleTask", "corrupt", "format_holes", "hole_tasks", "plot_holes", "run_holes"]
