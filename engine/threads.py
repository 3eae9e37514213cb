"""How many intra-op threads the model runs on, decided from the cores this process can actually get.

A developer's machine is busy (an editor, a browser, a build). torch starts one OpenMP thread per core and, by
default, a thread that reaches the end of a parallel region spins waiting for the others: with one of two cores
taken by another process, the engine's second thread gets half a core, and every op waits for it while the first
spins (measured on the 2-core machine: the editor's completion p50 85 ms idle, 5 s with one core busy). So:

- threads that finish wait passively (`OMP_WAIT_POLICY=PASSIVE`, set before torch loads OpenMP: `passive_wait`):
  they sleep instead of taking a core from the thread they wait for, or from the user's other programs;
- the thread count is the cores this process may use (its affinity mask, its cgroup's CPU quota) less the cores
  other processes kept busy (`/proc/stat`'s busy time less this process's and its children's), sampled when the
  engine starts and every second while it runs (`ThreadGovernor`); fewer threads at once when the load rises,
  more again only after it has stayed low for a few samples;
- `OMP_NUM_THREADS` set by the user is a fixed choice: kept, and said so.

The choice and why are in `/health` ("threads") and the engine's log. No torch at import: `passive_wait` must run
before torch does; `ThreadGovernor.apply` imports it when the model's thread calls it.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)

SAMPLE_S = 1.0  # how often the load is sampled while the engine runs
RAISE_AFTER = 3  # samples in a row that allow more threads before the count goes up (down: at once)
# Busy time of other processes up to this share of a core leaves that core to the engine (noise, short bursts)
SLACK = 0.3
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def passive_wait() -> None:
    """Threads that finish an OpenMP parallel region sleep instead of spinning; before torch loads OpenMP (it reads
    the policy once), and only where the user has not chosen a policy."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


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
    graphs are compiled with it (their guards record the count: `compiled.CompiledDecoder._accepts`)."""
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
    """User + system clock ticks of a process (all its threads)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
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


class LoadSampler:
    """Cores kept busy by other processes between two calls of `others_busy` (this process and its children
    aside)."""

    def __init__(self) -> None:
        self._last = self._read()

    @staticmethod
    def _read() -> tuple[float, int, int]:
        busy = _system_busy()
        ours = _process_ticks("self") + sum(_process_ticks(pid) for pid in _children())
        return time.monotonic(), busy, ours

    def others_busy(self) -> float:
        now = self._read()
        (then, busy, ours), self._last = self._last, now
        seconds = now[0] - then
        if seconds <= 0:
            return 0.0
        return max(0.0, (now[1] - busy) - (now[2] - ours)) / _TICKS / seconds


class ThreadGovernor:
    """The engine's intra-op thread count, re-decided every `SAMPLE_S` by a daemon thread from the load; the
    model's own thread applies it between steps (`apply`: OpenMP's thread count belongs to the thread that starts
    the parallel regions)."""

    def __init__(self, sample_s: float = SAMPLE_S, start_sample_s: float = 0.1) -> None:
        self._limit = usable_cores()[1]
        self.cores = full_threads()
        self._sampler = LoadSampler()
        self._lower = 0  # samples in a row that would allow more threads
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

    def _decide(self, others: float, start: bool = False) -> ThreadChoice:
        free = max(1, min(self.cores, math.floor(self.cores - others + SLACK)))
        current = None if start else self.choice.threads
        if current is not None and free > current:  # more only once the load has stayed low
            self._lower += 1
            if self._lower < RAISE_AFTER:
                return ThreadChoice(current, self.cores, round(others, 2), self.choice.why)
        self._lower = 0
        if free == self.cores:
            why = f"{self._limit}; other processes keep {others:.1f} cores busy"
        else:
            why = f"{self._limit}; other processes keep {others:.1f} of {self.cores} cores busy: no thread waits " \
                  "on a core it cannot get"  # fmt: skip
        return ThreadChoice(free, self.cores, round(others, 2), why)

    def _watch(self, sample_s: float) -> None:
        while not self._stop.wait(sample_s):
            choice = self._decide(self._sampler.others_busy())
            if choice.threads != self.choice.threads:
                log.info("threads: %d -> %d (%s)", self.choice.threads, choice.threads, choice.why)
            self.choice = choice

    def apply(self) -> None:
        """On the thread that runs the model, before a step: use the current choice."""
        import torch

        if torch.get_num_threads() != self.choice.threads:
            torch.set_num_threads(self.choice.threads)

    def stop(self) -> None:
        if self.fixed is None:
            self._stop.set()


@functools.cache
def governor() -> ThreadGovernor:
    """The process's one governor (every engine of a process shares its cores)."""
    return ThreadGovernor()
