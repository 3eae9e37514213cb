"""The model shipped in engine/default_model: it loads offline and answers, through the CLI and the engine."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest

from canvas_ls.engine import DEFAULT_MODEL_DIR, Engine
from canvas_ls.engine.tasks import load_tasks, normalise
from tests.conftest import FIXTURES

pytestmark = pytest.mark.skipif(not (DEFAULT_MODEL_DIR / "config.json").is_file(), reason="no default model shipped")


def test_complete_uses_the_shipped_model_offline() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "canvas_ls.server.cli", "complete", str(FIXTURES / "python" / "stats.py"),
         "--line", "19", "--character", "11", "--json"],
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["model"] == str(DEFAULT_MODEL_DIR)
    assert result["layout"] == "canvas" and result["suffix_head_tokens"] > 0


@functools.cache
def _fixture_answers() -> list[tuple[str, str, str, str]]:
    """(case name, wanted, the shipped model's answer, why it stopped) for each fixture case."""
    engine = Engine.load(None, "cpu")
    assert engine.settings.layout == "canvas"  # what it was trained for, from its canvas_ls.json
    answers = []
    for task in load_tasks(FIXTURES / "cases" / "python.jsonl"):
        result = engine.infill(task.prompt, task.suffix, {"max_new_tokens": 16})
        answers.append((task.task_id, task.solution, result.text, result.stop_reason))
    return answers


def test_the_shipped_model_answers_like_a_trained_one() -> None:
    """What training gave it, which a random or broken model lacks: it closes most gaps itself (EOS before the
    16-token bound), and some answers begin with the word the code needs (`return`, `path`)."""
    answers = _fixture_answers()
    assert len(answers) == 10
    assert sum(stop == "eos" for *_, stop in answers) >= 6, answers
    first_word = [got.split()[0].rstrip("(),:") == wanted.split()[0] for _, wanted, got, _ in answers if got.split()]
    assert sum(first_word) >= 1, answers  # 2 of 10 in bf16 and in fp32 (2026-11-30)


# Issue 3's target. The model trained on this project's 2-core CPU (176k examples) does not reach it: it answers
# code-like words ("return", "sys", "key") but 0 of the 10 right. Strict: a model that reaches it makes this fail
# until the mark is removed.
@pytest.mark.xfail(strict=True, reason="issue 3: the shipped model completes 0 of the 10 fixture cases (target 8)")
def test_the_shipped_model_completes_8_of_10_fixture_cases() -> None:
    answers = _fixture_answers()
    solved = [name for name, wanted, got, _ in answers if normalise(got) == normalise(wanted)]
    assert len(solved) >= 8, f"solved {solved}; answers: {answers}"
