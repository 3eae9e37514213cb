"""`canvas-ls bench warmup`: how long an engine with `--compile on` takes to have its compiled step, start after start.

Each start is a fresh process on a scratch cache folder (the user's own cache is left alone): the first with nothing
cached (a new machine), the second with inductor's cache only (the saved graphs removed: as after an upgrade of
canvas-ls), then `--starts` more with the graphs saved. Each reports when the one-row graph (a request alone) and
both graphs were ready and whether they were loaded or compiled. With `--dataset`, the last start also times steps
with the compiled graphs against an eager engine in the same process, alternating, on the dataset's holes.
`--by-layer auto,on,off` runs the starts once per choice of the whole decoder's graphs or one per kind of layer
(`engine/layer_graphs.py`, `CANVAS_LS_COMPILE_BY_LAYER`), each on its own empty caches. Figures, never pass/fail.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..engine.tasks import machine

START = """
import json, statistics, sys, time
from pathlib import Path
from canvas_ls.engine.tasks import load_tasks
from canvas_ls.engine.engine import Engine, InfillRequest

model, dtype, dataset, limit, quantize = sys.argv[1] or None, sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
started = time.perf_counter()
engine = Engine.load(model, "cpu", dtype=dtype, compile="on", quantize=quantize)
loaded = time.perf_counter() - started
engine.warm_up(background=False)
out = {"load_s": loaded, "compile": engine.decoder.report(), "dtype": engine.dtype, "weights": engine.loaded.quantized}
if dataset:
    eager = Engine.load(model, "cpu", dtype=dtype, quantize=quantize)
    tasks, same, compiled_ms, eager_ms = load_tasks(Path(dataset), limit), 0, [], []
    for task in tasks:
        request = [InfillRequest(task.prompt, task.suffix, {"seed": 1})]
        a, b = engine.infill_batch(request)[0], eager.infill_batch(request)[0]
        same += a.tokens == b.tokens
        compiled_ms.append(a.denoise_ms / max(a.steps, 1))
        eager_ms.append(b.denoise_ms / max(b.steps, 1))
    out["steps"] = {"tasks": len(tasks), "same_answers": same, "compiled_ms": statistics.median(compiled_ms),
                    "eager_ms": statistics.median(eager_ms), "after": engine.decoder.report()}
print(json.dumps(out))
"""


def run(model: str | None, dtype: str, starts: int, dataset: Path | None, limit: int,
        progress: Callable[[str], None], by_layer: tuple[str, ...] = ("auto",),
        quantize: str = "auto") -> dict[str, Any]:  # fmt: skip
    rows = []
    for choice in by_layer:
        rows += _starts(model, dtype, quantize, starts, dataset, limit, choice, progress)
    return {"machine": machine(), "model": model or "shipped", "starts": rows}


def _starts(model: str | None, dtype: str, quantize: str, starts: int, dataset: Path | None, limit: int, by_layer: str,
            progress: Callable[[str], None]) -> list[dict[str, Any]]:  # fmt: skip
    scratch = Path(tempfile.mkdtemp(prefix="canvas-warmup-"))
    (scratch / "tmp").mkdir()  # inductor's precompiled headers live under the temporary folder: none there either
    env = {**os.environ, "XDG_CACHE_HOME": str(scratch), "TORCHINDUCTOR_CACHE_DIR": str(scratch / "inductor"),
           "TMPDIR": str(scratch / "tmp"), "CANVAS_LS_COMPILE_BY_LAYER": by_layer}  # fmt: skip
    plan = ["nothing cached", "inductor's cache only"] + ["graphs saved"] * starts
    rows = []
    try:
        for index, name in enumerate(plan):
            if name == "inductor's cache only":
                shutil.rmtree(scratch / "canvas-ls" / "compiled", ignore_errors=True)
            last = index == len(plan) - 1
            args = [model or "", dtype, str(dataset) if dataset and last else "", str(limit), quantize]
            done = subprocess.run([sys.executable, "-c", START, *args], env=env, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"engine start '{name}' failed: {done.stderr.strip()[-2000:]}")
            result = json.loads(done.stdout.strip().splitlines()[-1])
            rows.append({"start": name, "by_layer": by_layer, **result})
            ready, compiled = result["compile"]["ready_seconds"], result["compile"]
            progress(f"by layer {by_layer}, {name}: one row {ready.get('1 row', 0):.1f} s, "
                     f"all {compiled['warmup_seconds'] or float('nan'):.1f} s ({compiled['detail']})")  # fmt: skip
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return rows


def format_warmup(report: dict[str, Any]) -> str:
    head = "| by layer | start | one row ready s | both graphs ready s | graphs | model load s |"
    weights = report["starts"][0].get("weights", "?") if report["starts"] else "?"
    lines = [f"machine: {report['machine']}; model: {report['model']} ({weights})", "", head, "|---" * 6 + "|"]
    for row in report["starts"]:
        compiled = row["compile"]
        graphs = ", ".join(f"{k}: {v}" for k, v in compiled.get("graphs", {}).items()) or compiled["detail"]
        one, both = compiled["ready_seconds"].get("1 row", float("nan")), compiled["warmup_seconds"] or float("nan")
        lines.append(f"| {row.get('by_layer', 'auto')} | {row['start']} | {one:.1f} | {both:.1f} | {graphs} | "
                     f"{row['load_s']:.1f} |")  # fmt: skip
    for row in report["starts"]:
        steps = row.get("steps")
        if steps:
            after, ratio = steps["after"], steps["compiled_ms"] / steps["eager_ms"]
            lines += ["", f"by layer {row.get('by_layer', 'auto')}, last start, {steps['tasks']} holes alternated "
                      f"with an eager engine ({row['dtype']}): median step {steps['compiled_ms']:.2f} ms compiled vs "
                      f"{steps['eager_ms']:.2f} ms eager ({ratio:.2f}x), {steps['same_answers']} of {steps['tasks']} "
                      f"answers equal, {after['compiled_steps']} compiled / {after['eager_steps']} eager / "
                      f"{after['uncovered_steps']} uncovered steps"]  # fmt: skip
    return "\n".join(lines)
