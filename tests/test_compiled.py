"""The compiled decoder step (`compile: on`): warmed up off the request path, then the same answers as eager."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters as dynamo_counters

from canvas_ls.engine import Engine
from canvas_ls.engine.architecture import build_tiny_model
from canvas_ls.engine.compiled import KEPT_GRAPHS, ROWS, CompiledDecoder, graph_files, graph_path
from canvas_ls.engine.elementwise import eager_logits
from canvas_ls.engine.engine import InfillRequest
from canvas_ls.engine.layer_graphs import BY_LAYER_FROM, by_layer, layer_kinds
from canvas_ls.engine.threads import full_threads
from tests.conftest import tokenizer_texts
from tests.test_batching import PREFIXES, SUFFIXES

# The graphs are compiled by a child process at SCHED_IDLE (`paths.lowest_priority`): only on a core nothing else
# wants, so a compilation of ~25 s stretches while the other worker's tests hold both cores (278 s once, with one
# more process spinning): each test here may take up to 10 minutes before it counts as hung.
pytestmark = pytest.mark.timeout(600)


def test_compiled_steps_answer_as_eager_ones_alone_and_batched(tiny_model_dir: Path,
                                                                tiny_engine_fp32: Engine) -> None:  # fmt: skip
    compiled = Engine.load(str(tiny_model_dir), "cpu", dtype="float32", compile="on")
    assert compiled.decoder.report()["state"] == "warming"
    # Dynamo's capture and AOT autograd without inductor's C++ code generation (~40 s of 2 cores on a clean machine):
    # the engine's plumbing is what this checks; inductor's numerics on the shipped model: README, `bench step`.
    compiled.decoder = CompiledDecoder(compiled.loaded.model, "on", backend="aot_eager")
    settings = [{"gap_tokens": 8, "max_new_tokens": 8, "max_steps": 5, "seed": s} for s in (1, 2, 3)]
    requests = [InfillRequest(p, s, o) for p, s, o in zip(PREFIXES, SUFFIXES, settings, strict=True)]

    # While it warms up in the background, requests are served eager (never refused, never waiting on it).
    during = compiled.infill_batch(requests[:1])
    compiled.warm_up(background=False)
    report = compiled.decoder.report()
    assert report["state"] == "ready", report
    assert report["by_layer"] is None  # two layers: the whole decoder's graphs
    assert report["eager_steps"] == during[0].steps and report["compiled_steps"] == 0

    for batch in (requests[:1], requests[1:2], requests):  # alone, and three rows sharing each forward
        expected = tiny_engine_fp32.infill_batch(batch)
        got = compiled.infill_batch(batch)
        for want, have in zip(expected, got, strict=True):
            assert have.tokens == want.tokens
            assert have.steps == want.steps
    window = compiled.loaded.model.config.get_text_config().sliding_window
    long = InfillRequest("".join(f"y{i} = {i}\n" for i in range(window)) + "z = ", "\n", settings[0])
    assert compiled.infill_batch([long])[0].prefix_tokens > window  # sliding and full layers' caches now differ
    report = compiled.decoder.report()
    assert report["compiled_steps"] > 0 and report["eager_steps"] == during[0].steps
    assert report["compilations_after_warmup"] == 0  # the warm-up shapes cover one and several rows, short and long


def test_a_failed_compilation_leaves_the_engine_eager(tiny_model_dir: Path) -> None:
    engine = Engine.load(str(tiny_model_dir), "cpu", dtype="float32", compile="on")

    def broken() -> list[dict]:
        raise RuntimeError("no compiler here")

    engine.decoder.warm_up(broken, background=True)
    for thread in threading.enumerate():
        if thread.name == "canvas-compile":
            thread.join(timeout=30)
    report = engine.decoder.report()
    assert report["state"] == "failed" and "no compiler here" in report["detail"]
    result = engine.infill_batch([InfillRequest(PREFIXES[0], SUFFIXES[0], {"max_new_tokens": 4})])[0]
    assert engine.decoder.report()["eager_steps"] == result.steps > 0


def test_on_the_cpu_the_one_row_graph_serves_before_the_others_are_compiled(tiny_model_dir: Path) -> None:
    """An editor's request alone (one row) runs compiled as soon as its graph is, while batches of several rows run
    eager until theirs is done: the warm-up's wait halves for the common case."""
    engine = Engine.load(str(tiny_model_dir), "cpu", dtype="float32", compile="on")
    engine.decoder = CompiledDecoder(engine.loaded.model, "on", backend="aot_eager")
    settings = {"gap_tokens": 8, "max_new_tokens": 8, "max_steps": 3, "seed": 1}
    requests = [InfillRequest(p, s, settings) for p, s in zip(PREFIXES, SUFFIXES, strict=True)]
    several_rows_may_compile = threading.Event()

    def examples() -> Iterator[dict[str, Any]]:
        for batch in (requests[:1], requests):
            if len(batch) > 1:
                assert several_rows_may_compile.wait(60)
            pending = engine.batch()
            pending.add_many(batch)
            yield pending.decoder_inputs()

    engine.decoder.warm_up(examples, background=True)
    deadline = time.monotonic() + 60
    while "1 row" not in engine.decoder.report()["ready_seconds"] and time.monotonic() < deadline:
        time.sleep(0.05)
    alone = engine.infill_batch(requests[:1])[0]
    report = engine.decoder.report()
    assert report["state"] == "warming" and report["compiled_steps"] == alone.steps > 0, report
    together = engine.infill_batch(requests)
    report = engine.decoder.report()
    assert report["eager_steps"] == max(r.steps for r in together) and report["compiled_steps"] == alone.steps

    several_rows_may_compile.set()
    for thread in threading.enumerate():
        if thread.name == "canvas-compile":
            thread.join(timeout=60)
    report = engine.decoder.report()
    assert report["state"] == "ready" and list(report["ready_seconds"]) == ["1 row", "rows"], report
    assert report["compilations_after_warmup"] == 0
    engine.infill_batch(requests)
    assert engine.decoder.report()["compiled_steps"] > alone.steps


