"""The resident engine's decoder forward, compiled: inductor on the CPU, CUDA graphs on a GPU.

A denoising step of a small model is mostly per-op overhead (`canvas-ls bench step`: on an H200 the shipped model's
eager forward takes ~15 ms whatever its shape, compiled with CUDA graphs 0.8-1.2 ms; on a 2-core Xeon 0.85x eager at
one row, 0.64x at 8; in the engine under real Neovim, 0.61x). `CompiledDecoder` stands in for the model in
`DenoisingBatch`:

- off: the model itself (eager).
- on, on the CPU: each graph compiled ahead of time (`aot_compile` of the model with dynamic shapes: rows, canvas
  width, cached prefix length; one graph per row count, a batch of one being its own; a decoder of 8 layers or more
  one graph per kind of layer and row count instead, `layer_graphs.py`) on made-up inputs
  (`Engine.warm_up`: one row, two rows, a prefix past the sliding window) by a child process at the lowest CPU
  priority (`python -m canvas_ls.engine.compile_worker`; compiling in the engine's own process stalled requests for up
  to 8.5 s), while requests run eager, and saved under the user's cache (`graph_path`: keyed by the model's
  architecture and dtype, torch, transformers, the CPU's kernels and this code). The next engine start loads the
  saved graphs instead of tracing and compiling: ~3 s for both on 2 cores, where a new machine's first start
  takes ~25 s to the one-row graph and ~45 s to both (2-core Xeon, `canvas-ls bench warmup`; the C++ compiler is
  set up on the second core meanwhile, `warm_compiler_caches`; the in-place `torch.compile` warm-up this replaced
  took 39-46 s at every start, 108-138 s on a new machine). The weights are the graph's
  inputs, so one saved graph serves every model of the architecture (a workspace's fine-tune too). Each graph
  serves as soon as it is there, the one-row graph (an editor's request alone) first. A step whose inputs its
  graph's guards refuse runs eager and is counted (`uncovered_steps`): nothing compiles on the request path.
- on, on a GPU: `torch.compile` with CUDA graphs, compiled in place on the same made-up inputs; all graphs are
  awaited (CUDA graphs are not recorded beside running ones). Compilations after the warm-up (a shape the guards
  did not cover) are counted.
  A compilation that fails leaves the engine eager and says why (`/health`, the log).
- auto (the default): on, except that on the CPU only the child process compiles: where it cannot (no C++
  compiler, no model folder to hand it) the engine stays eager and says why, instead of tracing beside requests.
  `CANVAS_LS_COMPILE=on|off` in the environment stands in for `auto` (the test suite runs with it off).
  On by default on the CPU since 2026-12-02: with the graphs saved (~3 s from the second start on) and the
  compilation at the lowest priority, a new machine's first start's 1-2 minutes of compiling (2 cores) cost
  requests little (p50 112 vs 91 ms on a 2-core Xeon), and every later step is 0.6x eager.

The compiled step always passes self-conditioning logits (the batch's buffer, `conditioning.py`, with a False mask
where a row has none): the model zeroes masked rows' soft embeddings exactly as it does without logits, and one graph
then serves every step.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import io
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from .compile_child import CompilerProcess, compile_mode
from .elementwise import eager_logits
from .graph_guards import KeptCheck, compile_options, save_ahead, serializable
from .layer_graphs import LayerGraphs, by_layer, compile_layers, layer_kinds
from .loading import decoder_experts
from .paths import cache_dir, die_with_parent

log = logging.getLogger(__name__)


class CompiledDecoder:
    def __init__(self, model: Any, mode: str = "auto", backend: str = "inductor"):
        from .quantize import compiles, is_cpu_int8, quantized_kind

        self.model = model
        device = next(model.parameters()).device
        # Quantised weights run eager unless their experts run the GPU kernel: the other expert implementations loop
        # over the experts the tokens picked (`engine.quantize`), which neither a whole-graph compilation nor CUDA
        # graphs can hold (said whenever compile was not asked off: the mode as asked, before CANVAS_LS_COMPILE); a
        # CPU's int8-dynamic layers compile where the decoder compiles layer by layer (`quantize.packed_linear`)
        layered = device.type == "cpu" and by_layer(model)  # compiled one graph per kind of layer (`layer_graphs.py`)
        eager_weights = mode != "off" and not (compiles(model) or (layered and is_cpu_int8(model)))
        mode = compile_mode(mode)
        self.enabled = mode != "off" and not eager_weights
        # On the CPU, whether the engine may compile in its own process where the child cannot ("on" only: under
        # "auto" a machine that cannot compile stays eager rather than trace the model beside the user's requests).
        self.compile_here = mode == "on"
        self.state = "warming" if self.enabled else "off"  # warming -> ready | failed
        self.detail = "" if self.enabled else f"compile={mode} on {device.type}"
        if eager_weights:
            self.detail = f"off: {quantized_kind(model)} weights run eager"
        self.warmup_seconds: float | None = None
        self.ready_seconds: dict[str, float] = {}  # "1 row" / "rows": seconds from the warm-up's start to its graph
        self.steps = {"compiled": 0, "eager": 0}
        self.compilations_after_warmup = 0
        self.uncovered_steps = 0  # precompiled: steps whose inputs no saved graph's guards accept (run eager)
        self.graphs: dict[str, str] = {}  # "1 row" / "rows" -> "loaded" | "compiled", as each comes to serve
        self.backend = backend
        # The model folder, dtype and weights (`quantized_kind`) of a process that compiles and saves the graphs the
        # warm-up lacks (`Engine.warm_up` sets them): compiling in the engine's own process held up its requests for
        # seconds (dynamo's tracing beside them), a child at the lowest CPU priority does not. None: compile here.
        self.compiler: tuple[str, str, str] | None = None
        # That process, when `canvas-ls engine` started it before loading the model (`compile_child.start_early`)
        self.early: CompilerProcess | None = None
        self.child_error: str | None = None  # why the compiling process failed, when it did
        self.announce: Callable[[str], None] | None = None  # told each graph's rows as it serves
        self._fn: Callable[..., Any] | None = None
        self._precompiled: dict[str, Any] = {}  # rows -> a loaded or ahead-of-time compiled graph
        self._graphs_at_ready = 0
        self._guards = KeptCheck()  # the last guard check, kept for the steps of one batch
        self._graphs_on_cuda = self.enabled and device.type == "cuda"
        # On the CPU each graph is compiled ahead of time and saved, so that the next start loads it in ~2 s instead
        # of tracing and compiling it again (~20 s a graph on 2 cores); on a GPU torch.compile's CUDA graphs.
        self._ahead = self.enabled and device.type == "cpu"
        # A deep decoder's CPU graphs are one per kind of layer (`layer_graphs.py`): {"kinds": K, "layers": N}
        self.by_layer: dict[str, int] | None = None
        if self._ahead and layered:
            self.by_layer = {"kinds": len(layer_kinds(model)), "layers": len(model.model.decoder.layers)}
        if self.enabled and not self._ahead:
            self._fn = compile_model(model, device, backend, dynamic=True)

    @property
    def static_inputs(self) -> bool:
        """Whether callers should always pass self-conditioning tensors (one graph for every step)."""
        return self.enabled

    def __call__(self, eager: bool = False, **inputs: Any) -> torch.Tensor:
        """The logits of one decoder forward: compiled once its graph is warm, eager before and after a failure, and
        where the caller asks (a step that records the canvas's keys and values: a graph does not call back)."""
        rows = _rows(inputs)
        if not eager and self._serves(rows):
            logits = self._run_precompiled(inputs, rows) if self._ahead else self._run_in_place(inputs)
            if logits is not None:
                return logits
        self.steps["eager"] += 1
        return eager_logits(self.model, inputs)

    def _run_in_place(self, inputs: dict[str, Any]) -> torch.Tensor | None:
        """torch.compile's logits (the GPU's CUDA graphs), or None after a compiler failure (then eager)."""
        assert self._fn is not None
        try:
            if self._graphs_on_cuda:  # a new iteration: the last replay's outputs were copied out
                torch.compiler.cudagraph_mark_step_begin()
            # A replay's outputs live until the next replay: the step reads these logits before it (the next step's
            # self-conditioning is copied into the batch's buffer, `conditioning.py`), so nothing is cloned
            logits = self._fn(**inputs).logits
        except Exception as exc:  # a compiler failure costs the speed, never the request
            self._fail(exc)
            return None
        graphs = _graphs()
        if self.state == "ready" and graphs > self._graphs_at_ready + self.compilations_after_warmup:
            self.compilations_after_warmup = graphs - self._graphs_at_ready
            log.info("compiled a new graph after the warm-up (%d so far)", self.compilations_after_warmup)
        self.steps["compiled"] += 1
        return logits

    def _run_precompiled(self, inputs: dict[str, Any], rows: str) -> torch.Tensor | None:
        """A saved graph's logits, or None where its guards do not accept these inputs (the step then runs eager;
        nothing is compiled on the request path). Layer graphs (`LayerGraphs`) check each kind's guards as its layers
        run, and run a layer eager where they refuse or its graph fails: that step's logits stand, counted eager."""
        graph = self._precompiled.get(rows)
        if graph is None:
            return None
        # Traced and run outside inference mode on a step's inference tensors: a saved graph's guards then read the
        # inputs' dispatch keys as they were when it was traced.
        with torch.inference_mode(False), torch.no_grad():
            if self._guards.accepts(graph, inputs["cache"], self.model, **inputs):
                try:
                    output = graph(self.model, **inputs)  # its guards checked just now (disabled inside)
                except Exception as exc:  # a graph that fails costs the speed, never the request
                    self._fail(exc)
                    return None
                error, eager_layers = getattr(output, "error", None), getattr(output, "eager_layers", 0)
                if error is not None:
                    self._fail(error)
                elif eager_layers:
                    self._uncovered()
                self.steps["eager" if error is not None or eager_layers else "compiled"] += 1
                return output.logits
        self._uncovered()
        return None

    def _uncovered(self) -> None:
        self.uncovered_steps += 1
        if self.uncovered_steps == 1:
            log.info("a step's shapes are not covered by the precompiled graphs; such steps run eager")

    def _serves(self, rows: str) -> bool:
        """Whether the compiled graph for this row count (`_rows`) is ready."""
        if self.state == "ready":
            return True
        return self.state == "warming" and rows in self.ready_seconds and not self._graphs_on_cuda

    def warm_up(self, examples: Callable[[], Iterable[dict[str, Any]]], background: bool = True) -> None:
        """Compile on `examples()` (decoder inputs of the shapes to cover); in a thread unless `background` is False.
        Requests meanwhile run eager."""
        if (not self.enabled or not self._ahead) and self.early is not None:  # started for a CPU compilation
            self.early.stop()  # this engine does not do
            self.early = None
        if not self.enabled:
            return
        if background:
            threading.Thread(target=self._warm_up, args=(examples,), name="canvas-compile", daemon=True).start()
        else:
            self._warm_up(examples)

    def _warm_up(self, examples: Callable[[], Iterable[dict[str, Any]]]) -> None:
        started = time.perf_counter()
        try:
            if self._ahead:
                saved = all(
                    path.exists() for rows in ROWS for path in graph_files(self.model, rows, self.backend).values()
                )
                child = self._child(saved)
                if child is not None:
                    started = child.started  # the warm-up began with the child (earlier, when started early)
                    self._compile_elsewhere(child, started)
                with torch.inference_mode():  # the examples' tensors made as a step makes them (inference tensors)
                    pending = iter(examples())
                while True:
                    with torch.inference_mode():
                        inputs = next(pending, None)
                    if inputs is None:
                        break
                    rows = _rows(inputs)
                    if rows not in self._precompiled:
                        self._ready(rows, *self._load_or_compile(inputs, rows), started)
            else:
                self._compile_in_place(examples, started)
        except Exception as exc:
            self._fail(exc)
            return
        self.warmup_seconds = time.perf_counter() - started
        if self.state != "warming":
            return  # stopped meanwhile (`stop`): the graph no longer matches the model
        self._graphs_at_ready = _graphs()
        self.state = "ready"
        self.detail = ", ".join(f"{rows}: {how}" for rows, how in self.graphs.items())
        log.info("decoder compiled in %.1f s (%s); steps run compiled from now", self.warmup_seconds, self.detail)

    def _ready(self, rows: str, graph: Any, how: str, started: float) -> None:
        """The graph for `rows` serves from now (a saved one; None for torch.compile's, which lives in `_fn`)."""
        if graph is not None:
            self._precompiled[rows] = graph
        self.graphs[rows] = how
        self.ready_seconds[rows] = time.perf_counter() - started
        kinds = self.by_layer
        per_kind = f" (one per kind of layer: {kinds['kinds']} for {kinds['layers']} layers)" if kinds else ""
        log.info("decoder graph for %s %s in %.1f s%s", rows, how, self.ready_seconds[rows], per_kind)
        if self.announce is not None:
            self.announce(rows)

    def _child(self, saved: bool) -> CompilerProcess | None:
        """The compiling process this warm-up reads: the one started early if it compiles for this engine, else a
        new one for `compiler` when graphs are missing; None when every graph is saved (an early one is stopped)."""
        early, self.early = self.early, None
        if self.compiler is None:
            if early is not None:
                early.stop()
            return None
        folder, dtype, quantize = self.compiler
        if early is not None and (saved or not early.serves(folder, dtype, self.backend, quantize)):
            early.stop()
            early = None
        if saved or early is not None:
            return early
        return CompilerProcess(folder, dtype, self.backend, quantize)

    def _compile_elsewhere(self, child: CompilerProcess, started: float) -> None:
        """Read the compiling process (`python -m canvas_ls.engine.compile_worker`) and load each graph as it says it
        saved it. If it fails, the warm-up compiles what is missing here (`compile: on`) or stays eager (`auto`), and
        says why."""
        try:
            for line in child.lines():  # one JSON line per graph saved, as it is saved (the one-row graph first)
                rows = _said_graph(line)
                if rows in ROWS and rows not in self._precompiled:
                    self._ready(rows, load_graphs(self.model, graph_files(self.model, rows, self.backend)), "compiled",
                                started)  # fmt: skip
        except BaseException:  # a graph that does not load here: the warm-up fails, and the child goes with it
            child.stop()
            raise
        self.child_error = child.finish()
        if self.child_error is not None:
            log.warning("%s; %s", self.child_error, "compiling here" if self.compile_here else "staying eager")

    def _load_or_compile(self, inputs: dict[str, Any], rows: str) -> tuple[Any, str]:
        """The graph for these inputs' row count: loaded from the cache where an earlier start saved it, else
        compiled ahead of time (dynamic shapes: whole, or one graph per kind of layer, `layer_graphs.py`) and saved
        there, where this process may compile (`compile_here`; else an error saying why there is none)."""
        paths = graph_files(self.model, rows, self.backend)
        if all(path.exists() for path in paths.values()):
            try:
                graph = load_graphs(self.model, paths)
                for path in paths.values():
                    os.utime(path)  # recently used: kept by `_prune`
                return graph, "loaded"
            except Exception as exc:  # another torch, a damaged file: compile it anew
                log.warning("the saved graph for %s does not load (%s: %s); compiling it again", rows,
                            type(exc).__name__, str(exc).splitlines()[0][:200])  # fmt: skip
        if not self.compile_here:
            why = self.child_error or "no model folder for a compiling process"
            raise RuntimeError(f"no compiled graph for {rows} ({why}); the step runs eager")
        if None in paths:
            compiled = compile_model(self.model, torch.device("cpu"), self.backend, saved=True)
            save_ahead(compiled.forward, ((), inputs), paths[None])
        else:
            keep_inductor_cache()
            compile_layers(self.model, inputs, self.backend, paths)
        _prune(next(iter(paths.values())).parent)
        return load_graphs(self.model, paths), "compiled"  # the saved graphs serve, as the next start's

    def _compile_in_place(self, examples: Callable[[], Iterable[dict[str, Any]]], started: float) -> None:
        """torch.compile's own warm-up (the GPU's CUDA graphs): each example's graph compiled by running it."""
        assert self._fn is not None
        with torch.inference_mode():
            for inputs in examples():
                for _ in range(3 if self._graphs_on_cuda else 1):  # CUDA graphs record on a later call
                    if self._graphs_on_cuda:
                        torch.compiler.cudagraph_mark_step_begin()
                    self._fn(**inputs)
                rows = _rows(inputs)
                if rows not in self.ready_seconds:
                    self._ready(rows, None, "compiled", started)

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
                "eager_steps": self.steps["eager"], "graphs": dict(self.graphs), "by_layer": self.by_layer,
                "uncovered_steps": self.uncovered_steps,
                "compilations_after_warmup": self.compilations_after_warmup}  # fmt: skip


