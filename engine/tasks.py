"""Held-out tasks and how an answer is judged: HumanEval-Infilling-format tasks, single lines and blocks of a
repository's held-out files, exact match, edit similarity, and a task's tests run in a sandboxed subprocess. Used by
the production calibration (`server/calibration.py`, which `train --workspace` runs) and by the benchmarks; no
plotting, no torch at import."""

from __future__ import annotations

import contextlib
import difflib
import functools
import gzip
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from .corpus import HELD_OUT_FILES

TEST_TIMEOUT_S = 10
TEST_CPU_S = TEST_TIMEOUT_S + 5  # CPU seconds a test program may use at most (`_limits`)
TEST_MEMORY_BYTES = 1 << 30


@dataclass
class Task:
    task_id: str
    prompt: str
    suffix: str
    solution: str
    test: str | None
    entry_point: str | None


# Where the cursor is, as an editor would send the request. "task": where the dataset puts it (single-line tasks:
# at the start of the line). "indented": after the line's indentation, as an editor leaves it after Enter.
# "word": after the line's first word and its space ("return ", "for "), when it has one; else as "indented".
_TYPED = {"task": None, "indented": re.compile(r"[ \t]*"), "word": re.compile(r"[ \t]*(\w+ )?")}


def load_tasks(path: Path, limit: int | None = None, cursor: str = "task") -> list[Task]:
    """HumanEval-Infilling-format tasks from a jsonl(.gz) file; or single lines of held-out source files
    (`line_tasks`): of a repository from the `repository_report.json` that `canvas-ls train --corpus` wrote, or of a
    training corpus (`corpus.jsonl.gz`, rows with "path" and "text") whose first 200 files `canvas-ls train` holds
    out."""
    if path.suffix == ".json":
        return repository_tasks(path, limit)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as source:
        rows = [json.loads(line) for line in source if line.strip()]
    if rows and "text" in rows[0] and "prompt" not in rows[0]:
        return line_tasks([(r["path"], r["text"]) for r in rows[:HELD_OUT_FILES]], limit)
    tasks = [
        Task(r["task_id"], r["prompt"], r["suffix"], r["canonical_solution"], r.get("test"), r.get("entry_point"))
        for r in rows
    ]
    return [typed(t, cursor) for t in spread(tasks, limit)]


def typed(task: Task, cursor: str) -> Task:
    """The task with the cursor moved (`_TYPED`: "task" where it is, "indented" after the line's indentation, "word"
    after its first word too): the typed text moves from the answer into the prompt; the program stays the same."""
    pattern = _TYPED[cursor]
    if pattern is None:
        return task
    done = pattern.match(task.solution)[0]
    return replace(task, prompt=task.prompt + done, solution=task.solution[len(done) :])


def repository_tasks(report: Path, limit: int | None = None) -> list[Task]:
    """`line_tasks` of the held-out files of a training run on a repository (its `repository_report.json`)."""
    from .corpus import read_repository_report

    described = read_repository_report(report)
    root = Path(str(described["root"]))
    return line_tasks([(name, (root / name).read_text(encoding="utf-8")) for name in described["held_out_files"]],
                      limit)  # fmt: skip


def line_tasks(files: list[tuple[str, str]], limit: int | None = None) -> list[Task]:
    """Single-line tasks from whole files: every line with at least 6 characters after its indentation, the cursor
    after the indentation, the rest of the file as the suffix; evenly spread when `limit` is given. No tests: exact
    match and edit similarity only."""
    tasks = []
    for name, text in files:
        start = 0
        for number, line in enumerate(text.splitlines(keepends=True)):
            body = line.rstrip("\r\n")
            code = body.lstrip(" \t")
            if len(code) >= 6:
                cut = start + len(body) - len(code)
                tasks.append(Task(f"{name}:{number + 1}", text[:cut], text[start + len(body) :], code, None, None))
            start += len(line)
    return spread(tasks, limit)


