"""The resident engine's decoder forward, compiled: inductor on the CPU, CUDA graphs on a GPU.

A denoising step of a small model is mostly per-op overhead (`canvas-ls bench step`: on an H200 the shipped model's
eager forward takes ~15 ms whatever its shape, compiled with CUDA graphs 0.8-1.2 ms; on a 2-core Xeon 0.85x eager at
one row, 0.64x at 8; in the engine under real Neovim, 0.61x). `CompiledDecoder` stands in for the model in
`DenoisingBatch`:

- off: the model itself (eager).
- on: `torch.compile` of the model with dynamic shapes (rows, canvas width, cached prefix length), compiled in a
  background thread at engine start on made-up inputs of two row counts (a batch of one is its own graph) and a
  prefix past the sliding window (`Engine.warm_up`) while requests run eager; once warm, every step runs compiled.
  On the CPU each graph serves as soon as it is compiled: the one-row graph (an editor's request alone, the
  common case) first, 18.5-24.7 s into the warm-up with inductor's cache warm on 2 cores, while several rows run
  eager until theirs is done (37-46 s). On a GPU all wait for the last (CUDA graphs are not recorded beside
  running ones).
  A compilation that fails leaves the engine eager and says why (`/health`, the log). Compilations after the
  warm-up (a shape the guards did not cover) are counted.
- auto: on where there is a GPU, off on the CPU (where the gain is smaller and the warm-up holds 2 cores for about
  two minutes).

The compiled step always passes self-conditioning logits (zeros with a False mask where a row has none): the model
zeroes masked rows' soft embeddings exactly as it does without logits, and one graph then serves every step.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from canvas_ls.engine.paths import cache_dir

log = logging.getLogger("canvas-ls.compiled")
MODES = ("auto", "on", "off")


class CompiledDecoder:
    def __init__(self, model: Any, mode: str = "auto", backend: str = "inductor"):
        if mode not in MODES:
            raise ValueError(f"compile must be one of {', '.join(MODES)}, got '{mode}'")
        self.model = model
        device = next(model.parameters()).device
        self.enabled = mode == "on" or (mode == "auto" and device.type == "cuda")
        self.state = "warming" if self.enabled else "off"  # warming -> ready | failed
        self.detail = "" if self.enabled else f"compile={mode} on {device.type}"
        self.warmup_seconds: float | None = None
        self.ready_seconds: dict[str, float] = {}  # "1 row" / "rows": seconds from the warm-up's start to its graph
        self.steps = {"compiled": 0, "eager": 0}
        self.compilations_after_warmup = 0
        self._fn: Callable[..., Any] | None = None
        self._graphs_at_ready = 0
        self._graphs_on_cuda = self.enabled and device.type == "cuda"
        if self.enabled:
            self._fn = compile_model(model, device, backend, dynamic=True)

    @property
    def static_inputs(self) -> bool:
        """Whether callers should always pass self-conditioning tensors (one graph for every step)."""
        return self.enabled

    def __call__(self, **inputs: Any) -> torch.Tensor:
        """The logits of one decoder forward: compiled once its graph is warm, eager before and after a failure."""
        if self._serves(inputs) and self._fn is not None:
            try:
                if self._graphs_on_cuda:  # a new iteration: the last replay's outputs were copied out
                    torch.compiler.cudagraph_mark_step_begin()
                logits = self._fn(**inputs).logits
                if self._graphs_on_cuda:  # the next replay overwrites a graph's outputs; rows keep these logits
                    logits = logits.clone()
            except Exception as exc:  # a compiler failure costs the speed, never the request
                self._fail(exc)
            else:
                self.steps["compiled"] += 1
                graphs = _graphs()
                if self.state == "ready" and graphs > self._graphs_at_ready + self.compilations_after_warmup:
                    self.compilations_after_warmup = graphs - self._graphs_at_ready
                    log.info("compiled a new graph after the warm-up (%d so far)", self.compilations_after_warmup)
                return logits
        self.steps["eager"] += 1
        return self.model(**inputs).logits

    def _serves(self, inputs: dict[str, Any]) -> bool:
        """Whether the compiled graph for these inputs' row count is ready."""
        if self.state == "ready":
            return True
        return self.state == "warming" and _rows(inputs) in self.ready_seconds and not self._graphs_on_cuda

    def warm_up(self, examples: Callable[[], Iterable[dict[str, Any]]], background: bool = True) -> None:
        """Compile on `examples()` (decoder inputs of the shapes to cover); in a thread unless `background` is False.
        Requests meanwhile run eager."""
        if not self.enabled:
            return
        if background:
            threading.Thread(target=self._warm_up, args=(examples,), name="canvas-compile", daemon=True).start()
        else:
            self._warm_up(examples)

    def _warm_up(self, examples: Callable[[], Iterable[dict[str, Any]]]) -> None:
        started = time.perf_counter()
        try:
            assert self._fn is not None
            with torch.inference_mode():
                for inputs in examples():
                    for _ in range(3 if self._graphs_on_cuda else 1):  # CUDA graphs record on a later call
                        if self._graphs_on_cuda:
                            torch.compiler.cudagraph_mark_step_begin()
                        self._fn(**inputs)
                    rows = _rows(inputs)
                    if rows not in self.ready_seconds:
                        self.ready_seconds[rows] = time.perf_counter() - started
                        log.info("decoder compiled for %s in %.1f s", rows, self.ready_seconds[rows])
        except Exception as exc:
            self._fail(exc)
            return
        self.warmup_seconds = time.perf_counter() - started
        if self.state != "warming":
            return  # stopped meanwhile (`stop`): the graph no longer matches the model
        self._graphs_at_ready = _graphs()
        self.state = "ready"
        self.detail = f"{self._graphs_at_ready} graphs"
        log.info("decoder compiled in %.1f s (%s); steps run compiled from now", self.warmup_seconds, self.detail)

    def stop(self, reason: str) -> None:
        """Eager from now on (the model changed under the graph), and why."""
        if self.enabled and self.state != "off":
            self.state, self.detail = "off", reason
            log.info("the compiled step is off: %s", reason)

    def _fail(self, exc: Exception) -> None:
        self.state, self.detail = "failed", f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        log.warning("compiling the decoder failed, the engine stays eager: %s", self.detail)

    def report(self) -> dict[str, Any]:
        """What `/health` and `/metrics` show."""
        return {"state": self.state, "detail": self.detail, "warmup_seconds": self.warmup_seconds,
                "ready_seconds": dict(self.ready_seconds), "compiled_steps": self.steps["compiled"],
                "eager_steps": self.steps["eager"],
                "compilations_after_warmup": self.compilations_after_warmup}  # fmt: skip


def compile_model(model: Any, device: torch.device, backend: str = "inductor", dynamic: bool = True) -> Any:
    """`torch.compile` as the engine runs it: CUDA graphs on a GPU; on the CPU inductor with its C++ wrapper (the
    compiled forward 0.79-0.82x eager vs 0.89-0.92x with the Python wrapper: shipped model, fp32, 2-core Xeon, 1k
    prefix, 1 and 4 rows)."""
    # Inductor's caches (compiled kernels, graphs) under the user's cache instead of /tmp: an engine started again,
    # after a reboot too, loads its graphs instead of compiling them (`Engine.warm_up`'s time, README).
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "torchinductor"))
    inductor = backend == "inductor"
    mode = "reduce-overhead" if device.type == "cuda" and inductor else None
    options = {"cpp_wrapper": True} if device.type == "cpu" and inductor else None
    return torch.compile(model, mode=mode, dynamic=dynamic, backend=backend, options=options)


def _rows(inputs: dict[str, Any]) -> str:
    """Which graph a forward needs: one row (specialised by dynamo) or several."""
    return "1 row" if inputs["decoder_input_ids"].shape[0] == 1 else "rows"


def _graphs() -> int:
    """Graphs dynamo has compiled in this process."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