def keep_inductor_cache() -> None:
    """Inductor's caches (compiled kernels) under the user's cache instead of /tmp: after a reboot too, a graph
    compiled again reuses its kernels. To be set before inductor first asks for its folder, which it then fixes
    for the process (loading a model asks: `Engine.load` sets it first); the compiling child inherits it."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "torchinductor"))


def compile_model(model: Any, device: torch.device, backend: str = "inductor", dynamic: bool = True,
                  saved: bool = False) -> Any:  # fmt: skip
    """`torch.compile` as the engine runs it: CUDA graphs on a GPU; on the CPU inductor with its C++ wrapper (the
    compiled forward 0.79-0.82x eager vs 0.89-0.92x with the Python wrapper: shipped model, fp32, 2-core Xeon, 1k
    prefix, 1 and 4 rows). `saved`: one whole graph (`fullgraph`) with only the guards a saved graph can carry, for
    `aot_compile`."""
    keep_inductor_cache()
    mode = "reduce-overhead" if device.type == "cuda" and backend == "inductor" else None
    options = compile_options(backend, serializable if saved else None) if device.type == "cpu" else None
    return torch.compile(model, mode=mode, dynamic=dynamic, backend=backend, options=options, fullgraph=saved)


def graph_path(model: Any, rows: str, backend: str, layer: int | None = None) -> Path:
    """Where the graph for this model's architecture, weights and row count is saved (under the user's cache): the
    whole decoder's, or with `layer` the graph of the kind of layers that starts there (`layer_graphs.py`)."""
    import transformers

    from .quantize import quantized_kind

    config = {k: v for k, v in model.config.to_dict().items() if k != "_name_or_path"}  # the architecture only
    config["experts"] = decoder_experts(model)  # not in to_dict
    config["weights"] = quantized_kind(model)  # a graph traced on float weights is not one of int8 weights
    versions = [torch.__version__, transformers.__version__, torch.backends.cpu.get_cpu_capability()]
    key = json.dumps([config, str(model.dtype), *versions, backend, rows, layer, _code()], sort_keys=True,
                     default=str)  # fmt: skip
    part = "" if layer is None else f"-layer{layer}"
    name = f"{hashlib.sha256(key.encode()).hexdigest()[:20]}-{rows.replace(' ', '-')}{part}.pt2"
    return cache_dir() / "compiled" / name


