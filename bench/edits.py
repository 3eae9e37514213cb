"""`canvas-ls bench edits`: next-edit suggestions replayed from a repository's held-out commits.

The newest `--commits` commits of the repository (`engine/commits.py`: first-parent, merges and renames skipped, never
trained on by `train --workspace --edits`) are replayed through a real `canvas-ls serve` over stdio, once per
predictor. For each changed file with 2+ hunks, the editor opens the file as it was, applies the first hunks as the
user's edits (one `didChange` each) and asks `canvas/nextEdit` at the end of the last one; the next hunk is the
answer. For each such file it also asks, after all its hunks, at a line at least a window away from every hunk: an
unchanged window, where the right answer is no suggestion.

Reported per predictor (and for the server's default, `repeat` then `canvas` where `repeat` shows nothing, derived
from the two runs): exact match of the top suggestion with the next hunk, location (its lines meet the hunk's), edit
similarity of the changed lines (beside leaving them as they are), unchanged windows left alone, shown rate and
precision at the configured thresholds and over a sweep of thresholds (the plot; the lowest threshold whose shown
suggestions are >= 50% exact is the calibrated one), latency p50/p95 through the server. Every suggestion is
returned (`min_confidence` 0) so that the thresholds are applied here.
"""

from __future__ import annotations

import asyncio
import difflib
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lsprotocol import types

from ..engine.commits import FileChange, Hunk, farthest_line, history, mine, split
from ..engine.tasks import machine
from ..server.config import PREDICTORS, NextEditOptions
from ..server.positions import LineIndex
from .core import figure, percentile
from .lsp import end_session, start_session

THRESHOLDS = [round(0.05 * i, 2) for i in range(21)]
TARGET_PRECISION = 0.5


@dataclass(frozen=True)
class Case:
    change: FileChange
    applied: int  # hunks applied as the user's edits before asking
    cursor: int  # where it asks: an offset of the text with those hunks applied
    target: Hunk | None  # the next hunk as it stands in that text; None: an unchanged window (nothing to suggest)


def cases(changes: list[FileChange], per_file: int, limit: int, window_lines: int) -> list[Case]:
    """Up to `per_file` next-hunk cases and one unchanged window per file change with 2+ hunks, `limit` in all."""
    found: list[Case] = []
    for change in changes:
        if len(change.hunks) < 2:
            continue
        for applied in range(1, min(len(change.hunks), per_file + 1)):
            text, placed = change.applied(applied - 1)
            typed = placed[applied - 1].narrowed(text)  # the last edit as typed: the cursor at its end
            found.append(Case(change, applied, typed.start + len(typed.text), change.applied(applied)[1][applied]))
        text, placed = change.applied(len(change.hunks))
        quiet = farthest_line(text, placed, window_lines)
        if quiet is not None:
            found.append(Case(change, len(change.hunks), quiet, None))
    return found[:limit]


async def _ask(client: Any, repo: Path, case: Case) -> tuple[list[Any], str | None, float]:
    """Open the file as it was, apply the case's hunks as edits, ask at its cursor: (edits, the server's reason
    when there are none, milliseconds)."""
    change = case.change
    uri = (repo / change.path).resolve().as_uri()
    client.text_document_did_open(
        types.DidOpenTextDocumentParams(types.TextDocumentItem(uri, change.language, 1, change.before))
    )
    for number in range(case.applied):
        text, placed = change.applied(number)
        index, hunk = LineIndex(text), placed[number].narrowed(text)
        edit_range = types.Range(types.Position(*index.position(hunk.start)), types.Position(*index.position(hunk.end)))
        client.text_document_did_change(types.DidChangeTextDocumentParams(
            types.VersionedTextDocumentIdentifier(version=number + 2, uri=uri),
            [types.TextDocumentContentChangePartial(range=edit_range, text=hunk.text)]))  # fmt: skip
    text, _ = change.applied(case.applied)
    line, character = LineIndex(text).position(case.cursor)
    params = {"textDocument": {"uri": uri, "version": case.applied + 1},
              "position": {"line": line, "character": character}}  # fmt: skip
    started = time.perf_counter()
    answer = await client.protocol.send_request_async("canvas/nextEdit", params)
    elapsed = 1000 * (time.perf_counter() - started)
    client.text_document_did_close(types.DidCloseTextDocumentParams(types.TextDocumentIdentifier(uri)))
    return [e for e in answer.edits if e.textDocument.uri == uri], answer.reason, elapsed


