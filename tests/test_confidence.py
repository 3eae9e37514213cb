"""Confidence scores, confident heads, and `canvas-ls bench calibrate` writing a threshold the engine then reports."""

from __future__ import annotations

import gzip
import json
import math
import shutil
from pathlib import Path

import pytest

from canvas_ls.engine.confidence import (
    LINE_CHARS,
    MODES,
    SCORES,
    Display,
    confident_head,
    copy_support,
    judge,
    sequence_score,
    shown_tokens,
)
from canvas_ls.server.backend import Answer
from canvas_ls.server.calibration import auroc, choose, curve, held_up, pick
from tests.conftest import FIXTURES
from tests.test_cli import cli


def test_the_scores() -> None:
    confidence = [0.9, 0.5, 0.8]
    assert sequence_score(confidence, "min") == 0.5
    assert sequence_score(confidence, "mean") == pytest.approx(2.2 / 3)
    assert sequence_score(confidence, "geometric") == pytest.approx((0.9 * 0.5 * 0.8) ** (1 / 3))
    assert sequence_score([], "geometric") == 1.0  # nothing to doubt (and nothing is shown)
    assert math.isfinite(math.log(sequence_score([0.0, 0.9], "geometric")))  # a rounded-to-0 token stays finite
    with pytest.raises(ValueError, match="unknown confidence score 'max'"):
        sequence_score(confidence, "max")
    # "useful": the geometric mean times the share of a line the answer writes (its blanks aside), at most 1
    geometric = sequence_score(confidence, "geometric")
    assert sequence_score(confidence, "useful", "  else:\n") == pytest.approx(geometric * 5 / LINE_CHARS)
    assert sequence_score(confidence, "useful", "x" * (2 * LINE_CHARS)) == pytest.approx(geometric)
    assert sequence_score([], "useful", "") == 1.0
    with pytest.raises(ValueError, match="needs the text"):  # never a silent 0 for a caller that forgot it
        sequence_score(confidence, "useful")


def test_a_useful_head_must_be_worth_its_characters() -> None:
    texts, confidence = ["    result", " =", " compute", "(values", ", limit", ")"], [0.99, 0.99, 0.9, 0.9, 0.1, 0.1]
    # the whole answer's useful score is low (two doubtful tokens); its head up to "(values" is confident and long
    head = confident_head(texts, confidence, "useful", 0.6, healed="    ")
    assert head == "result = compute(values"
    assert sequence_score(confidence[:4], "useful", head) >= 0.6 > sequence_score(confidence, "useful", "".join(texts))
    # a confident but short head is not worth showing
    assert confident_head(["  )", "\n"], [0.99, 0.99], "useful", 0.5, healed="  ") == ""


def test_a_copied_line_counts_as_far_as_its_surroundings_agree() -> None:
    answer = "return sum(values) / len(values)"
    after = "\n\n\ndef average(path):\n    values = load(path)\n    return sum(values) / len(values)\n"
    # the copy's line before it and the cursor's agree over a line's worth: "(path):\n    values = load(path)\n"
    assert copy_support(answer, "def mean(path):\n    values = load(path)\n    ", after) == 1.0
    # unlike surroundings: "(path)\n" before, "\n" after agree, 8 characters of LINE_CHARS
    assert copy_support(answer, "def mean(path):\n    print(path)\n    ", after) == 8 / LINE_CHARS
    assert copy_support("return 0", "def mean(path):\n    print(path)\n    ", after) == 1.0  # copies no line
    assert copy_support("  ", "x = 1\n", "\n") == 1.0  # writes nothing
    # the completed line counts: the cursor line's text before the answer and the rest after it
    assert copy_support("compute(a, b)", "x = compute(a, b)\ny = ", "\n") == 1.0
    assert copy_support("compute(a, b)", "x = compute(a, b)\nx = ", "\n") == 1 / LINE_CHARS
    assert copy_support("compute(a", "x = compute(a, b)\nx = ", ", b)\n") == 1 / LINE_CHARS
    # "anchored": the useful score times the support; the answer's heads keep the whole answer's support
    confidence, texts = [0.99] * 4, ["return sum(values)", " /", " len(values", ")"]
    useful = sequence_score(confidence, "useful", answer)
    assert sequence_score(confidence, "anchored", answer, 0.25) == pytest.approx(useful * 0.25)
    with pytest.raises(ValueError, match="copy support"):
        sequence_score(confidence, "anchored", answer)
    assert confident_head(texts, confidence, "anchored", 0.5, support=1.0) == answer
    assert confident_head(texts, confidence, "anchored", 0.5, support=0.25) == ""
    score, _ = judge(Answer(answer, tuple(texts), tuple(confidence), score_kind="anchored"), answer, 0.5,
                     ("def mean(path):\n    print(path)\n    ", after))  # fmt: skip
    assert score == pytest.approx(useful * 8 / LINE_CHARS)


