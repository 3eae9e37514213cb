"""`canvas-ls bench infill`: the sandboxed test runner and the report, on a tiny dataset and a tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.bench import Task, load_tasks, passes
from tests.conftest import FIXTURES
from tests.test_cli import canvas_ls

DATASET = FIXTURES / "bench" / "tiny-infill.jsonl"


@pytest.fixture(scope="module")
def add_task() -> Task:
    return load_tasks(DATASET)[0]


def test_canonical_solution_passes(add_task: Task) -> None:
    assert passes(add_task, add_task.solution)


@pytest.mark.parametrize(
    "completion",
    [
        "    return a - b\n",  # wrong answer
        "    return a +\n",  # syntax error
        "    while True: pass\n",  # never ends: killed by the timeout
        "    x = bytearray(4 << 30)\n",  # 4 GiB: refused by the memory limit
    ],
)
def test_bad_completions_fail_in_the_sandbox(add_task: Task, completion: str) -> None:
    assert not passes(add_task, completion, timeout=2)


def test_limit_spreads_over_the_set() -> None:
    assert [t.task_id for t in load_tasks(DATASET, 2)] == ["Tiny/0/L1", "Tiny/1/L2"]


@pytest.mark.parametrize(
    ("cursor", "typed"),
    [("task", ["", ""]), ("indented", ["    ", "        "]), ("word", ["    return ", "        if "])],
)
def test_the_cursor_moves_what_the_user_typed_into_the_prompt(cursor: str, typed: list[str]) -> None:
    tasks, original = load_tasks(DATASET, 2, cursor), load_tasks(DATASET, 2)
    for task, before, done in zip(tasks, original, typed, strict=True):
        assert task.prompt == before.prompt + done
        assert task.prompt + task.solution == before.prompt + before.solution  # the same program, checked alike
    assert passes(tasks[0], tasks[0].solution)


def test_bench_infill_prints_the_table_and_writes_the_report(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    done = canvas_ls(
        "bench",
        "infill",
        "--dataset",
        str(DATASET),
        "--model",
        str(tiny_model_dir),
        "--prefix-latency",
        "64",
        "--out",
        str(out),
    )
    assert done.returncode == 0, done.stderr
    assert "forward passes, left-to-right / parallel" in done.stdout
    report = json.loads(out.read_text())
    assert report["tasks"] == 3 and len(report["rows"]) == 3
    for mode in ("parallel", "left_to_right"):
        summary = report[mode]
        assert 0 <= summary["exact_match"] <= 1 and summary["pass_at_1"] is not None
        assert 0 <= summary["pass_at_1_written"] <= summary["pass_at_1"]
        assert summary["forward_passes"] > 0
    # The baseline commits one token per forward: at most one (the EOS may be the one).
    assert report["left_to_right"]["tokens_per_forward"] <= 1.0
    for mode in ("parallel", "left_to_right"):  # also over the non-empty answers alone, when there are any
        rows = [row[mode] for row in report["rows"] if not row[mode]["empty"]]
        nonempty = report[mode]["tokens_per_forward_nonempty"]
        if rows:
            expected = sum(r["produced"] for r in rows) / sum(r["forward_passes"] for r in rows)
            assert nonempty == pytest.approx(expected)
        else:
            assert nonempty is None
    assert report["prefix_latency"]["prefix_tokens"] == 64


def test_bench_engine_measures_prefix_reuse_and_both_throughput_modes(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "engine.json"
    done = canvas_ls("bench", "engine", "--model", str(tiny_model_dir), "--prefixes", "128", "--clients", "1,2",
                     "--runs", "1", "--per-client", "2", "--dtype", "float32", "--set", "self_condition=off",
                     "--out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["dtype"] == "float32" and report["settings"] == {"self_condition": "off"}
    (row,) = report["prefix"]
    assert row["cold_ms"] > 0 and row["warm_ms"] > 0 and row["reused_tokens"] > 0  # the keystroke reused the KV
    modes = {(r["mode"], r["clients"]): r for r in report["throughput"]}
    assert set(modes) == {("new", 1), ("new", 2), ("typing", 1), ("typing", 2)}
    assert all(r["requests"] == r["clients"] * 2 and r["requests_per_s"] > 0 for r in modes.values())
    assert modes[("typing", 1)]["vs_one_client"] == 1.0
    assert "typing" in done.stdout
    steps = {r["rows"]: r for r in report["steps"]}  # step costs by rows, from the engine's /metrics
    assert steps[1]["steps"] > 0 and steps[1]["mean_ms"] > 0 and steps[1]["per_row_vs_one"] == 1.0
