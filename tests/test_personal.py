"""Personal calibration (`server/personal.py`): the display threshold moves with the user's own accepts and
dismissals, bounded and smoothed, kept beside the statistics, shown by `canvas-ls stats`, reset by a command; and a
real `canvas-ls serve` shows and hides by the learned threshold."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from lsprotocol import types
from pytest_lsp import LanguageClient

from canvas_ls.server import personal
from canvas_ls.server.acceptance import Recorder, clear, connect, default_path, summary
from canvas_ls.server.personal import RESET_THRESHOLD_COMMAND, Thresholds, moved, proposal
from tests.test_acceptance import client, start  # noqa: F401 (the fixture)
from tests.test_identity import AFTER_RETURN, DOC
from tests.test_lsp import inline, open_doc, request

START = 0.555
# 40 settled suggestions scored 0.56 .. 0.95; the user took only those scored 0.85 or more (11 of them)
PICKY = [(round(0.56 + 0.01 * i, 2), 0.56 + 0.01 * i >= 0.85) for i in range(40)]


def test_below_the_target_the_threshold_goes_up_to_where_the_user_accepts_enough() -> None:
    # 11 of 40 at 0.555 (27.5%): the lowest score from which 30% were taken keeps 36 of them: 0.60
    assert proposal(PICKY, START, 0.3) == 0.6
    assert moved(START, START, 0.6) == 0.5775  # half way
    assert proposal(PICKY, START, 0.5) == 0.74  # 11 of the 22 from 0.74 on
    assert moved(START, START, 0.74) == 0.605  # at most one step
    assert proposal([(score, False) for score, _ in PICKY], START, 0.3) == START + personal.STEP  # none: a step up


def test_above_the_target_it_goes_down_as_far_as_the_evidence_allows_else_a_step() -> None:
    taken = [(score, True) for score, _ in PICKY]
    assert proposal(taken, START, 0.3) == START - personal.STEP  # nothing below it was shown: a step, to learn
    assert moved(START, START, START - personal.STEP) == 0.53
    # invoked suggestions below the threshold, half of them taken: it may go as low as they still meet the target
    below = [(0.40 + 0.01 * i, i % 2 == 0) for i in range(15)]  # 0.40 .. 0.54
    assert proposal(taken + below, START, 0.3) == 0.4
    assert proposal(taken + below[-5:], START, 0.3) == START - personal.STEP  # 5 below: too few to go by
    assert proposal(taken[:29], START, 0.3) == START  # fewer than MIN_SHOWN: it stays
    assert proposal(PICKY[:28] + taken[28:], START, 0.3) == START  # 12 of 40 (30%), not 10 points above: it stays
    assert moved(0.30, START, 0.0) == 0.255 and moved(0.83, START, 1.0) == 0.855  # within RANGE of the start


def record(recorder: Recorder, scores: list[tuple[float, bool]], language: str = "python") -> None:
    """Each (score, taken) shown in its own document, then accepted (the accept command) or typed over."""
    for index, (score, taken) in enumerate(scores):
        uri = f"file:///p/{language}{index}.py"
        shown = recorder.shown(uri, 0, "value", "completion", language, "/p", "/models/m", 80.0, score, START)
        assert shown is not None
        if taken:
            recorder.accepted(shown)
        else:
            recorder.settle(uri, "other", 5)


def test_the_threshold_learns_from_the_statistics_and_starts_again_on_a_reset(tmp_path: Path) -> None:
    path = tmp_path / "stats.sqlite3"
    recorder = Recorder(path)
    thresholds = Thresholds(recorder.database)
    recorder.on_settled = lambda shown: thresholds.settled(shown.language, shown.model, shown.calibrated)
    record(recorder, PICKY[:29])
    assert thresholds.threshold("python", "/models/m", START) == START  # 29 settled: not yet
    # The 30th settles: a look. 1 of 30 taken and no score from which 30% were: a step up, half of it: 0.58. The
    # 40th: 11 of the 38 from 0.58 on; from 0.60 on, 11 of 36: half way there
    record(recorder, PICKY[29:])
    assert thresholds.threshold("python", "/models/m", START) == 0.59
    assert thresholds.threshold("rust", "/models/m", START) == START  # languages apart
    assert thresholds.threshold("python", "/models/m", 1.0) == 1.0  # the model's multi-line threshold apart
    # a new server reads it back from the database
    assert Thresholds(Recorder(path).database).threshold("python", "/models/m", START) == 0.59
    report = summary(path)
    assert report["thresholds"]["learned"] == [{"language": "python", "model": "/models/m", "start": START,
                                                "value": 0.59}]  # fmt: skip
    assert [(move["value"], move["samples"]) for move in report["thresholds"]["history"]] == [(0.58, 30), (0.59, 40)]
    thresholds.reset()
    assert thresholds.threshold("python", "/models/m", START) == START
    assert Thresholds(Recorder(path).database).threshold("python", "/models/m", START) == START
    record(recorder, PICKY[:10])  # only events after the reset count: 10 are not enough
    assert thresholds.threshold("python", "/models/m", START) == START
    off = Thresholds(Recorder(path).database, enabled=False)
    assert off.threshold("python", "/models/m", START) == START


def test_stats_shows_the_learned_thresholds_plots_them_and_resets_them(private_state_dir: Path, tmp_path: Path) -> None:
    clear(default_path())
    recorder = Recorder(default_path())
    thresholds = Thresholds(recorder.database)
    recorder.on_settled = lambda shown: thresholds.settled(shown.language, shown.model, shown.calibrated)
    record(recorder, PICKY)

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "canvas_ls.server.cli", "stats", *args], capture_output=True,
                              text=True, timeout=60)  # fmt: skip

    shown = run("--plot", str(tmp_path / "stats.png"))
    assert shown.returncode == 0, shown.stderr
    assert "display thresholds learned from your accepts (the model's own -> yours):" in shown.stdout
    assert "  python      m                       0.555 -> 0.590  (2 moves)" in shown.stdout
    assert (tmp_path / "stats.png").stat().st_size > 10_000
    days = json.loads(run("--json").stdout)["days"]
    assert [(day["shown"], day["accepted"]) for day in days] == [(40, 11)]
    assert run("--reset-threshold").returncode == 0
    assert json.loads(run("--json").stdout)["thresholds"]["learned"] == []


async def test_a_server_shows_by_the_learned_threshold_until_it_is_reset(
    client: LanguageClient,  # noqa: F811 (the fixture)
    fixed_model_dir: Path,
    private_state_dir: Path,
) -> None:
    """A threshold learned as 1.0 for the fixed model's Python (its own: 0, no calibration): typing shows nothing,
    said with the learned threshold; the reset command shows it again."""
    clear(default_path())
    db = connect(default_path())
    with db:
        db.execute("INSERT INTO thresholds (at, language, model, start, value, rate, samples)"
                   " VALUES (1, 'python', ?, 0.0, 1.0, 0.0, 40)", (str(fixed_model_dir.resolve()),))  # fmt: skip
    db.close()
    await start(client, fixed_model_dir)
    open_doc(client, "size.py", DOC)
    assert await inline(client, "size.py", AFTER_RETURN) == []
    detail = (await request(client, "canvas/status", {}))["last"][0]["detail"]
    assert detail.startswith("hidden: confidence ") and " below 1.00 " in detail, detail
    said = await client.workspace_execute_command_async(types.ExecuteCommandParams(RESET_THRESHOLD_COMMAND, []))
    assert said == "the display thresholds start again from the models' own"
    assert [item.insert_text for item in await inline(client, "size.py", AFTER_RETURN)] == ["Nonecodecodecode"]


@pytest.mark.parametrize("target", [0.0, 1.0])
def test_a_target_outside_its_range_is_refused(target: float) -> None:
    from canvas_ls.server.config import parse_config

    config, error = parse_config({"completion": {"acceptance_target": target}})
    assert config.completion.acceptance_target == 0.3 and error is not None and "acceptance_target" in error, error
