"""How many intra-op threads the model runs on, decided from the cores this process can actually get.

A developer's machine is busy (an editor, a browser, a build). torch starts one OpenMP thread per core and, by
default, a thread that reaches the end of a parallel region spins waiting for the others: with one of two cores
taken by another process, the engine's second thread gets half a core, and every op waits for it while the first
spins (measured on the 2-core machine: the editor's completion p50 85 ms idle, 5 s with one core busy). So:

- the thread count is the cores this process may use (its affinity mask, its cgroup's CPU quota) less the cores
  other processes kept busy (`/proc/stat`'s busy time less this process's and its children's), sampled when the
  engine starts and every second while it runs (`ThreadGovernor`); fewer threads at once when the load rises,
  more again only after it has stayed low for a few samples. With no more threads than free cores, OpenMP's
  brief spin at the end of a parallel region costs nothing, and it is faster than waiting passively
  (`OMP_WAIT_POLICY=PASSIVE` measured 12-15% slower with the compiled step, idle: 174-177 vs 151-156 ms a
  completion, 2-core EPYC, 2026-12-06);
- a load that contends takes a thread away at the end of the run of steps that met it, not at the next sample, and
  one sure to contend (`SURE`: most of a core) even while the engine waits between requests: a build that starts
  between two keystrokes used to meet the next request with two threads, one of them spinning on a taken core, and
  made it 1.6-4.4 s instead of ~0.2 (`bench neovim --busy-cores 0,1`, the shipped model, 2-core Zen 4,
  2026-12-07);
- `OMP_NUM_THREADS` set by the user is a fixed choice: kept, and said so.

The choice and why are in `/health` ("threads") and the engine's log. No torch at import: `ThreadGovernor.computing`
imports it when the model's thread calls it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

log = logging.getLogger(__name__)

SAMPLE_S = 1.0  # how often the thread count is decided
WINDOW_S = 0.1  # the shortest run of steps the others' load is read over (two /proc reads a run)
GAP_S = 0.02  # a pause between two steps longer than this ends a run
RAISE_AFTER = 3  # samples in a row that allow more threads before the count goes up (down: at once)
# Busy time of other processes up to this share of a core leaves that core to the engine (noise, short bursts)
SLACK = 0.3
# A run of steps that saw others take more than this share of a core lowers the count as it ends (another process
# spinning beside two threads on two cores shows as 0.6-0.8 of a core; a language server's burst beside it, 0.3)
AT_ONCE = 0.5
# A load of more than this share of a core over a second the engine waited takes a thread: it is sure to contend with
# the next request (a build, a spinning process), where an editor's and a language server's work between two answers
# stays below it
SURE = 0.7
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def usable_cores(proc: Path = Path("/proc/self"), cgroup: Path = Path("/sys/fs/cgroup")) -> tuple[int, str]:
    """The cores this process may run on, and what limits them: the affinity mask, and a cgroup v2 CPU quota
    (`cpu.max`) when it allows fewer."""
    try:
        cores, why = len(os.sched_getaffinity(0)), "affinity mask"
    except (AttributeError, OSError):
        cores, why = os.cpu_count() or 1, "cores"
    try:
        own = (proc / "cgroup").read_text().strip().split("::", 1)[-1].lstrip("/")
        quota, period = (cgroup / own / "cpu.max").read_text().split()
        if quota != "max" and (limit := max(1, math.floor(int(quota) / int(period)))) < cores:
            return limit, f"cgroup CPU quota {int(quota) / int(period):g} cores"
    except (OSError, ValueError):
        pass
    return cores, why


@functools.cache
def full_threads() -> int:
    """The most intra-op threads the engine uses: torch's own default (one per physical core, or `OMP_NUM_THREADS`)
    within the cores this process may use; read once, before anything here changed the count. The compiled step's
    graphs are compiled with it (their guards record the count: `graph_guards.guards_accept`)."""
    import torch

    return max(1, min(usable_cores()[0], torch.get_num_threads()))


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    cores: int  # the cores this process may use
    others_busy: float  # cores other processes kept busy over the last sample
    why: str

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _system_busy() -> int:
    """Busy clock ticks of every CPU since boot (all but idle and iowait; guest time is in user time already)."""
    with open("/proc/stat") as stat:
        fields = [int(value) for value in stat.readline().split()[1:9]]
    return sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)


def _process_ticks(pid: int | str) -> int:
    """User + system clock ticks of a process (all its threads) and of the children it has reaped (an exited child's
    ticks move there: a compiling child that starts and ends between two readings stays ours)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])
    except (OSError, IndexError, ValueError):
        return 0


def _children() -> list[str]:
    """This process's child processes (the compiling child among them)."""
    pids: list[str] = []
    try:
        for task in os.scandir("/proc/self/task"):
            with open(f"{task.path}/children") as children:
                pids += children.read().split()
    except OSError:
        pass
    return pids


Reading = tuple[float, int, int]  # (monotonic seconds, the machine's busy ticks, this process's and its children's)


def read_load() -> Reading:
    return time.monotonic(), _system_busy(), _process_ticks("self") + sum(_process_ticks(p) for p in _children())


def others_between(then: Reading, now: Reading) -> float:
    """Cores other processes kept busy between two readings (this process and its children aside)."""
    seconds = now[0] - then[0]
    own = max(0, now[2] - then[2])  # a child exited and not yet reaped has taken its ticks along: never below none
    return 0.0 if seconds <= 0 else max(0.0, (now[1] - then[1]) - own) / _TICKS / seconds


