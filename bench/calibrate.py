"""`canvas-ls bench calibrate`: the production calibration (`server/calibration.py`) run on calibration sets and an
evaluation set, printed as a table (AUROC per score and request mode, coverage and precision at the thresholds)
and drawn as precision against coverage."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..engine.confidence import MODES, SCORES
from ..server.calibration import best_precision
from .core import figure


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def format_calibrate(report: dict[str, Any]) -> str:
    lines = [f"model {report['model']} ({report['dtype']}); {report['machine']}",
             f"good = {report['good_means']}; target precision {_pct(report['target_precision'])}%"]  # fmt: skip
    sets = [("calib. fit", report["calibration"]), ("calib. held", report["held_out"])]
    sets += [("evaluation", report["evaluation"])] if "evaluation" in report else []
    for mode in MODES:
        chosen = report["display"][mode]
        lines += ["", f"{mode} requests ({'a line begun' if mode == MODES[0] else 'a blank line'}): AUROC"]
        lines.append(f"{'':<18}" + "".join(f"{kind:>11}" for kind in SCORES))
        for name, part in sets:
            lines.append(f"{name:<18}" + "".join(f"{_pct(part['auroc'][mode][k]):>11}" for k in SCORES))
        held = report["calibration"]["across_sets"][mode]
        if held is not None:
            lines.append("each set held out (the others choose): " + ", ".join(
                f"{k} {held[k]['good']}/{held[k]['shown']}" for k in SCORES) + " good/shown")  # fmt: skip
        best = best_precision(report["calibration"]["curves"][mode][chosen["score"]], report["min_shown"])
        met = "met" if chosen["target_met"] else f"MISSED: the best threshold gives {_pct(best)}%; none shown"
        if "withdrawn" in chosen:
            gone = chosen["withdrawn"]
            met = (
                f"MISSED: {gone['threshold']:.4f} met it on the choosing half, but the other half's "
                f"{gone['held_out_shown']} answers above it were {_pct(gone['held_out_precision'])}% good; none shown"
            )
        lines.append(f"chosen: score '{chosen['score']}', threshold {chosen['threshold']:.4f} (target {met})")
    header = f"{'':<22}{'tasks':>7}{'written':>9}{'shown':>7}{'coverage':>10}{'precision':>11}"
    lines += ["", header + f"{'exact':>7}{'heads':>7}{'head ok':>9}"]
    for name, part in sets:
        rows = [("all", part["shown_all"]), ("thr", part["at_threshold"])]
        rows += [(f"thr {mode.split('_')[0]}", part["modes"][mode]) for mode in MODES]
        for label, row in rows:
            lines.append(
                f"{name + ' ' + label:<22}{row['tasks']:>7}{row['written']:>9}{row['shown']:>7}"
                f"{_pct(row['coverage']):>10}{_pct(row['precision']):>11}{row['exact_shown']:>7}"
                f"{row['heads_shown']:>7}{row['heads_correct_start']:>9}"
            )
    if len(report["held_out"].get("sets", {})) > 1:
        lines += ["", "calib. held at the thresholds, per set:"]
        for name, row in report["held_out"]["sets"].items():
            lines.append(f"  {name}: shown {row['shown']} of {row['tasks']} ({_pct(row['coverage'])}%), "
                         f"precision {_pct(row['precision'])}%, exact {row['exact_shown']}")  # fmt: skip
    return "\n".join(lines)


def plot_calibrate(report: dict[str, Any], path: Path) -> Path:
    """Precision against coverage of each request mode's chosen score, on the calibration and evaluation sets."""
    with figure(path, (6.4, 4.2)) as (_, axis):
        _draw_calibration(report, axis)
    return path


def _draw_calibration(report: dict[str, Any], axis: Any) -> None:
    for mode, style in zip(MODES, ("tab:blue", "tab:orange"), strict=True):
        chosen = report["display"][mode]
        points = report["calibration"]["curves"][mode][chosen["score"]]
        axis.plot([p["coverage"] for p in points], [p["precision"] for p in points], color=style,
                  label=f"{mode}, calibration ({chosen['score']})")  # fmt: skip
        if "evaluation" in report:
            points = report["evaluation"]["curves"][mode]
            axis.plot([p["coverage"] for p in points], [p["precision"] for p in points], "--", color=style,
                      label=f"{mode}, evaluation")  # fmt: skip
        mine = report["calibration"]["modes"][mode]
        if mine["precision"] is not None:
            axis.plot([mine["coverage"]], [mine["precision"]], "o", color=style,
                      label=f"threshold {chosen['threshold']:.3f}")  # fmt: skip
    axis.axhline(report["target_precision"], color="grey", linewidth=0.8, linestyle=":")
    axis.set_xlabel("coverage (share of a mode's requests that show an answer)")
    axis.set_ylabel("precision (share of shown answers that are good)")
    axis.set_ylim(0, 1.02)
    axis.set_title(f"confidence calibration ({report['model']})", fontsize=10)