SECOND_START = """
import json, sys
from canvas_ls.engine import Engine
from canvas_ls.engine.compiled import CompiledDecoder
from canvas_ls.engine.engine import InfillRequest
from tests.test_batching import PREFIXES, SUFFIXES

compiled = Engine.load(sys.argv[1], "cpu", dtype="float32")
compiled.decoder = CompiledDecoder(compiled.loaded.model, "on", backend="aot_eager")
compiled.warm_up(background=False)
eager = Engine.load(sys.argv[1], "cpu", dtype="float32")
settings = [{"gap_tokens": 8, "max_new_tokens": 8, "max_steps": 5, "seed": s} for s in (1, 2, 3)]
requests = [InfillRequest(p, s, o) for p, s, o in zip(PREFIXES, SUFFIXES, settings, strict=True)]
same = [a.tokens == b.tokens for batch in (requests[:1], requests)
        for a, b in zip(compiled.infill_batch(batch), eager.infill_batch(batch), strict=True)]
report = compiled.decoder.report()
# A busy machine: the engine computes with one thread where the graphs were compiled with every core (their guards
# record the count); they still serve, with the same answers.
import torch
compiled.threads = None
torch.set_num_threads(1)
one = [a.tokens == b.tokens for a, b in zip(compiled.infill_batch(requests), eager.infill_batch(requests), strict=True)]
print(json.dumps({"report": report, "same": same, "one_thread": compiled.decoder.report(), "same_one": one}))
"""