def graph_files(model: Any, rows: str, backend: str) -> dict[int | None, Path]:
    """The saved files of the graph for `rows`: the whole decoder's (key None), or one per kind of layer (keyed by
    its first layer) where the decoder compiles layer by layer (`layer_graphs.by_layer`)."""
    if not by_layer(model):
        return {None: graph_path(model, rows, backend)}
    return {first: graph_path(model, rows, backend, first) for first in layer_kinds(model)}


def load_graphs(model: Any, paths: dict[int | None, Path]) -> Any:
    """The saved graph in `paths` (`graph_files`): a whole decoder's, or its layer graphs together (`LayerGraphs`)."""
    if None in paths:
        return load_graph(paths[None])
    return LayerGraphs(model, {first: load_graph(path) for first, path in paths.items()})


@functools.cache
def _code() -> str:
    """A digest of the code that lays out the decoder's inputs, compiles them and replaces the model's attention,
    experts and int8 layers (a saved graph traced it, calls `quantize.packed_linear`, and its guards lean on it)."""
    here = Path(__file__).parent
    names = ("canvas.py", "compiled.py", "graph_guards.py", "layer_graphs.py", "loading.py", "quantize.py")
    return hashlib.sha256(b"".join((here / name).read_bytes() for name in names)).hexdigest()


