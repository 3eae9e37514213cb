"""`canvas-ls bench infill`: the sandboxed test runner and the report, on a tiny dataset and a tiny model."""

from __future__ import annotations

import itertools
import json
import os
import time
from pathlib import Path

import pytest

from canvas_ls.engine.tasks import Task, load_tasks, passes
from tests.conftest import FIXTURES
from tests.test_cli import canvas_ls, cli

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


def test_a_program_left_running_ends_by_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """A task's program whose runner died before its timeout (nothing left to kill its group) stops at its CPU
    limit instead of spinning on."""
    import signal
    import subprocess
    import sys

    from canvas_ls.engine import tasks

    monkeypatch.setattr(tasks, "TEST_CPU_S", 1)
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=tasks._limits)
    assert child.wait(timeout=30) == -signal.SIGKILL  # the hard limit (equal to the soft one: no grace)


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
    done = cli(
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


HOLES = FIXTURES / "bench" / "tiny-holes.jsonl"


def test_hole_tasks_remove_separate_lines_and_keep_the_program_testable() -> None:
    from canvas_ls.bench.holes import _document, hole_tasks

    (two,) = hole_tasks(HOLES, 2)
    (three,) = hole_tasks(HOLES, 3)
    assert [three.solution(i) for i in range(3)] == ["total = 0", "if ch in 'aeiou':", "return total"]
    lines = [three.program.count("\n", 0, start) for start, _ in three.holes]
    assert all(b - a >= 2 for a, b in itertools.pairwise(lines))  # no two holes on adjacent lines
    assert len(two.holes) == 2
    for task in (two, three):  # the program with its own lines put back passes its tests; with a wrong one, not
        right = _document(task, {i: task.solution(i) for i in range(len(task.holes))})[0]
        assert right == task.program
        assert passes(Task(task.task_id, right, "", "", task.test, task.entry_point), "")
        wrong = _document(task, {0: "pass"})[0]
        assert not passes(Task(task.task_id, wrong, "", "", task.test, task.entry_point), "")


def test_corrupt_changes_one_token() -> None:
    from canvas_ls.bench.holes import corrupt

    assert corrupt("if a < b:") == "if a > b:"
    assert corrupt("x == y") == "x != y"
    assert corrupt("return total") == "return tota"
    assert corrupt("x = a ** 2") is None  # nothing safe to corrupt in it


def test_bench_holes_prints_the_table_writes_the_report_and_the_plot(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "holes.json"
    done = cli("bench", "holes", "--dataset", str(HOLES), "--model", str(tiny_model_dir), "--set",
                     "max_steps=4", "--max-new-tokens", "8", "--rewrite-limit", "2", "--out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "joint / sequential: forward passes" in done.stdout and "rewrite of a line" in done.stdout
    report = json.loads(out.read_text())
    assert set(report["holes"]) == {"2", "3"}
    for count, block in report["holes"].items():
        assert block["tasks"] == 1
        for mode in ("joint", "sequential"):
            (row,) = [r[mode] for r in block["rows"]]
            assert len(row["answers"]) == len(row["exact"]) == int(count) and row["passed"] is not None
            assert block[mode]["forward_passes"] == row["forward_passes"] > 0
        assert block["ratios"]["forward_passes_joint_over_sequential"] == pytest.approx(
            block["joint"]["forward_passes"] / block["sequential"]["forward_passes"])  # fmt: skip
    assert report["rewrite"]["tasks"] == 2 and set(report["rewrite"]["by_strength"]) == {"0.3", "0.6", "1.0"}
    assert out.with_suffix(".png").stat().st_size > 10_000


def test_the_sandbox_kills_what_the_program_started_and_has_no_network(add_task: Task, tmp_path: Path) -> None:
    """A program that starts a child and hangs: at the timeout its whole process group is killed, the child too.
    A program that connects to a server listening on this machine's loopback cannot reach it."""
    import socket
    import time

    marker = tmp_path / "child.pid"
    spawn = (f"    import subprocess, pathlib\n    child = subprocess.Popen(['sleep', '300'])\n"
             f"    pathlib.Path({str(marker)!r}).write_text(str(child.pid))\n    while True: pass\n")  # fmt: skip
    assert not passes(add_task, spawn, timeout=3)
    time.sleep(0.2)
    stat = Path(f"/proc/{int(marker.read_text())}/stat")
    assert not stat.exists() or stat.read_text().split()[2] == "Z", "the program's child outlived the timeout"
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        connect = f"    import socket\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
        assert not passes(add_task, connect + "    return a + b\n", timeout=5)  # with a network it would pass


def test_repository_tasks_are_the_held_out_files_lines(tmp_path: Path) -> None:
    from canvas_ls.engine.tasks import load_tasks

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("def f(x):\n    return x + 1\n\n\nok=2\n")
    (tmp_path / "pkg" / "b.py").write_text("never = 'taken'\n")  # not held out
    report = tmp_path / "repository_report.json"
    report.write_text(json.dumps({"root": str(tmp_path), "held_out_files": ["pkg/a.py"]}))
    tasks = load_tasks(report, cursor="indented")
    assert [t.task_id for t in tasks] == ["pkg/a.py:1", "pkg/a.py:2"]  # `ok=2` is under 6 characters
    second = tasks[1]
    assert (second.prompt, second.solution, second.suffix) == ("def f(x):\n    ", "return x + 1", "\n\n\nok=2\n")
    assert all(t.prompt + t.solution + t.suffix == (tmp_path / "pkg" / "a.py").read_text() for t in tasks)


def test_a_paired_interval_holds_the_gain_and_narrows_with_agreement() -> None:
    """`bench repo`'s interval of a gain: resampling tasks together, a shift every task shares has no spread; gains
    that differ task by task spread around their mean."""
    from canvas_ls.bench.core import paired_interval

    assert paired_interval([0.2, 0.4, 0.6], [0.3, 0.5, 0.7]) == pytest.approx((0.1, 0.1))
    before, after = [0.1 * (i % 7) for i in range(60)], [0.1 * (i % 5) for i in range(60)]
    low, high = paired_interval(before, after)
    mean = sum(a - b for a, b in zip(after, before, strict=True)) / 60
    assert low < mean < high and high - low > 0.05
    with pytest.raises(ValueError):
        paired_interval([], [])


def test_bench_soak_fault_sends_faults_from_two_clients_and_every_check_holds(tiny_model_dir: Path,
                                                                              tmp_path: Path) -> None:  # fmt: skip
    out = tmp_path / "faults.json"
    done = cli("bench", "soak", "--fault", "--frames", "300", "--clients", "2", "--model", str(tiny_model_dir),
               "--device", "cpu", "--out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["clients"] == 2 and report["frames"] >= 300 and report["faults"] > 100
    assert report["exits"] == [] and report["unanswered"] == 0 and report["answered_twice"] == 0
    assert set(report["errors_by_code"]) <= {"-32700", "-32600", "-32601", "-32602", "-32800"}
    assert all(report["checks"].values()) and "ok   every request id answered" in done.stdout


def test_bench_without_its_extra_says_which_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    done = cli("bench", "sampler")
    assert done.returncode == 2
    assert done.stderr.strip() == ("canvas-ls: error: the benchmarks need their extra: pip install 'canvas-ls[bench]' "
                                   "(matplotlib, for the plots)")  # fmt: skip


def test_bench_ar_writes_a_gguf_llama_cpp_reads_as_the_named_shape(tmp_path: Path) -> None:
    """The llama.cpp side's model, read back with the gguf package: Qwen2's tensors at the tiny shape, canvas-ls's
    own tokens with three spares as FIM markers (what llama-server's /infill needs)."""
    import gguf

    from canvas_ls.bench.ar import SHAPES, write_gguf

    path = tmp_path / "tiny.gguf"
    parameters = write_gguf(path, SHAPES["tiny"])
    reader = gguf.GGUFReader(path)
    fields = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    assert fields["general.architecture"] == "qwen2" and fields["qwen2.block_count"] == 2
    assert fields["qwen2.embedding_length"] == 64 and fields["qwen2.attention.head_count_kv"] == 1
    assert [fields[f"tokenizer.ggml.{k}_token_id"] for k in ("fim_pre", "fim_suf", "fim_mid")] == [3, 4, 5]
    assert (
        fields["tokenizer.ggml.tokens"][:3] == ["<pad>", "<eos>", "<bos>"]
        and len(fields["tokenizer.ggml.tokens"]) == 8192
    )
    names = {tensor.name for tensor in reader.tensors}
    assert len(names) == 2 + 12 * 2 and "blk.1.ffn_down.weight" in names and "output.weight" not in names  # tied
    assert {t.tensor_type for t in reader.tensors if len(t.shape) == 2} == {gguf.GGMLQuantizationType.Q8_0}
    assert parameters == sum(int(t.n_elements) for t in reader.tensors)


def test_bench_ar_without_llama_server_says_so_and_times_canvas_ls(tmp_path: Path) -> None:
    from canvas_ls.engine.loading import cpu_has_native_bf16

    out = tmp_path / "ar.json"
    done = cli("bench", "ar", "--shape", "tiny", "--llama-server", str(tmp_path / "no-llama-server"),
               "--documents", "1", "--steps", "2", "--quantize", "none,int8-dynamic", "--suffix-refresh", "1,2",
               "--out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["llama_error"] == f"no llama-server at '{tmp_path / 'no-llama-server'}' (--llama-server PATH)"
    systems = ["canvas-ls none 2 steps", "canvas-ls none 2 steps, suffix every 2", "canvas-ls int8-dynamic 2 steps",
               "canvas-ls int8-dynamic 2 steps, suffix every 2"]  # fmt: skip
    assert [(row["system"], row["mode"], row["requests"]) for row in report["rows"]] == [
        (system, mode, count) for system in systems for mode, count in (("cold", 1), ("warm", 4))
    ]
    assert {name: engine["quantize"] for name, engine in report["engines"].items()} == {
        "canvas-ls none": "none", "canvas-ls int8-dynamic": "int8-dynamic"
    }  # fmt: skip
    # each engine in the dtype a user's would pick: float weights in bf16 where the CPU has it, int8's rest in fp32
    float_dtype = "bfloat16" if cpu_has_native_bf16() else "float32"
    assert {name: engine["dtype"] for name, engine in report["engines"].items()} == {
        "canvas-ls none": float_dtype, "canvas-ls int8-dynamic": "float32"
    }  # fmt: skip
    assert all(r["detail"]["steps"] <= 2 and r["tokens"] <= 16 for r in report["requests"])
    assert "llama-server not timed: no llama-server at" in done.stdout and out.with_suffix(".png").is_file()
    refused = cli("bench", "ar", "--suffix-refresh", "0,4")
    assert refused.returncode != 0 and "bench ar: --suffix-refresh 0,4: positive integers" in refused.stderr
    refused = cli("bench", "ar", "--quantize", "int3")
    assert refused.returncode != 0 and "bench ar: --quantize int3: use auto" in refused.stderr


# A stand-in llama-server: healthy, but every /infill answers 500 ("answers"), or it exits as it starts ("exits").
FAKE_LLAMA = """#!{python}
import http.server, json, sys
if "{how}" == "exits":
    sys.stderr.write("llama_model_load: error loading model: tensor 'output.weight' not found\\n")
    sys.exit(1)
port = int(sys.argv[sys.argv.index("--port") + 1])
class Handler(http.server.BaseHTTPRequestHandler):
    def _send(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        self._send(200, {{"status": "ok"}})
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self._send(500, {{"error": {{"code": 500, "message": "the context is full"}}}})
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


@pytest.mark.parametrize("how", ["answers", "exits"])
def test_bench_ar_with_a_failing_llama_server_says_why_and_times_canvas_ls(tmp_path: Path, how: str) -> None:
    """A llama-server that answers errors, or exits as it starts: the report and the printed table say what it said,
    and canvas-ls's rows are all there."""
    import sys

    fake = tmp_path / "llama-server"
    fake.write_text(FAKE_LLAMA.format(python=sys.executable, how=how))
    fake.chmod(0o755)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")  # never read: the stand-in answers or exits whatever it is given
    out = tmp_path / "ar.json"
    done = cli("bench", "ar", "--shape", "tiny", "--llama-server", str(fake), "--gguf", str(gguf), "--documents", "1",
               "--steps", "2", "--quantize", "none", "--out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    said = {"answers": 'llama-server answered 500: {"error": {"code": 500, "message": "the context is full"}}',
            "exits": "llama-server did not come up (exit 1): llama_model_load: error loading model: tensor "
                     "'output.weight' not found\n"}[how]  # fmt: skip
    assert report["llama_error"] == said
    assert [(row["system"], row["mode"], row["requests"]) for row in report["rows"]] == [
        ("canvas-ls 2 steps", "cold", 1), ("canvas-ls 2 steps", "warm", 4)
    ]  # fmt: skip
    assert f"llama-server not timed: {said}" in done.stdout


def test_bench_step_reports_the_engines_own_step_and_the_bandwidth_floor(tiny_model_dir: Path, tmp_path: Path) -> None:
    from canvas_ls.engine.loading import load_model

    out = tmp_path / "step.json"
    done = cli("bench", "step", "--model", str(tiny_model_dir), "--no-compile", "--runs", "1", "--canvases", "8",
               "--rows", "1,2", "--prefix", "32", "--out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    steps = report["engine_steps"]
    assert [(s["rows"], s["canvas"], s["vocab"]) for s in steps] == [(1, 32, 384), (2, 32, 384)]  # the tiny vocabulary
    assert all(set(s["bytes_per_step"]) == {"total", "forward", "logits", "step_own"} for s in steps)
    assert [s["bytes_per_step"]["logits"] for s in steps] == [32 * 384 * 4, 2 * 32 * 384 * 4]  # fp32 logits
    assert all(s["bytes_per_step"]["total"] == s["bytes_per_step"]["forward"] + s["bytes_per_step"]["step_own"]
               for s in steps)  # fmt: skip
    weights = report["step_weight_bytes"]
    model = load_model(str(tiny_model_dir), "cpu").model  # a float model: all its text weights (not the vision tower's)
    assert weights == sum(p.nbytes for n, p in model.named_parameters() if "vision" not in n) > 0
    assert report["bandwidth"]["gb_per_s"] > 0
    assert "memory-bandwidth floor: " in done.stdout and "the engine's step (DenoisingBatch.step" in done.stdout


def test_bench_step_counts_the_int8_projections_and_the_arithmetic_floor(tiny_model_dir: Path, tmp_path: Path) -> None:
    """An int8-dynamic model's projections (`quantized::linear_dynamic`, which torch's FLOP counter skips) are counted,
    2 x slots x in x out for each packed layer the decoder forward runs, and its step held against the int8 rate."""
    from canvas_ls.engine.loading import load_model
    from canvas_ls.engine.quantize import PackedLinear

    out = tmp_path / "step.json"
    done = cli("bench", "step", "--model", str(tiny_model_dir), "--quantize", "int8-dynamic", "--no-compile", "--runs",
               "1", "--canvases", "8", "--rows", "1,2", "--prefix", "32", "--out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    model = load_model(str(tiny_model_dir), "cpu", quantize="int8-dynamic").model
    # the decoder's layers run the encoder's (shared) projections, then the self-conditioning block and the LM head
    packed = [module for module in model.modules() if isinstance(module, PackedLinear)]
    per_slot = sum(2 * m.in_features * m.out_features for m in packed)
    assert [(c["rows"], c["int8_gflop"]) for c in report["cases"]] == [
        (1, round(8 * per_slot / 1e9, 3)),
        (2, round(16 * per_slot / 1e9, 3)),
    ]
    assert all(c["gflop"] > c["int8_gflop"] > 0 and c["arithmetic_floor_ms"] > 0 for c in report["cases"])
    assert report["int8_peak"]["tops"] > 0 and report["peak"]["tflops"] > 0
    assert " GOP/s for int8 (1024 x 4096^2), " in done.stdout and "-bound, forward " in done.stdout
    # the packed weights count toward what a step reads; the embedding (gathered, not read whole) does not
    embedding = model.get_input_embeddings().weight.nbytes
    vision = sum(p.nbytes for n, p in model.named_parameters() if "vision" in n)
    assert report["step_weight_bytes"] == report["weights_bytes"] - vision - embedding


def test_busy_cores_take_turns_in_blocks_with_real_spinning_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--busy-cores 0,1` in blocks of 2: documents 0-1 idle, 2-3 with one process spinning (it burns a core), 4 idle
    again (the process gone); after each change the run waits for the engine's thread count to follow: two samples
    when the load rose, `RAISE_AFTER` and one when it fell."""
    from canvas_ls.bench import core

    waits: list[float] = []
    monkeypatch.setattr(core.time, "sleep", waits.append)
    with core.Load((0, 1), block=2) as load:
        assert [load.of(i) for i in range(6)] == [0, 0, 1, 1, 0, 0]
        assert (load.at(0), load.at(1), load.spinners, waits) == (0, 0, [], [])
        assert load.at(2) == 1 and waits == [2.5]
        (spinner,) = load.spinners
        started = _cpu_seconds(spinner.pid)
        deadline = time.monotonic() + 30
        while _cpu_seconds(spinner.pid) - started < 0.2 and time.monotonic() < deadline:
            pass  # the spinner runs on the other core (or shares this one)
        assert _cpu_seconds(spinner.pid) - started >= 0.2
        assert load.at(3) == 1 and load.spinners == [spinner] and waits == [2.5]
        assert load.at(4) == 0 and load.spinners == [] and spinner.returncode is not None and waits == [2.5, 4.5]
        load.at(2)
        (left,) = load.spinners
    assert load.spinners == [] and left.returncode is not None  # closed with the run
    with pytest.raises(ValueError, match="counts of 0 or more"):
        core.Load((0, -1))


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_by_load_compares_each_count_with_the_first() -> None:
    from canvas_ls.bench.core import by_load, format_by_load

    rows = [{"busy_cores": 0, "cold": 100.0, "typing": 10.0}, {"busy_cores": 0, "cold": 120.0, "typing": None},
            {"busy_cores": 1, "cold": 130.0, "typing": 30.0}, {"busy_cores": 1, "cold": 170.0}]  # fmt: skip
    table = by_load(rows, ("cold", "typing"))
    assert table == {
        "0": {"n": 2, "cold": {"n": 2, "p50_ms": 110.0, "p95_ms": 120.0, "ratio_p50": 1.0, "ratio_p95": 1.0},
              "typing": {"n": 1, "p50_ms": 10.0, "p95_ms": 10.0, "ratio_p50": 1.0, "ratio_p95": 1.0}},
        "1": {"n": 2, "cold": {"n": 2, "p50_ms": 150.0, "p95_ms": 170.0, "ratio_p50": 1.364, "ratio_p95": 1.417},
              "typing": {"n": 1, "p50_ms": 30.0, "p95_ms": 30.0, "ratio_p50": 3.0, "ratio_p95": 3.0}},
    }  # fmt: skip
    assert format_by_load(table, ("cold",)) == [
        "0 busy  cold       n=2    p50    110.0 ms (1.00x)   p95    120.0 ms (1.00x)",
        "1 busy  cold       n=2    p50    150.0 ms (1.36x)   p95    170.0 ms (1.42x)",
    ]
    # Requests of a kind the idle blocks never made: their times, no ratio
    lone = by_load([{"busy_cores": 0, "cold": 1.0}, {"busy_cores": 1, "cold": 2.0, "typing": 5.0}], ("typing",))
    assert lone["1"]["typing"] == {"n": 1, "p50_ms": 5.0, "p95_ms": 5.0}
    assert format_by_load(lone, ("typing",)) == ["1 busy  typing     n=1    p50      5.0 ms   p95      5.0 ms"]


@pytest.mark.parametrize("said", ["0,x", "-1", ""])
def test_busy_cores_that_are_not_counts_are_refused(said: str) -> None:
    result = canvas_ls("bench", "lsp", "--busy-cores", said, "--requests", "1")
    assert result.returncode == 2 and "a count of busy cores, or several comma separated (0,1)" in result.stderr


def test_bench_ar_compares_each_load_with_llama_server_under_it_and_with_its_own_idle_time(tmp_path: Path) -> None:
    """`bench ar --busy-cores 0,1`: rows per system, mode and load; each row's ratio to llama-server's p50 under the
    same load, and to its own p50 and p95 idle; the plot has a strip per system and load."""
    import dataclasses

    from canvas_ls.bench.ar import Timed, format_ar, plot_ar, summary

    detail = {"prompt_tokens": 10.0, "reused_tokens": 0.0, "encode_ms": 1.0, "answer_ms": 2.0, "steps": 4.0}
    timed = [Timed(system, "warm", ms, 16, detail, busy_cores=busy)
             for system, busy, times in (("llama-server", 0, (100, 100)), ("canvas-ls 4 steps", 0, (50, 70)),
                                         ("llama-server", 1, (250, 250)), ("canvas-ls 4 steps", 1, (60, 91)))
             for ms in times]  # fmt: skip
    rows = summary(timed)
    assert [(r["system"], r["busy_cores"], r["p50_ms"], r["p95_ms"], r["p50_vs_llama"], r["p50_vs_first_load"],
             r["p95_vs_first_load"]) for r in rows] == [
        ("llama-server", 0, 100, 100, 1.0, 1.0, 1.0), ("llama-server", 1, 250, 250, 1.0, 2.5, 2.5),
        ("canvas-ls 4 steps", 0, 60, 70, 0.6, 1.0, 1.0), ("canvas-ls 4 steps", 1, 75.5, 91, 0.302, 1.258, 1.3),
    ]  # fmt: skip
    report = {"machine": "m", "shape": "tiny", "llama_parameters": 1, "threads": 2, "canvas_parameters": 1,
              "engines": {"canvas-ls": {"quantize": "none", "dtype": "float32"}}, "compile": "off", "documents": 2,
              "llama_error": None, "rows": rows}  # fmt: skip
    assert format_ar(report).splitlines()[6:8] == [
        "canvas-ls 4 steps                                   warm      2      60.0      70.0         0.60 |      10"
        "      0       1.0       2.0     4  idle: 1.00x / 1.00x",
        "canvas-ls 4 steps                                   warm      2      75.5      91.0         0.30 |      10"
        "      0       1.0       2.0     4  1 busy: 1.26x / 1.30x",
    ]
    report["requests"] = [dataclasses.asdict(t) for t in timed]
    assert plot_ar(report, tmp_path / "ar.png").stat().st_size > 0


def test_bench_lsp_times_each_kind_of_request_through_a_real_client_under_each_load(
    ending_model_dir: Path, tmp_path: Path
) -> None:
    """`canvas-ls bench lsp` end to end: a pygls client starts `canvas-ls serve`, whose resident engine runs a model
    that answers "None" after `= ` (and then ends). At each of two places, idle then with one core busy: a cold
    request (a model call), the user types "Non" of the suggestion (answered from the screen, no model call),
    accepts the rest and asks at its end (answered by the speculation computed meanwhile). Two untimed requests in
    a document of their own come first (the warm-up), and the report counts only the timed ones: each kind per load,
    and the server's counters from after the warm-up."""
    source = tmp_path / "area.py"
    source.write_text("width = \nheight = \n")
    out = tmp_path / "lsp.json"
    result = canvas_ls("bench", "lsp", "--model", str(ending_model_dir), "--device", "cpu", "--files", str(source),
                       "--requests", "2", "--think-ms", "0", "--busy-cores", "0,1", "--load-block", "1",
                       "--out", str(out))  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["model"] == str(ending_model_dir) and report["backend"] == "resident"
    assert [report[kind]["n"] for kind in ("cold", "typing", "accepted")] == [2, 2, 2] and report["requests"] == 6
    assert report["by_source"] == {"model": 2, "typing": 2, "speculated": 2} and report["typing_hits"] == 2
    assert report["model_calls"] == report["model_call"]["n"] == report["engine"]["n"] == 2
    assert report["busy_cores"] == [0, 1] and [row["busy_cores"] for row in report["rows"]] == [0, 1]
    for load in ("0", "1"):  # one place each: its cold, typing and accepted requests
        counts = [report["by_load"][load][kind]["n"] for kind in ("cold", "typing", "accepted")]
        assert counts == [1, 1, 1], report["by_load"]
    assert report["by_load"]["0"]["cold"]["ratio_p50"] == 1.0
    printed = result.stdout
    assert "cold           n=2" in printed and "typing-through hits 2" in printed
    assert "1 busy  cold       n=1" in printed
