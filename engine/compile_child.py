"""The process that compiles and saves the CPU's decoder graphs (`python -m canvas_ls.engine.compile_worker`), started
without importing torch: `canvas-ls engine` starts it before its own imports (on a new machine the child's imports
and model load, ~5 s, then overlap the engine's instead of following them), else the warm-up starts it
(`CompiledDecoder`). The engine reads one JSON line per graph saved from its stdout.

Measured 2026-12-03 (2-core Xeon with AMX, shipped model, bf16, `canvas-ls engine` on empty caches, three starts
each, the code before and after alternated): the one-row graph served 42.5 / 40.9 / 42.0 s after the engine
started when its warm-up started the child, 38.1 / 37.7 / 37.6 s with the child started before the engine's
imports. With the graphs saved (every later start) the early child is stopped once the engine sees them: both
graphs loaded 7.6 / 7.7 s after the start before, 8.0 / 8.0 / 7.7 s after (requests are served eager from ~5 s).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from .paths import DEFAULT_MODEL_DIR

MODES = ("auto", "on", "off")


def compile_mode(mode: str) -> str:
    """The compiled step's mode: `mode` itself, or for "auto" what `CANVAS_LS_COMPILE` says (the test suite sets it
    off); a ValueError naming the choices for any other value."""
    if mode not in MODES:
        raise ValueError(f"compile must be one of {', '.join(MODES)}, got '{mode}'")
    if mode == "auto":
        mode = os.environ.get("CANVAS_LS_COMPILE") or "auto"
        if mode not in MODES:
            raise ValueError(f"CANVAS_LS_COMPILE must be one of {', '.join(MODES)}, got '{mode}'")
    return mode


class CompilerProcess:
    """A running compiling child: its graph lines as they come, then how it ended."""

    def __init__(self, folder: str, dtype: str, backend: str = "inductor", quantize: str = "auto"):
        # `quantize`: the engine's weights ("auto" resolves in the child as in the engine: the same model, the same
        # machine); the child compiles the graph of the model the engine runs, not of what "auto" would load
        self.folder, self.dtype, self.quantize, self.backend = folder, dtype, quantize, backend
        self.started = time.perf_counter()  # the warm-up's clock (`ready_seconds`) starts with the child
        self._errors = tempfile.TemporaryFile("w+")  # noqa: SIM115 (the child writes it for its whole life)
        command = [sys.executable, "-m", "canvas_ls.engine.compile_worker", folder, "--dtype", dtype,
                   "--quantize", quantize, "--backend", backend]  # fmt: skip
        self._process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=self._errors,
                                         stdin=subprocess.DEVNULL, text=True)  # fmt: skip

    def serves(self, folder: str, dtype: str, backend: str, quantize: str) -> bool:
        """Whether it compiles what an engine of this model folder, dtype, backend and weights needs."""
        same = Path(self.folder).resolve() == Path(folder).resolve() and self.backend == backend
        return same and self.dtype in ("auto", dtype) and self.quantize in ("auto", quantize)

    def lines(self) -> Iterator[str]:
        """Its stdout, line by line, until it exits."""
        assert self._process.stdout is not None
        yield from self._process.stdout

    def finish(self) -> str | None:
        """Wait for it to exit: None when it succeeded, else why it failed (its last line of errors)."""
        with self._errors:
            if self._process.wait() == 0:
                return None
            self._errors.seek(0)
            last = [line for line in self._errors.read().splitlines() if line.strip()][-1:] or ["no output"]
        return f"the compiling process exited with status {self._process.returncode}: {last[0][:300]}"

    def stop(self) -> None:
        """Not needed after all (graphs already saved, a GPU, weights that run eager): end it now."""
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait()
        self._errors.close()


def start_early(model: str | None, device: str | None, dtype: str, compile: str,
                quantize: str) -> CompilerProcess | None:  # fmt: skip
    """The compiling child of a `canvas-ls engine` about to load `model` on the CPU with its compiled step, started
    now; None where the engine will not want it: compile off, a hub id (the child loads a folder), torchao's
    quantised weights (eager), a GPU asked for or, under "auto", an NVIDIA driver present. (int8-dynamic compiles
    where the decoder is deep enough to compile layer by layer; else the engine stops the child when it sees that.)"""
    folder = DEFAULT_MODEL_DIR if model is None else Path(model).expanduser()
    kept = quantize in ("auto", "none", "int8-dynamic")
    if compile_mode(compile) == "off" or not kept or not (folder / "config.json").is_file():
        return None
    if device not in (None, "", "auto", "cpu") or (device != "cpu" and os.path.exists("/proc/driver/nvidia/version")):
        return None
    return CompilerProcess(str(folder), dtype, quantize=quantize)
