"""The resident engine's compiled decoder on this machine's GPU (`compile: on`, CUDA graphs): warm-up time, answers
against eager's for requests alone and four together (in bf16 a compiled kernel rounds differently, so a random
model's near-tied answers can differ; fp32 is the exact comparison), and ms per batched step. Part of `.ci/gpu`."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from canvas_ls.engine import Engine
from canvas_ls.engine.engine import InfillRequest
from canvas_ls.engine.tasks import load_tasks


def run(engine: Engine, tasks: list, rows: int) -> tuple[list[str], float]:
    answers, steps, started = [], 0, time.perf_counter()
    for start in range(0, len(tasks), rows):
        batch = engine.batch()
        batch.add_many([InfillRequest(t.prompt, t.suffix, {"seed": 1}) for t in tasks[start : start + rows]])
        while len(batch):
            answers += [outcome.text for _, outcome in batch.step()]
            steps += 1
    return answers, (time.perf_counter() - started) / steps * 1000


def main(model: str, out: Path, device: str = "cuda", dtype: str = "auto", dataset: Path | None = None) -> None:
    tasks = load_tasks(dataset, limit=16, cursor="indented") if dataset else []
    if not tasks:  # the evaluation set does not travel: made-up single-line holes
        from canvas_ls.engine.tasks import Task

        tasks = [Task(f"t{i}", f"def f{i}(x):\n    y = x * {i}\n    ", "\n    return y\n", "", None, None)
                 for i in range(16)]  # fmt: skip
    report = {}
    for mode in ("off", "on"):
        engine = Engine.load(model, device, compile=mode, dtype=dtype)
        started = time.perf_counter()
        engine.warm_up(background=False)
        report[mode] = {"warmup_s": round(time.perf_counter() - started, 1), "decoder": engine.decoder.report()}
        for rows in (1, 4):
            run(engine, tasks[:4], rows)  # warm
            answers, ms = run(engine, tasks, rows)
            report[mode][f"rows{rows}"] = {"ms_per_step": round(ms, 2), "answers": answers}
        report[mode]["decoder"] = engine.decoder.report()  # after the runs: compiled and eager steps counted
    for rows in (1, 4):
        eager, compiled = report["off"][f"rows{rows}"]["answers"], report["on"][f"rows{rows}"]["answers"]
        same = sum(a == b for a, b in zip(eager, compiled, strict=True))
        print(f"rows {rows}: eager {report['off'][f'rows{rows}']['ms_per_step']} ms/step, compiled "
              f"{report['on'][f'rows{rows}']['ms_per_step']} ms/step, same answers {same}/{len(tasks)}")  # fmt: skip
    print("compiled decoder:", report["on"]["decoder"], "warm-up", report["on"]["warmup_s"], "s")
    out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":  # MODEL OUT.json [DEVICE [DTYPE [DATASET]]]
    main(sys.argv[1], Path(sys.argv[2]), *sys.argv[3:5], *(Path(p) for p in sys.argv[5:6]))