def test_the_confident_head_is_whole_tokens_from_the_start() -> None:
    texts, confidence = [" (x", " +", " y", ")"], [0.9, 0.8, 0.2, 0.95]
    assert confident_head(texts, confidence, "min", 0.5) == " (x +"
    assert confident_head(texts, confidence, "min", 0.95) == ""  # the first token falls short
    # geometric: the run stops being kept once its mean log falls under the threshold, and may recover after
    assert confident_head(texts, confidence, "geometric", 0.6) == " (x + y)"
    assert confident_head(texts, confidence, "geometric", 0.7) == " (x +"
    # the healed prefix text (re-written by the first token) is not part of the head
    assert confident_head(["  return", " x"], [0.9, 0.3], "min", 0.5, healed="  ") == "return"


def test_only_the_tokens_that_write_what_is_shown_are_judged() -> None:
    texts = ["  if", " x", ":\n", "        junk", " more"]
    assert shown_tokens(texts, "  ", "if x:") == 3  # the first line (healed indentation first)
    assert shown_tokens(texts, "  ", "if x") == 2
    assert shown_tokens(texts, "  ", "something else") == 5  # not a start of the answer: all tokens
    answer = Answer("if x:", tuple(texts), (0.9, 0.9, 0.9, 0.01, 0.01), healed="  ", score_kind="min")
    score, head = judge(answer, "if x:", 0.5, ("def f(x):\n  ", "\n"))
    assert score == 0.9 and head == "if x:\n"  # the junk after the line break does not count


def test_display_settings_are_checked() -> None:
    assert Display.from_record(None) == Display("geometric", 0.0)
    assert Display.from_record({"score": "min", "min_confidence": 0.3, "calibrated": {}}) == Display("min", 0.3)
    both = Display.from_record(
        {"score": "mean", "min_confidence": 0.9, "multi_line": {"score": "anchored", "min_confidence": 0.8}}
    )
    assert both.for_request(single_line=True) == ("mean", 0.9) and both.for_request(False) == ("anchored", 0.8)
    assert Display("min", 0.3).for_request(False) == ("min", 0.3)  # one policy for both unless given two
    for bad in ({"score": "max"}, {"min_confidence": 2}, {"multi_line": {"score": "mean"}}, {"multi_line": 0.5}):
        with pytest.raises(ValueError, match="bad display settings"):
            Display.from_record(bad)


def _rows(pairs: list[tuple[float, bool]]) -> list[dict]:
    return [{"written": True, "good": good, "scores": {"min": score}} for score, good in pairs]


def test_auroc_curve_and_the_chosen_threshold() -> None:
    rows = _rows([(0.9, True), (0.8, True), (0.7, False), (0.4, True), (0.3, False), (0.1, False)])
    rows.append({"written": False, "good": False, "scores": {"min": 1.0}})  # empty: never shown, still a request
    labels = [r["good"] for r in rows if r["written"]]
    assert auroc([r["scores"]["min"] for r in rows if r["written"]], labels) == pytest.approx(8 / 9)
    assert auroc([0.5, 0.5], [True, False]) == 0.5 and auroc([0.5], [True]) is None
    points = curve(rows, "min")
    assert [p["threshold"] for p in points] == [0.1, 0.3, 0.4, 0.7, 0.8, 0.9]  # most shown first
    assert points[0]["coverage"] == pytest.approx(6 / 7) and points[0]["precision"] == 0.5
    assert points[2] == {"threshold": 0.4, "shown": 4, "coverage": pytest.approx(4 / 7), "precision": 0.75}
    assert choose(points, 0.75, 1) == (0.4, True)  # the lowest threshold that reaches the target
    assert choose(points, 0.75, 5) == (1.0, False)  # with 5 shown at least, 0.6 is the best: none is shown
    assert choose(points, 1.0, 1) == (0.8, True)


def test_the_score_chosen_is_the_one_that_shows_most_at_the_target() -> None:
    # "x" ranks all answers better (area 0.75 vs 0.625) but puts a bad answer first; "y" shows two good ones first
    good = [False, True, True, True, True, False, False, False]
    x, y = [1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3], [0.8, 1.0, 0.9, 0.5, 0.4, 0.7, 0.6, 0.3]
    rows = [{"written": True, "good": g, "scores": {"x": a, "y": b}} for g, a, b in zip(good, x, y, strict=True)]
    points = {k: curve(rows, k) for k in ("x", "y")}
    areas = {k: auroc([r["scores"][k] for r in rows], good) for k in ("x", "y")}
    assert areas == {"x": 0.75, "y": 0.625}
    assert pick(points, areas, 1.0, 1, ("x", "y")) == ("y", 0.9, True)  # only "y" reaches the target
    assert pick(points, areas, 0.5, 1, ("x", "y")) == ("x", 0.3, True)  # both show all 8: the area decides
    assert pick(points, areas, 1.0, 3, ("x", "y")) == ("x", 1.0, False)  # none reaches it: none shown