def _judge(case: Case, edits: list[Any]) -> dict[str, Any]:
    """One answer against the case: the top suggestion's confidence, and for a next-hunk case whether it is the
    hunk exactly, whether it is in the hunk's lines, and the edit similarity of the changed lines."""
    result: dict[str, Any] = {"confidence": edits[0].confidence if edits else None,
                              "commit": case.change.commit[:12], "path": case.change.path}  # fmt: skip
    if edits:  # what it suggested, for reading the JSON
        top = edits[0].range
        result["top"] = {"line": top.start.line, "end_line": top.end.line, "text": edits[0].newText}
    if case.target is None:
        return result
    text, _ = case.change.applied(case.applied)
    index, target = LineIndex(text), case.target
    expected = text[: target.start] + target.text + text[target.end :]
    start = end = None
    predicted = text
    if edits:
        top = edits[0].range
        start = index.offset(top.start.line, top.start.character)
        end = index.offset(top.end.line, top.end.character)
        predicted = text[:start] + edits[0].newText + text[end:]
    lines = (index.line_of(target.start), index.line_of(max(target.start, target.end - 1)))
    result["target"] = {"line": lines[0], "end_line": lines[1], "old": text[target.start : target.end][:200],
                        "text": target.text[:200]}  # fmt: skip
    first = min(target.start, start if start is not None else target.start)
    last = max(target.end, end if end is not None else target.end)
    left = index.starts[index.line_of(first)]
    right = text.find("\n", last)
    right = len(text) if right < 0 else right
    tail = len(text) - right  # the text after the changed lines, the same in every version

    def lines_of(version: str) -> str:
        return version[left : len(version) - tail]

    result["similarity"] = difflib.SequenceMatcher(None, lines_of(predicted), lines_of(expected)).ratio()
    result["similarity_unchanged"] = difflib.SequenceMatcher(None, lines_of(text), lines_of(expected)).ratio()
    result["exact"] = bool(edits) and predicted == expected
    result["location"] = start is not None and not (
        index.line_of(max(start, end - 1)) < lines[0] or index.line_of(start) > lines[1]
    )
    return result


