"""The model shipped in engine/default_model: it loads offline and answers, through the CLI and the engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engine import DEFAULT_MODEL_DIR, Engine
from engine.bench import load_tasks
from tests.conftest import FIXTURES

pytestmark = pytest.mark.skipif(not (DEFAULT_MODEL_DIR / "config.json").is_file(), reason="no default model shipped")


def test_complete_uses_the_shipped_model_offline() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "server.cli", "complete", str(FIXTURES / "python" / "stats.py"), "--line", "19",
         "--character", "11", "--json"],
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["model"] == str(DEFAULT_MODEL_DIR)
    assert result["layout"] == "canvas" and result["suffix_head_tokens"] > 0


def test_the_shipped_model_answers_the_fixture_cases() -> None:
    engine = Engine.load(None, "cpu")
    assert engine.settings.layout == "canvas"  # what it was trained for, from its canvas_ls.json
    for task in load_tasks(FIXTURES / "cases" / "python.jsonl"):
        result = engine.infill(task.prompt, task.suffix, {"max_new_tokens": 16})
        assert result.steps >= 1 and len(result.tokens) <= 16
        assert result.stop_reason in ("eos", "max_tokens")
        assert all(0.0 <= c <= 1.0 for c in result.confidence)