def test_a_threshold_the_other_half_disagrees_with_is_withdrawn() -> None:
    def rows(pairs: list[tuple[float, bool]]) -> list[dict]:
        return [{"mode": "single_line", "written": True, "good": good, "scores": {"min": score}, "token_texts": [],
                 "confidence": [], "healed": "", "solution": "x", "exact": good} for score, good in pairs]  # fmt: skip

    choice = {"score": "min", "threshold": 0.8, "target_met": True}
    assert held_up(choice, rows([(0.9, True), (0.85, False), (0.2, False)]), 0.5) == choice  # 1 of 2: holds
    gone = held_up(choice, rows([(0.9, True), (0.85, False), (0.81, False)]), 0.5)
    assert gone["threshold"] == 1.0 and not gone["target_met"]  # 1 of 3 above it: nothing shown
    assert gone["withdrawn"] == {"threshold": 0.8, "held_out_shown": 3, "held_out_precision": pytest.approx(1 / 3)}
    assert held_up(choice, rows([(0.2, False)]), 0.5) == choice  # nothing above it there: no evidence against it
    missed = {"score": "min", "threshold": 1.0, "target_met": False}
    assert held_up(missed, rows([(0.9, False)]), 0.5) == missed


def test_bench_calibrate_writes_the_threshold_the_engine_then_reports(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)  # the session's tiny model stays uncalibrated for the other tests
    corpora = []
    source = (FIXTURES / "python" / "stats.py").read_text()
    for name in ("stats.py", "again.py"):  # two calibration sets, pooled
        corpora.append(tmp_path / f"{name}.jsonl.gz")
        with gzip.open(corpora[-1], "wt") as out:
            out.write(json.dumps({"path": name, "language": "python", "source": "test", "text": source}) + "\n")
    out = tmp_path / "calibrate.json"
    done = cli("bench", "calibrate", "--calibration", *map(str, corpora), "--dataset", str(FIXTURES / "bench" /
                     "tiny-infill.jsonl"), "--limit", "4", "--min-shown", "1", "--model", str(model), "--set",
                     "max_steps=4", "--out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "AUROC" in done.stdout and "written:" in done.stdout and "per set:" in done.stdout
    report = json.loads(out.read_text())
    assert len(report["calibration"]["rows"]) == 8 and len(report["evaluation"]["rows"]) == 3
    assert [r["task_id"].split(":")[0] for r in report["calibration"]["rows"]] == ["stats.py"] * 4 + ["again.py"] * 4
    across = report["calibration"]["across_sets"]  # each set judged with the threshold the other chose
    assert all(len(across[mode][kind]["folds"]) == 2 for mode in MODES for kind in SCORES)
    held = report["held_out"]["sets"]  # each set's unseen half at the chosen threshold
    assert list(held) == ["stats.py.jsonl.gz", "again.py.jsonl.gz"] and all(r["tasks"] == 2 for r in held.values())
    assert out.with_suffix(".png").stat().st_size > 10_000
    display = json.loads((model / "canvas_ls.json").read_text())["display"]
    line, block = report["display"]["single_line"], report["display"]["multi_line"]
    assert (display["score"], display["min_confidence"]) == (line["score"], line["threshold"])
    assert display["multi_line"] == {"score": block["score"], "min_confidence": block["threshold"]}
    assert Display.from_record(display).for_request(single_line=False) == (block["score"], block["threshold"])
    assert display["calibrated"]["set"] == "stats.py.jsonl.gz; again.py.jsonl.gz"
    assert json.loads((model / "canvas_ls.json").read_text())["infill"]["layout"] == "canvas"  # the rest kept

    from canvas_ls.engine import Engine

    prefix, suffix = "def f(x):\n    return ", "\n"
    result = Engine.load(str(model), "cpu", {"max_steps": 4}).infill(prefix, suffix)
    assert (result.score_kind, result.min_confidence) == (block["score"], block["threshold"])  # a blank line's
    support = copy_support(result.text, prefix, suffix)
    assert result.score == pytest.approx(sequence_score(result.confidence, result.score_kind, result.text, support),
                                         abs=1e-3)  # fmt: skip


def test_bench_calibrate_refuses_a_json_that_is_no_repository_report(tmp_path: Path) -> None:
    stray = tmp_path / "settings.json"
    stray.write_text(json.dumps({"completion": {}}))
    done = cli("bench", "calibrate", "--calibration", str(stray), "--dry-run")
    assert done.returncode != 0 and "is not a repository_report.json" in done.stderr
    assert "Traceback" not in done.stderr