async def _drive(repo: Path, found: list[Case], predictor: str, init: dict[str, Any]) -> list[dict[str, Any]]:
    command = [sys.executable, "-m", "canvas_ls.server.cli", "serve", "--log-level", "WARNING"]
    client, drain = await start_session(f"canvas-ls-bench-edits-{predictor}", command, init)
    results = []
    try:
        for number, case in enumerate(found):
            edits, reason, elapsed = await _ask(client, repo, case)
            results.append({**_judge(case, edits), "ms": elapsed, "next": case.target is not None, "reason": reason})
            print(f"\r{predictor}: {number + 1}/{len(found)}", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
    finally:
        await end_session(client, drain)
    return results


def _default(repeat: dict[str, Any], canvas: dict[str, Any]) -> dict[str, Any]:
    """The server's default order: `repeat`'s answer where it found one, the canvas's otherwise."""
    if repeat["confidence"] is not None:
        return {**repeat, "predictor": "repeat"}
    return {**canvas, "ms": repeat["ms"] + canvas["ms"], "predictor": "canvas"}


def _summary(results: list[dict[str, Any]], threshold: float | dict[str, float]) -> dict[str, Any]:
    def floor(result: dict[str, Any]) -> float:
        return threshold if isinstance(threshold, float) else threshold[result.get("predictor", "repeat")]

    def shown(result: dict[str, Any]) -> bool:
        return result["confidence"] is not None and result["confidence"] >= floor(result)

    nexts = [r for r in results if r["next"]]
    quiet = [r for r in results if not r["next"]]
    suggested = [r for r in nexts if r["confidence"] is not None]
    visible = [r for r in nexts if shown(r)]
    times = [r["ms"] for r in results]

    def share(part: int, whole: int) -> float | None:
        return part / whole if whole else None

    return {
        "cases": len(nexts),
        "suggested": share(len(suggested), len(nexts)),
        "exact": share(sum(r["exact"] for r in nexts), len(nexts)),
        "location": share(sum(r["location"] for r in nexts), len(nexts)),
        "similarity": share(sum(r["similarity"] for r in suggested), len(suggested)),
        "similarity_unchanged": share(sum(r["similarity_unchanged"] for r in suggested), len(suggested)),
        "shown": share(len(visible), len(nexts)),
        "precision": share(sum(r["exact"] for r in visible), len(visible)),
        "unchanged_windows": len(quiet),
        "unchanged_left_alone": share(sum(not shown(r) for r in quiet), len(quiet)),
        "p50_ms": percentile(times, 0.5) if times else None,
        "p95_ms": percentile(times, 0.95) if times else None,
    }


def _sweep(results: list[dict[str, Any]]) -> dict[str, Any]:
    rows = [{"threshold": t, **_summary(results, t)} for t in THRESHOLDS]
    calibrated = next((row["threshold"] for row in rows
                       if row["precision"] is not None and row["precision"] >= TARGET_PRECISION), None)  # fmt: skip
    return {"rows": [{k: row[k] for k in ("threshold", "shown", "precision", "unchanged_left_alone")} for row in rows],
            "calibrated": calibrated}  # fmt: skip


def run_edits_bench(repo: Path, commits: int, model: str | None, device: str, per_file: int, limit: int,
                    options: dict[str, Any], skip: int = 0) -> dict[str, Any]:  # fmt: skip
    """Mine the held-out commits (after leaving out the newest `skip`), replay them per predictor, and summarise
    (module docstring)."""
    base = NextEditOptions(**options)
    all_commits = history(repo)
    training, held = split(all_commits[: len(all_commits) - skip], commits)
    mined = mine(repo, held)
    found = cases(mined.changes, per_file, limit, base.window_lines)
    if not found:
        raise ValueError(f"{repo}: no held-out commit of the newest {commits} changes a file in 2+ places "
                         f"(skipped: {dict(mined.skipped)})")  # fmt: skip
    results: dict[str, list[dict[str, Any]]] = {}
    for predictor in PREDICTORS:
        next_edit = {**options, "predictors": [predictor], "min_confidence": dict.fromkeys(PREDICTORS, 0.0)}
        init = {"engine": {"model": model, "device": device}, "next_edit": next_edit}
        results[predictor] = asyncio.run(_drive(repo, found, predictor, init))
    results["default"] = [_default(r, c) for r, c in zip(results["repeat"], results["canvas"], strict=True)]
    thresholds = base.min_confidence
    summary = {name: _summary(rows, thresholds if name == "default" else thresholds[name])
               for name, rows in results.items()}  # fmt: skip
    return {
        "repository": str(repo),
        "model": model or "(default)",
        "machine": machine(),
        "held_out_commits": len(held),
        "skipped_newest": skip,
        "training_commits": len(training),
        "file_changes": len(mined.changes),
        "skipped": dict(mined.skipped),
        "window_lines": base.window_lines,
        "thresholds": thresholds,
        "summary": summary,
        "sweep": {name: _sweep(rows) for name, rows in results.items() if name in PREDICTORS},
        "results": results,
    }


def format_edits(report: dict[str, Any]) -> str:
    def cell(value: float | None, scale: float = 100, unit: str = "%") -> str:
        return "-" if value is None else f"{scale * value:.1f}{unit}"

    older = f" (the newest {report['skipped_newest']} left out first)" if report.get("skipped_newest") else ""
    lines = [f"next edits replayed from the newest {report['held_out_commits']} commits{older} of "
             f"{report['repository']} "
             f"({report['file_changes']} changed files; skipped: {report['skipped'] or 'none'})",
             f"model {report['model']}, {report['machine']}, window {2 * report['window_lines'] + 1} lines, "
             f"thresholds {report['thresholds']}", ""]  # fmt: skip
    header = ["predictor", "cases", "suggested", "exact", "location", "similarity", "(as is)", "shown", "precision",
              "unchanged left", "p50 ms", "p95 ms"]  # fmt: skip
    lines.append("  ".join(f"{h:>10}" for h in header))
    for name, s in report["summary"].items():
        row = [name, str(s["cases"]), cell(s["suggested"]), cell(s["exact"]), cell(s["location"]),
               cell(s["similarity"]), cell(s["similarity_unchanged"]), cell(s["shown"]), cell(s["precision"]),
               f"{cell(s['unchanged_left_alone'])} of {s['unchanged_windows']}", cell(s["p50_ms"], 1, ""),
               cell(s["p95_ms"], 1, "")]  # fmt: skip
        lines.append("  ".join(f"{c:>10}" for c in row))
    for name, sweep in report["sweep"].items():
        lines.append(f"{name}: calibrated threshold (shown >= {TARGET_PRECISION:.0%} exact): "
                     f"{sweep['calibrated'] if sweep['calibrated'] is not None else 'none reaches it'}")  # fmt: skip
    return "\n".join(lines)


def plot_edits(report: dict[str, Any], path: Path) -> Path:
    """Shown rate and precision against the threshold, per predictor."""
    with figure(path, (6.5, 4)) as (_, axis):
        for name, sweep in report["sweep"].items():
            rows = sweep["rows"]
            xs = [row["threshold"] for row in rows]
            axis.plot(xs, [row["shown"] or 0 for row in rows], label=f"{name}: shown")
            precision = [float("nan") if row["precision"] is None else row["precision"] for row in rows]
            axis.plot(xs, precision, "--", label=f"{name}: exact among shown")
        axis.axhline(TARGET_PRECISION, color="grey", linewidth=0.8)
        axis.set_xlabel("confidence threshold")
        axis.set_ylabel("share of next-hunk cases")
        axis.set_title("next edits on held-out commits", fontsize=10)
    return path