class LoadSampler:
    """Cores kept busy by other processes between two calls of `others_busy`."""

    def __init__(self) -> None:
        self._last = read_load()

    def others_busy(self) -> float:
        now = read_load()
        then, self._last = self._last, now
        return others_between(then, now)


class ThreadGovernor:
    """The engine's intra-op thread count. What counts is the load other processes put on the machine while the
    engine computes (`computing`: the model's thread marks its steps, and the load is read over runs of steps at
    least `WINDOW_S` long): an editor's language server and client work between the engine's answers, not during
    them, and must not cost it a thread. A daemon thread decides every `SAMPLE_S`: from the windows computed since
    (fewer threads at once; more after `RAISE_AFTER` such decisions), or, when the engine was idle, from the whole
    machine's load (fewer threads only for a load `SURE` to contend with the next request). A window that shows
    contention lowers the count as it ends. The model's thread applies the count as a step starts (OpenMP's thread
    count belongs to the thread that starts the parallel regions)."""

    def __init__(self, sample_s: float = SAMPLE_S, start_sample_s: float = 0.1) -> None:
        self._limit = usable_cores()[1]
        self.cores = full_threads()
        self._sampler = LoadSampler()
        self._lower = 0  # decisions in a row that would allow more threads
        self._lock = threading.Lock()
        self._window: Reading | None = None  # the run of steps being measured (the model's thread)
        self._last_end = 0.0
        self._seen: list[tuple[float, float]] = []  # (others' cores, seconds) of each window computed since
        fixed = os.environ.get("OMP_NUM_THREADS")
        if fixed and fixed.isdigit() and int(fixed) > 0:
            self.fixed: int | None = int(fixed)
            self.choice = ThreadChoice(self.fixed, self.cores, 0.0, "OMP_NUM_THREADS set by the user")
            return
        self.fixed = None
        time.sleep(start_sample_s)
        self.choice = self._decide(self._sampler.others_busy(), start=True)
        log.info("threads: %s", self.describe())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(sample_s,), name="canvas-threads", daemon=True)
        self._thread.start()

    def describe(self) -> str:
        return f"{self.choice.threads} of {self.cores} cores ({self.choice.why})"

    def _free(self, others: float, slack: float) -> int:
        return max(1, min(self.cores, math.floor(self.cores - others + slack)))

    def _decide(self, others: float, start: bool = False, idle: bool = False, fewer: float = SLACK) -> ThreadChoice:
        """The count for `others` busy cores: fewer at once, more only after `RAISE_AFTER` decisions in a row that
        allow more. `fewer`: the share of a core others may take before this reading lowers the count (`SLACK` for a
        second's average while computing, `AT_ONCE` for one run of steps, `SURE` while the engine waited: `idle`)."""
        free = self._free(others, SLACK)
        if not start:
            current = self.choice.threads
            if free < current:
                free = max(free, self._free(others, fewer))
            self._lower = self._lower + 1 if free > current else 0
            if 0 < self._lower < RAISE_AFTER:
                free = current
            if free == current:
                return replace(self.choice, others_busy=round(others, 2))
            self._lower = 0
        if free == self.cores:
            why = f"{self._limit}; other processes keep {others:.1f} cores busy"
        else:
            when = "while it waits for a request" if idle else "while it computes"
            why = f"{self._limit}; other processes keep {others:.1f} of {self.cores} cores busy {when}: " \
                  "no thread waits on a core it cannot get"  # fmt: skip
        return ThreadChoice(free, self.cores, round(others, 2), why)

    def _choose(self, choice: ThreadChoice) -> None:
        """`choice` from now on (under the lock): the model's thread applies it as its next step starts."""
        if choice.threads != self.choice.threads:
            log.info("threads: %d -> %d (%s)", self.choice.threads, choice.threads, choice.why)
        self.choice = choice

    def _watch(self, sample_s: float) -> None:
        while not self._stop.wait(sample_s):
            self._sample(self._sampler.others_busy())

    def _sample(self, machine: float) -> None:
        """One decision: from the runs of steps computed since the last (others' load while it computed), else from
        the `machine`'s load while the engine waited."""
        with self._lock:
            seen, self._seen = self._seen, []
            seconds = sum(s for _, s in seen)
            if seconds > 0:
                self._choose(self._decide(sum(o * s for o, s in seen) / seconds))
            else:
                self._choose(self._decide(machine, idle=True, fewer=SURE))

    @contextlib.contextmanager
    def computing(self) -> Iterator[None]:
        """Around a step (or an encode) on the thread that runs the model: the current count applied, and the
        others' load read over runs of steps (a pause of over `GAP_S` between two steps ends a run)."""
        import torch

        if torch.get_num_threads() != self.choice.threads:
            torch.set_num_threads(self.choice.threads)
        if self.fixed is not None:
            yield
            return
        if self._window is not None and time.monotonic() - self._last_end > GAP_S:
            self._window = None  # the engine waited in between: the others' work then was no contention
        if self._window is None:
            self._window = read_load()
        try:
            yield
        finally:
            self._last_end = now = time.monotonic()
            if now - self._window[0] >= WINDOW_S:
                reading = read_load()
                others = others_between(self._window, reading)
                with self._lock:
                    self._seen.append((others, reading[0] - self._window[0]))
                    if self._free(others, AT_ONCE) < self.choice.threads:  # contention: fewer from the next step
                        self._choose(self._decide(others, fewer=AT_ONCE))
                self._window = None

    def stop(self) -> None:
        if self.fixed is None:
            self._stop.set()


@functools.cache
def governor() -> ThreadGovernor:
    """The process's one governor (every engine of a process shares its cores)."""
    return ThreadGovernor()