def _said_graph(line: str) -> str | None:
    """The graph a line of the compiling child's stdout says it saved (None for any other output)."""
    try:
        said = json.loads(line)
    except ValueError:
        return None
    return said.get("graph") if isinstance(said, dict) else None


KEPT_GRAPHS = 16  # ~3.6 MB each for the shipped model: older models, torch versions and canvas-ls releases go


def _prune(folder: Path) -> None:
    """Only the most recently used saved graphs stay (each upgrade of torch or canvas-ls keys new ones)."""
    saved = sorted(folder.glob("*.pt2"), key=lambda p: p.stat().st_mtime, reverse=True)
    for stale in saved[KEPT_GRAPHS:]:
        stale.unlink(missing_ok=True)


def load_graph(path: Path) -> Any:
    """A saved graph, with the aliases of modules that dynamo's generated code refers to restored."""
    from torch._dynamo.aot_compile import AOTCompileUnpickler

    data = path.read_bytes()
    refs = AOTCompileUnpickler({}, io.BytesIO(data)).load()["runtime_env"].external_refs
    aliases = {ref: importlib.import_module(m.group(1).replace("_dot_", ".")) for ref in refs
               if (m := re.fullmatch(r"___module_(\w+?)_\d+_c\d+", ref))}  # fmt: skip
    graph = torch.compiler.load_compiled_function(io.BytesIO(data), f_globals=aliases)
    graph.disable_guard_check()  # the caller checks them (`guard_check`) to choose eager instead of an error
    return graph