def block_tasks(files: list[tuple[str, str]], limit: int | None = None, seed: int = 0) -> list[Task]:
    """Multi-line tasks from whole files: a run of 2-4 consecutive non-blank lines (seeded length), the cursor after
    the first one's indentation, the answer through the end of the last one (its newline stays in the suffix)."""
    import random

    rng = random.Random(seed)
    tasks = []
    for name, text in files:
        lines = text.splitlines(keepends=True)
        starts = [0]
        for line in lines:
            starts.append(starts[-1] + len(line))
        number = 0
        while number < len(lines):
            count = rng.randint(2, 4)
            run = lines[number : number + count]
            if len(run) == count and all(line.strip() for line in run) and len(run[0].strip()) >= 6:
                cut = starts[number] + len(run[0]) - len(run[0].lstrip(" \t"))
                end = starts[number + count] - len(run[-1]) + len(run[-1].rstrip("\r\n"))
                tasks.append(Task(f"{name}:{number + 1}+{count}", text[:cut], text[end:], text[cut:end], None, None))
                number += count
            else:
                number += 1
    return spread(tasks, limit)


def spread(items: list, limit: int | None) -> list:
    """At most `limit` items, evenly spread over the whole list (not the first few problems); None keeps all."""
    if limit is None or limit >= len(items):
        return items
    return [items[int(i * len(items) / limit)] for i in range(limit)]


def normalise(text: str) -> str:
    return " ".join(text.split())


def edit_similarity(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a, b, autojunk=False).ratio()


def _limits() -> None:
    """In the child, before the program runs: 1 GiB of address space, files of at most 16 MiB, at most 64
    processes of this user (not enforced for root), no core dumps, and CPU time a little past the timeout: a program
    whose runner was killed before its timeout (a benchmark stopped with SIGTERM) ends by itself instead of spinning
    on (one did, for 20 minutes, beside a benchmark and a test run)."""
    resource.setrlimit(resource.RLIMIT_CPU, (TEST_CPU_S, TEST_CPU_S))
    resource.setrlimit(resource.RLIMIT_AS, (TEST_MEMORY_BYTES, TEST_MEMORY_BYTES))
    resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, 16 << 20))
    resource.setrlimit(resource.RLIMIT_NPROC, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


@functools.cache
def _no_network() -> list[str]:
    """`unshare --net` where this machine allows it (root, or user namespaces): the program gets a network namespace
    with no interface but a down loopback. Elsewhere nothing (and the program could reach the network)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return []
    for flags in (["--net"], ["--user", "--map-root-user", "--net"]):
        try:
            done = subprocess.run([unshare, *flags, "true"], capture_output=True, timeout=10, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.SubprocessError):
            continue
        if done.returncode == 0:
            return [unshare, *flags]
    return []


def passes(task: Task, completion: str, timeout: float = TEST_TIMEOUT_S) -> bool:
    """Run prompt + completion + suffix + test + check(entry_point) in a child process, and say whether it exits 0.

    What isolates it: a fresh temporary folder as its working directory (removed after), `python -I` (no user site,
    no PYTHON* variables, the script's folder not on sys.path), an environment of PATH alone, stdin and both outputs
    to /dev/null (no output to hold, whatever it prints), the limits of `_limits` (memory, file size, processes, no
    core), its own session and process group, killed whole at the timeout (children included), and no network where
    `unshare --net` works (see `_no_network`). It is not a security boundary against hostile code: it runs as this
    user, can read what this user can read, and can write files outside its folder.
    """
    program = f"{task.prompt}{completion}{task.suffix}\n\n{task.test}\n\ncheck({task.entry_point})\n"
    with tempfile.TemporaryDirectory(prefix="canvas-ls-bench-") as folder:
        script = Path(folder) / "program.py"
        script.write_text(program, encoding="utf-8")
        child = subprocess.Popen(
            [*_no_network(), sys.executable, "-I", str(script)],
            cwd=folder,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=_limits if os.name == "posix" else None,
            start_new_session=True,
            env={"PATH": os.environ.get("PATH", ""), "PYTHONHASHSEED": "0"},
        )
        try:
            return child.wait(timeout=timeout) == 0
        except subprocess.TimeoutExpired:
            return False
        finally:
            _kill_group(child)


def _kill_group(child: subprocess.Popen) -> None:
    """Kill the child's whole process group (what it started too), then reap it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, signal.SIGKILL)
    child.wait()


def machine() -> str:
    import platform

    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    kernels = torch.backends.cpu.get_cpu_capability()  # ATEN_CPU_CAPABILITY can hold it below the CPU's own
    return f"{cpu}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}, CPU kernels {kernels}, {gpu}"