def test_a_graph_saved_by_one_start_serves_the_next_and_other_weights_of_the_architecture(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """On the CPU each graph is compiled ahead of time and saved under the user's cache; an engine started again
    loads it instead of tracing and compiling. The weights are the graph's inputs: a model of the same architecture
    with other weights (a workspace's fine-tune) is served by the same graph with its own answers."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # nothing saved yet (the second start inherits it)
    first = Engine.load(str(tiny_model_dir), "cpu", dtype="float32")
    first.decoder = CompiledDecoder(first.loaded.model, "on", backend="aot_eager")
    traced = dynamo_counters["stats"]["unique_graphs"]
    first.warm_up(background=False)
    assert first.decoder.report()["graphs"] == {"1 row": "compiled", "rows": "compiled"}
    assert dynamo_counters["stats"]["unique_graphs"] == traced  # compiled by a child process, not beside requests
    saved = {rows: graph_path(first.loaded.model, rows, "aot_eager") for rows in ("1 row", "rows")}
    assert all(path.is_file() for path in saved.values())

    infill = json.loads((tiny_model_dir / "canvas_ls.json").read_text())["infill"]  # as `train --from` keeps it
    other = build_tiny_model(tmp_path / "other", tokenizer_texts(), seed=7, infill=infill)  # other weights
    run = subprocess.run([sys.executable, "-c", SECOND_START, str(other)], capture_output=True, text=True,
                         timeout=300, cwd=Path(__file__).parent.parent)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    outcome = json.loads(run.stdout.strip().splitlines()[-1])
    report = outcome["report"]
    assert report["graphs"] == {"1 row": "loaded", "rows": "loaded"}, report
    assert report["compiled_steps"] > 0 and report["eager_steps"] == 0 and report["uncovered_steps"] == 0, report
    assert all(outcome["same"]) and len(outcome["same"]) == 4
    one = outcome["one_thread"]
    assert one["compiled_steps"] > report["compiled_steps"] and one["uncovered_steps"] == 0, one
    assert outcome["same_one"] == [True, True, True]
    probe = Engine.load(str(other), "cpu", dtype="float32")
    assert not torch.equal(probe.loaded.model.lm_head.weight, first.loaded.model.lm_head.weight)

    for index in range(KEPT_GRAPHS):  # graphs of other releases, least recently used first: pruned past 16
        old = saved["rows"].with_name(f"{index:04d}-old.pt2")
        old.write_bytes(b"old")
        os.utime(old, (1_000_000 + index, 1_000_000 + index))

    saved["1 row"].write_bytes(b"not a graph")  # damaged (or written by another torch): compiled again, not fatal
    again = CompiledDecoder(first.loaded.model, "on", backend="aot_eager")
    first.decoder = again
    first.warm_up(background=False)
    assert again.report()["graphs"] == {"1 row": "compiled", "rows": "loaded"}
    assert again.report()["state"] == "ready"
    kept = sorted(path.name for path in saved["rows"].parent.glob("*.pt2"))
    assert len(kept) == KEPT_GRAPHS and {p.name for p in saved.values()} <= set(kept)  # the oldest two went
    assert "0000-old.pt2" not in kept and "0001-old.pt2" not in kept and "0002-old.pt2" in kept

    class Broken:  # a graph whose guards pass but whose run fails: that step and the rest run eager
        def guard_check(self, *args: Any, **kwargs: Any) -> bool:
            return True

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("kernel crashed")

    again._precompiled["1 row"] = Broken()
    request = InfillRequest(PREFIXES[0], SUFFIXES[0], {"gap_tokens": 8, "max_new_tokens": 8, "max_steps": 3})
    answer = first.infill_batch([request])[0]
    report = again.report()
    assert report["state"] == "failed" and "kernel crashed" in report["detail"]
    assert report["eager_steps"] == answer.steps > 0


def test_the_compiling_process_started_with_the_engine_serves_its_warm_up(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """`canvas-ls engine` starts the compiling child before its own imports (`start_early`); the warm-up reads that
    one instead of starting another, and stops it where the graphs are already saved."""
    from canvas_ls.engine import compiled as compiled_module
    from canvas_ls.engine.compile_child import CompilerProcess, start_early

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("CANVAS_LS_COMPILE")
    for refused in (dict(compile="off"), dict(quantize="int8"), dict(device="cuda"), dict(model="org/hub-id")):
        assert start_early(**{"model": str(tiny_model_dir), "device": "cpu", "dtype": "auto", "compile": "auto",
                              "quantize": "auto", **refused}) is None, refused  # fmt: skip
    monkeypatch.setenv("CANVAS_LS_COMPILE", "off")  # as the test suite runs: auto is off
    assert start_early(str(tiny_model_dir), "cpu", "auto", "auto", "auto") is None

    early = CompilerProcess(str(tiny_model_dir), "float32", "aot_eager")
    engine = Engine.load(str(tiny_model_dir), "cpu", dtype="float32")
    engine.decoder = decoder = CompiledDecoder(engine.loaded.model, "on", backend="aot_eager")
    engine.early_compiler = early
    monkeypatch.setattr(compiled_module, "CompilerProcess", None)  # a second child would fail the warm-up
    engine.warm_up(background=False)
    assert decoder.report()["graphs"] == {"1 row": "compiled", "rows": "compiled"}, decoder.report()
    assert decoder.report()["state"] == "ready" and decoder.ready_seconds["1 row"] > 0

    late = CompilerProcess(str(tiny_model_dir), "float32", "aot_eager")  # the next start: graphs saved
    engine.decoder = again = CompiledDecoder(engine.loaded.model, "on", backend="aot_eager")
    engine.early_compiler = late
    engine.warm_up(background=False)
    assert again.report()["graphs"] == {"1 row": "loaded", "rows": "loaded"}
    assert late._process.returncode is not None  # stopped, not left compiling
    # and they serve: a graph traced in the child whose guards this process's model fails would leave every step
    # eager (a per-process wrapper on the attention layers once did, for every saved graph)
    engine.infill("def area(r):\n    return ", "\n", {"max_steps": 3, "stability_threshold": 100})
    assert again.steps["eager"] == again.uncovered_steps == 0 < again.steps["compiled"], again.steps


def test_the_compiling_process_loads_the_weights_the_engine_runs(tiny_model_dir: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The child compiles the model as the engine loaded it, not as "auto" would: a 0.5B engine asked for float
    weights once had a child load int8-dynamic (auto's choice at that size), which runs eager, so it never compiled.
    The saved graph's name tells the weights apart."""
    from canvas_ls.engine.compile_child import CompilerProcess
    from canvas_ls.engine.compiled import graph_path

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    engine = Engine.load(str(tiny_model_dir), "cpu", dtype="float32", quantize="none")
    engine.decoder = CompiledDecoder(engine.loaded.model, "on", backend="aot_eager")
    started: list[tuple[str, ...]] = []
    real = CompilerProcess.__init__

    def recorded(self: CompilerProcess, *args: Any, **kwargs: Any) -> None:
        real(self, *args, **kwargs)
        started.append((self.folder, self.dtype, self.backend, self.quantize))

    monkeypatch.setattr(CompilerProcess, "__init__", recorded)
    engine.warm_up(background=False)
    assert started == [(str(tiny_model_dir), "float32", "aot_eager", "none")]
    assert engine.decoder.report()["state"] == "ready"
    child = object.__new__(CompilerProcess)  # what `serves` reads, no process
    child.folder, child.dtype, child.backend = str(tiny_model_dir), "float32", "aot_eager"
    for started_with, engine_runs, serves in (("auto", "none", True), ("auto", "int8-dynamic", True),
                                              ("none", "none", True), ("none", "int8-dynamic", False)):  # fmt: skip
        child.quantize = started_with  # "auto" resolves in the child as in the engine: the same model and machine
        assert child.serves(str(tiny_model_dir), "float32", "aot_eager", engine_runs) is serves
    quantised = CompilerProcess(str(tiny_model_dir), "float32", "aot_eager", quantize="int8-dynamic")
    for _ in quantised.lines():
        pass
    assert "int8-dynamic weights run eager" in (quantised.finish() or "")
    int8 = Engine.load(str(tiny_model_dir), "cpu", dtype="float32", quantize="int8-dynamic")
    assert graph_path(int8.loaded.model, "1 row", "inductor") != graph_path(engine.loaded.model, "1 row", "inductor")


def test_a_guard_check_serves_the_steps_of_one_batch_and_is_asked_again_when_the_batch_changes(
        tiny_model_dir: Path) -> None:  # fmt: skip
    """Checking a saved graph's guards walks every input tensor (~0.6 ms a step on 2 cores): the answer is kept
    while the batch's cache object and the layout of its other inputs stay the same, and asked again when a job
    joins or leaves or a canvas extends the cache. A refusal is kept the same way (those steps run eager)."""

    class Recording:
        def __init__(self, accept: bool):
            self.accept, self.checks = accept, 0

        def guard_check(self, model: Any, **inputs: Any) -> bool:
            self.checks += 1
            return self.accept

        def __call__(self, model: Any, **inputs: Any) -> Any:
            return model(**inputs)

    engine = Engine.load(str(tiny_model_dir), "cpu", dtype="float32")
    eager = Engine.load(str(tiny_model_dir), "cpu", dtype="float32")
    engine.decoder = decoder = CompiledDecoder(engine.loaded.model, "on", backend="aot_eager")
    alone, together = Recording(True), Recording(False)
    decoder._precompiled, decoder.state = {"1 row": alone, "rows": together}, "ready"
    settings = {"gap_tokens": 4, "max_new_tokens": 12, "max_steps": 4}
    requests = [InfillRequest(PREFIXES[i], SUFFIXES[i], settings) for i in range(2)]

    first = engine.infill_batch(requests[:1])[0]
    assert first.steps > first.canvases >= 2  # several steps per canvas, and a next canvas after the first
    assert alone.checks == first.canvases  # once per batched cache, not once per step
    assert decoder.report()["compiled_steps"] == first.steps
    second = engine.infill_batch(requests[1:])[0]  # another request: another cache, asked again
    assert alone.checks == first.canvases + second.canvases

    both = engine.infill_batch(requests)
    report = decoder.report()
    steps = max(result.steps for result in both)
    assert report["uncovered_steps"] == report["eager_steps"] == steps  # refused, and eager, at every step...
    assert 1 <= together.checks < steps  # ...from checks kept across the steps of one batch
    assert [r.tokens for r in both] == [r.tokens for r in eager.infill_batch(requests)]
    assert [r.tokens for r in (first, second)] == [r.tokens for r in both]


def test_auto_compiles_on_the_cpu_by_the_child_process_only(tiny_model_dir: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """`compile: auto` (the default) turns the compiled step on on the CPU too, but there only the child process
    compiles: where it cannot, the engine stays eager and says why (never tracing the model beside requests).
    CANVAS_LS_COMPILE stands in for auto (the test suite sets it off)."""
    monkeypatch.delenv("CANVAS_LS_COMPILE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # no saved graphs
    engine = Engine.load(str(tiny_model_dir), "cpu", dtype="float32")
    engine.decoder = decoder = CompiledDecoder(engine.loaded.model, "auto", backend="aot_eager")
    assert decoder.enabled and not decoder.compile_here and decoder.report()["state"] == "warming"
    no_compiler = tmp_path / "python"  # the child's interpreter: a machine where the compilation fails
    no_compiler.write_text("#!/bin/sh\necho 'error: no C++ compiler (g++) found' >&2\nexit 3\n")
    no_compiler.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(no_compiler))
    traced = dynamo_counters["stats"]["unique_graphs"]
    engine.warm_up(background=False)
    report = decoder.report()
    assert report["state"] == "failed", report
    assert "status 3" in report["detail"] and "no C++ compiler (g++) found" in report["detail"], report
    assert dynamo_counters["stats"]["unique_graphs"] == traced  # nothing traced in the engine's process
    answer = engine.infill(PREFIXES[0], SUFFIXES[0], {"max_steps": 3})
    assert decoder.report()["eager_steps"] == answer.steps > 0

    for value, enabled in (("off", False), ("on", True)):
        monkeypatch.setenv("CANVAS_LS_COMPILE", value)
        assert CompiledDecoder(engine.loaded.model, "auto").enabled is enabled
        assert CompiledDecoder(engine.loaded.model, "on").enabled  # a mode given by name is kept
    monkeypatch.setenv("CANVAS_LS_COMPILE", "fast")
    with pytest.raises(ValueError, match="CANVAS_LS_COMPILE"):
        CompiledDecoder(engine.loaded.model, "auto")


def test_inductors_kernels_are_kept_under_the_users_cache(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Loading a model fixes inductor's folder (/tmp by default, gone at a reboot): a compiling engine sets the
    user's cache first."""
    code = ("import os, sys; from canvas_ls.engine import Engine; Engine.load(sys.argv[1], 'cpu', compile='on'); "
            "print(os.environ['TORCHINDUCTOR_CACHE_DIR'])")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"} | {"XDG_CACHE_HOME": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", code, str(tiny_model_dir)], env=env, capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == str(tmp_path / "canvas-ls" / "torchinductor")


HEAD_START = """
import logging
import torch
from canvas_ls.engine.compiled import compile_model, warm_compiler_caches

logging.basicConfig(level=logging.INFO)  # a head start that could not run says so at INFO

warm_compiler_caches().join()
fn = compile_model(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()), torch.device("cpu"), dynamic=False)
with torch.no_grad():
    fn(torch.randn(4, 8))
"""


def test_the_compiling_process_sets_up_the_c_compiler_ahead_for_the_graphs(tmp_path: Path) -> None:
    """The compiling child's head start (`warm_compiler_caches`, on the second core while the model is traced)
    precompiles the very header inductor's C++ wrapper then compiles with: a compilation after it builds no other
    (a mismatch would cost both cores the work twice). It leans on inductor's internals, so this pins them."""
    env = os.environ | {"TMPDIR": str(tmp_path), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    run = subprocess.run([sys.executable, "-c", HEAD_START], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "no head start" not in run.stderr
    headers = list(tmp_path.glob("torchinductor_*/precompiled_headers/*.gch"))
    assert len(headers) == 1, headers


def test_a_deep_decoder_compiles_one_graph_per_kind_of_layer_that_serves_every_layer_of_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Compiling a decoder whole takes time in proportion to its depth (a 24-layer 0.5B model: 11 minutes on 2
    cores): a deep one compiles and saves one graph per kind of layer, which every layer of the kind runs on its own
    weights and its own cache. The same answers as eager, alone and batched, past the sliding window, in this start
    and in the next, which loads the graphs; a layer whose guards refuse its inputs sends the step eager."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("CANVAS_LS_COMPILE_BY_LAYER", "on")  # three layers: below the depth that turns it on
    infill = {"layout": "canvas", "gap_tokens": 8, "max_new_tokens": 16}
    deep = build_tiny_model(tmp_path / "deep", tokenizer_texts(), layers=3, infill=infill)
    engine = Engine.load(str(deep), "cpu", dtype="float32")
    eager = Engine.load(str(deep), "cpu", dtype="float32")
    model = engine.loaded.model
    assert layer_kinds(model) == {0: [0, 1], 2: [2]}  # two sliding-window layers share a graph, the full one its own
    engine.decoder = decoder = CompiledDecoder(model, "on", backend="aot_eager")
    engine.warm_up(background=False)
    assert decoder.report()["graphs"] == {"1 row": "compiled", "rows": "compiled"}, decoder.report()
    assert decoder.report()["by_layer"] == {"kinds": 2, "layers": 3}  # in /health
    for rows in ROWS:
        files = graph_files(model, rows, "aot_eager")
        assert set(files) == {0, 2} and all(path.is_file() for path in files.values())
        assert not graph_path(model, rows, "aot_eager").exists()  # no whole decoder's graph

    settings = [{"gap_tokens": 8, "max_new_tokens": 8, "max_steps": 5, "seed": s} for s in (1, 2, 3)]
    requests = [InfillRequest(p, s, o) for p, s, o in zip(PREFIXES, SUFFIXES, settings, strict=True)]
    window = model.config.get_text_config().sliding_window
    long = InfillRequest("".join(f"y{i} = {i}\n" for i in range(window)) + "z = ", "\n", settings[0])
    for batch in (requests[:1], requests, [long], [long, *requests[1:]]):
        assert [r.tokens for r in engine.infill_batch(batch)] == [r.tokens for r in eager.infill_batch(batch)]
    report = decoder.report()
    assert report["compiled_steps"] > 0 and report["eager_steps"] == report["uncovered_steps"] == 0, report
    batch = engine.batch()  # the logits themselves, two rows, one past the window: each layer read its own cache
    batch.add_many([long, requests[1]])
    with torch.inference_mode():
        inputs = batch.decoder_inputs()
        expected = eager_logits(model, inputs)
    torch.testing.assert_close(decoder(**inputs), expected, rtol=1e-5, atol=1e-5)

    run = subprocess.run([sys.executable, "-c", SECOND_START, str(deep)], capture_output=True, text=True,
                         timeout=300, cwd=Path(__file__).parent.parent)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    outcome = json.loads(run.stdout.strip().splitlines()[-1])
    assert outcome["report"]["graphs"] == {"1 row": "loaded", "rows": "loaded"}, outcome["report"]
    assert outcome["report"]["eager_steps"] == 0 < outcome["report"]["compiled_steps"], outcome["report"]
    assert all(outcome["same"]) and outcome["same_one"] == [True, True, True]  # on one thread too

    class Refusing:  # the full-attention layer's graph refuses whatever it is given
        checks = 0

        def guard_check(self, *args: Any, **kwargs: Any) -> bool:
            # counted once per check: a refusal with fewer threads (a busy machine) is asked again with all
            Refusing.checks += torch.get_num_threads() == full_threads()
            return False

    layers = decoder._precompiled["1 row"]
    layers.graphs[2] = Refusing()  # its layer runs eager within the forward, the others on their graph
    before = decoder.report()
    answer = engine.infill_batch(requests[:1])[0]
    assert answer.tokens == eager.infill_batch(requests[:1])[0].tokens
    after = decoder.report()
    assert after["eager_steps"] - before["eager_steps"] == after["uncovered_steps"] == answer.steps
    assert after["compiled_steps"] == before["compiled_steps"] and after["state"] == "ready"
    assert Refusing.checks == answer.canvases  # the refusal is kept for the steps of one batch

    class Failing:  # a graph whose guards pass but whose run fails: its layers, and every step after, run eager
        def guard_check(self, *args: Any, **kwargs: Any) -> bool:
            return True

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("kernel crashed")

    layers.graphs[0] = Failing()
    answer = engine.infill_batch(requests[1:2])[0]
    assert answer.tokens == eager.infill_batch(requests[1:2])[0].tokens
    report = decoder.report()
    assert report["state"] == "failed" and "kernel crashed" in report["detail"], report
    assert report["eager_steps"] - after["eager_steps"] == answer.steps


def test_the_depth_decides_whole_or_layer_by_layer_unless_the_environment_says(
        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    from transformers import DiffusionGemmaForBlockDiffusion

    from canvas_ls.engine.architecture import small_config

    shallow, deep = (DiffusionGemmaForBlockDiffusion(small_config(384, num_layers=n)) for n in (4, BY_LAYER_FROM))
    monkeypatch.delenv("CANVAS_LS_COMPILE_BY_LAYER", raising=False)
    assert not by_layer(shallow) and by_layer(deep)
    assert layer_kinds(deep) == {0: list(range(BY_LAYER_FROM - 1)), BY_LAYER_FROM - 1: [BY_LAYER_FROM - 1]}
    assert set(graph_files(shallow, "rows", "inductor")) == {None}
    assert set(graph_files(deep, "rows", "inductor")) == {0, BY_LAYER_FROM - 1}
    monkeypatch.setenv("CANVAS_LS_COMPILE_BY_LAYER", "off")
    assert not by_layer(deep)
    monkeypatch.setenv("CANVAS_LS_COMPILE_BY_LAYER", "on")
    assert by_layer(shallow)
    monkeypatch.setenv("CANVAS_LS_COMPILE_BY_LAYER", "yes")
    with pytest.raises(ValueError, match="CANVAS_LS_COMPILE_BY_LAYER must be one of auto, on, off, got 'yes'"):
        by_layer(deep)


def test_a_deep_decoders_int8_dynamic_layers_compile_as_one_operator_each(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A CPU's int8-dynamic weights (fbgemm's packed layers) run eager in a whole graph, which cannot take them as
    inputs; a deep decoder's layer graphs call each packed layer as one operator (`quantize.packed_linear`), found
    by a tensor the layer holds, so one graph serves every layer of a kind with its own packed weights: the same
    logits and answers as the eager int8 engine. A shallow decoder's int8 stays eager, and says so."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    infill = {"layout": "canvas", "gap_tokens": 8, "max_new_tokens": 16}
    deep = build_tiny_model(tmp_path / "deep", tokenizer_texts(), layers=3, infill=infill)
    shallow = Engine.load(str(deep), "cpu", quantize="int8-dynamic", compile="on")
    assert shallow.decoder.report()["detail"] == "off: int8-dynamic weights run eager"  # 3 layers: whole, eager

    monkeypatch.setenv("CANVAS_LS_COMPILE_BY_LAYER", "on")
    engine = Engine.load(str(deep), "cpu", quantize="int8-dynamic")
    eager = Engine.load(str(deep), "cpu", quantize="int8-dynamic")
    model = engine.loaded.model
    engine.decoder = decoder = CompiledDecoder(model, "on", backend="aot_eager")
    engine.warm_up(background=False)  # by the child process, which loads the same int8-dynamic weights
    report = decoder.report()
    assert report["state"] == "ready" and report["by_layer"] == {"kinds": 2, "layers": 3}, report
    assert all(path.is_file() for rows in ROWS for path in graph_files(model, rows, "aot_eager").values())

    # Prefixes encoded whole in both engines: int8-dynamic quantises an encoder call's activations with one scale,
    # so a prefix partly reused from the prefix cache (the warm-up's requests left snapshots) rounds differently
    settings = [{"gap_tokens": 8, "max_new_tokens": 8, "max_steps": 5, "seed": s, "reuse_prefix": False}
                for s in (1, 2, 3)]  # fmt: skip
    requests = [InfillRequest(p, s, o) for p, s, o in zip(PREFIXES, SUFFIXES, settings, strict=True)]
    for batch in (requests[:1], requests):
        assert [r.tokens for r in engine.infill_batch(batch)] == [r.tokens for r in eager.infill_batch(batch)]
    batch = engine.batch()
    batch.add_many(requests[:2])
    with torch.inference_mode():
        inputs = batch.decoder_inputs()
        expected = eager_logits(model, inputs)
    torch.testing.assert_close(decoder(**inputs), expected, rtol=1e-5, atol=1e-5)
    report = decoder.report()
    assert report["compiled_steps"] > 0 and report["eager_steps"] == report["uncovered_steps"] == 0, report