ROWS = ("1 row", "rows")  # the graphs: a batch of one is its own (dynamo specialises it)


def _rows(inputs: dict[str, Any]) -> str:
    """Which graph a forward needs: one row (specialised by dynamo) or several."""
    return "1 row" if inputs["decoder_input_ids"].shape[0] == 1 else "rows"


def _graphs() -> int:
    """Graphs dynamo has compiled in this process."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def compiler_dies_with_parent() -> None:
    """The compiling process ends when the engine that started it does (killed or exited mid-compile), instead of
    compiling on for a minute with nobody to load its graphs."""
    import signal

    die_with_parent(signal.SIGTERM)


def warm_compiler_caches() -> threading.Thread:
    """Start, in a thread, inductor's one-time C++ set-up of a new machine: probing which vector instruction sets the
    compiler and CPU support (a dozen small compilations, each loaded by a probe process) and precompiling the
    C++ wrapper's header (under the system's temporary folder, shared by every later compilation). Inductor would
    do both, one after the other, in the middle of the first graph's compilation; started with the process they run
    on the second core while the model loads and dynamo traces it (2-core Xeon, nothing cached: the one-row graph
    ready 31.8-33.1 -> 22.7-23.3 s from the start of the compiling process). Private to inductor: where its call
    differs (another torch), the thread does nothing and inductor does the work itself, as before."""

    def warm() -> None:
        try:
            from torch._inductor.codecache import CppWrapperCodeCache

            # What inductor's C++ wrapper asks for (`CppWrapperCpu`): the same flags, so the same precompiled header;
            # the returned loader is never called, so nothing else is compiled
            CppWrapperCodeCache.load_pybinding_async(argtypes=["std::vector<AtenTensorHandle>"], main_code="\n",
                                                     device_type="cpu", needs_vec_isa=True, num_outputs=1)  # fmt: skip
        except Exception as exc:  # another torch's internals: inductor does it when it gets there
            log.info("no head start for the C++ compiler's set-up (%s: %s)", type(exc).__name__, exc)

    thread = threading.Thread(target=warm, name="canvas-compiler-setup", daemon=True)
    thread.start()
    return thread
