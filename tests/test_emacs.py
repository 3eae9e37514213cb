"""End to end in Emacs: Debian's Emacs 28 with eglot 1.9 (`emacs-nox`, `elpa-eglot`, installed by the README's test
command), editors/emacs/canvas-ls.el loaded as a user would, the real server and resident engine, and the tiny model
whose answers are known in advance (tests/conftest.py: `fixed_model_dir`). Emacs runs in batch mode and drives
eglot itself: tests/eglot_complete.el."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

EMACS = shutil.which("emacs")


@pytest.mark.skipif(EMACS is None, reason="Emacs is not installed (the README's test command installs emacs-nox)")
def test_completion_at_point_inserts_the_servers_item(fixed_model_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "area.py"
    path.write_text("def area(width, height):\n    return \n\n\nprint(area(2, 3))\n")
    environment = dict(os.environ, CANVAS_LS_EMACS=str(REPO / "editors" / "emacs"), CANVAS_LS_PYTHON=sys.executable,
                       CANVAS_LS_MODEL=str(fixed_model_dir), CANVAS_LS_FILE=str(path))  # fmt: skip
    run = subprocess.run([EMACS, "--batch", "-Q", "-l", str(REPO / "tests" / "eglot_complete.el")], cwd=tmp_path,
                         env=environment, capture_output=True, text=True, timeout=240)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    # (completion-at-point's "No match" rings the bell: in batch mode a ^G on stdout)
    result = json.loads(run.stdout.replace("\a", "").strip().splitlines()[-1])
    # The fixed model writes " None" where token healing cut the space, then "code" in each later slot (4 in all).
    assert result["offered"] == "Nonecodecodecode" and result["source"] == "model"
    assert result["before"] == "    return "
    assert result["after"] == "    return Nonecodecodecode"
    # M-x canvas-ls-learn-workspace reaches the server's command; a folder that is not there is its clear error
    assert result["learn"].startswith("canvas-ls: no folder to learn: "), result["learn"]
    # canvas-ls-mode came on with eglot; its M-\ inside a word asked, and the server said why nothing came
    assert result["mode"] == "on"
    # (eglot 1.9 prefixes "[eglot] Server reports (type=2): ", later ones their own)
    assert result["said"].endswith("canvas-ls: no suggestion: the cursor is inside a word (inside an identifier)")
    assert result["modeline"] == " canvas-ls:inside a word"
