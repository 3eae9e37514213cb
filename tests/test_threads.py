"""The engine's intra-op threads (`engine/threads.py`): the cores a process may use (affinity mask, cgroup quota), the
load of other processes as /proc shows it, and the count decided from both: fewer at once when the load rises,
more only after it stayed low."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from canvas_ls.engine import threads
from canvas_ls.engine.threads import RAISE_AFTER, LoadSampler, ThreadGovernor, usable_cores


def governor(monkeypatch: pytest.MonkeyPatch, cores: int, loads: list[float]) -> ThreadGovernor:
    """A governor of `cores` cores whose load samples are `loads` (the first one at its start); no watch thread."""
    monkeypatch.setattr(threads, "usable_cores", lambda: (cores, "affinity mask"))
    monkeypatch.setattr(threads, "full_threads", lambda: cores)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    samples = iter(loads)
    monkeypatch.setattr(LoadSampler, "others_busy", lambda self: next(samples))
    monkeypatch.setattr(threads.threading.Thread, "start", lambda self: None)
    return ThreadGovernor(start_sample_s=0)


def test_threads_follow_the_cores_other_processes_leave(monkeypatch: pytest.MonkeyPatch) -> None:
    chosen = governor(monkeypatch, 2, [0.05])
    assert (chosen.choice.threads, chosen.choice.others_busy) == (2, 0.05)
    assert chosen.describe() == "2 of 2 cores (affinity mask; other processes keep 0.1 cores busy)"
    chosen.choice = chosen._decide(1.02)  # one core taken: one thread at once
    assert chosen.choice.threads == 1
    assert chosen.choice.why == ("affinity mask; other processes keep 1.0 of 2 cores busy while it computes: no thread "
                                 "waits on a core it cannot get")  # fmt: skip
    for _ in range(RAISE_AFTER - 1):  # the load went: more threads only once it has stayed low
        chosen.choice = chosen._decide(0.0)
        assert chosen.choice.threads == 1
    chosen.choice = chosen._decide(0.0)
    assert chosen.choice.threads == 2
    # An idle engine: its editor's and server's work between two answers does not cost it a thread...
    chosen._sample(0.6)  # a second in which the engine computed nothing
    assert chosen.choice.threads == 2
    # ...a build that keeps a core busy meanwhile does: the next request would meet it
    chosen._sample(1.02)
    assert chosen.choice.threads == 1
    assert chosen.choice.why == ("affinity mask; other processes keep 1.0 of 2 cores busy while it waits for a "
                                 "request: no thread waits on a core it cannot get")  # fmt: skip
    assert governor(monkeypatch, 8, [2.6]).choice.threads == 5  # 2.6 busy cores of 8 leave 5 (a little slack)
    assert governor(monkeypatch, 2, [7.0]).choice.threads == 1  # never fewer than one


def test_a_count_the_user_set_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    chosen = ThreadGovernor()
    assert (chosen.fixed, chosen.choice.threads, chosen.choice.why) == (3, 3, "OMP_NUM_THREADS set by the user")


def test_a_cgroup_quota_below_the_affinity_mask_limits_the_cores(tmp_path: Path) -> None:
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "cgroup").write_text("0::/user.slice/editor\n")
    group = tmp_path / "cgroup" / "user.slice" / "editor"
    group.mkdir(parents=True)
    (group / "cpu.max").write_text("150000 100000\n")  # 1.5 cores
    cores, why = usable_cores(tmp_path / "proc", tmp_path / "cgroup")
    assert (min(cores, 1), why) == (1, "cgroup CPU quota 1.5 cores") or len(threads.os.sched_getaffinity(0)) == 1
    (group / "cpu.max").write_text("max 100000\n")
    assert usable_cores(tmp_path / "proc", tmp_path / "cgroup") == (len(threads.os.sched_getaffinity(0)),
                                                                     "affinity mask")  # fmt: skip


def test_one_core_in_the_affinity_mask_is_one_thread() -> None:
    script = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
              "from canvas_ls.engine.threads import ThreadGovernor; g = ThreadGovernor(); g.stop(); "
              "print(g.choice.cores, g.choice.threads)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["1", "1"]


def test_another_process_spinning_shows_as_a_busy_core() -> None:
    """Measured for real: a process that is not ours spinning for a second is at least 0.7 of a core busy (whatever
    else the machine runs only adds to it)."""
    script = ("import time, sys; from canvas_ls.engine.threads import LoadSampler; s = LoadSampler(); "
              "sys.stdin.readline(); s.others_busy(); time.sleep(1.0); print(s.others_busy())")  # fmt: skip
    sampler = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True)  # fmt: skip
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        out, _ = sampler.communicate("go\n", timeout=30)
    finally:
        spinner.kill()
        spinner.wait()
    assert float(out) > 0.7


def test_this_process_and_its_children_are_not_others(monkeypatch: pytest.MonkeyPatch) -> None:
    """Busy ticks of the whole machine less this process's and its children's (the compiling child among them)."""
    ticks = {"system": 1000, "self": 100, "42": 50}
    monkeypatch.setattr(threads, "_system_busy", lambda: ticks["system"])
    monkeypatch.setattr(threads, "_process_ticks", lambda pid: ticks[str(pid)])
    monkeypatch.setattr(threads, "_children", lambda: ["42"])
    clock = iter([10.0, 11.0])
    monkeypatch.setattr(threads.time, "monotonic", lambda: next(clock))
    sampler = LoadSampler()
    ticks.update(
        system=1000 + 3 * threads._TICKS // 2, self=100 + threads._TICKS // 2, **{"42": 50 + threads._TICKS // 2}
    )
    assert sampler.others_busy() == pytest.approx(0.5, abs=0.02)  # 1.5 cores busy, 1 of them ours
    # The child exited: for a moment its ticks are nowhere (our reading fell), never counted as others' load...
    clock2 = iter([12.0, 13.0])
    monkeypatch.setattr(threads.time, "monotonic", lambda: next(clock2))
    monkeypatch.setattr(threads, "_children", lambda: [])
    ticks.update(system=ticks["system"] + threads._TICKS // 10)
    assert sampler.others_busy() == pytest.approx(0.1, abs=0.02)
    # ...then, reaped, they are this process's children's time (`cutime`): ours, with what it did meanwhile
    ticks.update(system=ticks["system"] + threads._TICKS, self=ticks["self"] + ticks["42"] + threads._TICKS)
    assert sampler.others_busy() == pytest.approx(0.0, abs=0.02)


def test_the_load_counts_while_the_engine_computes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs of steps (marked by `computing`) are what the others' load is read over: a step alone shorter than a
    window reads nothing, a run of steps reads the load, and a pause between steps starts a new run."""
    chosen = governor(monkeypatch, 2, [0.0])
    readings = iter([(0.0, 0, 0), (0.2, threads._TICKS // 5, 0)])  # a run of 0.2 s: another process busy all along
    monkeypatch.setattr(threads, "read_load", lambda: next(readings))
    clock = iter([0.05, 0.05, 0.2])  # the first step ends, the next starts at once, and ends
    monkeypatch.setattr(threads.time, "monotonic", lambda: next(clock))
    with chosen.computing():  # 0.0 - 0.05: shorter than a window, the run goes on
        pass
    assert chosen._seen == []
    with chosen.computing():  # right after (no pause): the same run, 0.0 - 0.2
        pass
    assert chosen._seen == [(pytest.approx(1.0), 0.2)]


def test_a_run_of_steps_that_meets_a_sure_load_drops_a_thread_as_it_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    """A window that shows another process contending lowers the count at its end, not at the next sample (up to a
    second of steps with a thread spinning on a taken core); a lighter burst is left to the sample's average."""
    chosen = governor(monkeypatch, 2, [0.0])
    busy = threads._TICKS // 5  # another process busy for 0.2 s
    readings = iter([(0.0, 0, 0), (0.2, busy * 2 // 5, 0), (1.0, 0, 0), (1.2, busy * 3 // 5, 0)])
    monkeypatch.setattr(threads, "read_load", lambda: next(readings))
    clock = iter([0.2, 1.2])  # each run ends 0.2 s after its first reading
    monkeypatch.setattr(threads.time, "monotonic", lambda: next(clock))
    with chosen.computing():  # 0.4 of a core over the window (a language server's burst): left to the sample
        pass
    assert chosen.choice.threads == 2 and chosen._seen == [(pytest.approx(0.4), 0.2)]
    with chosen.computing():  # 0.6 (a spinning process sharing the cores with two threads): one thread now
        pass
    assert chosen.choice.threads == 1 and chosen.choice.others_busy == pytest.approx(0.6)
