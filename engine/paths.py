"""Where the resident engine lives on this machine: a private runtime folder with its socket, lock and log."""

from __future__ import annotations

import os
from pathlib import Path


def runtime_dir() -> Path:
    """The user's private folder for the socket, the lock file and the engine log (created 0700)."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    folder = Path(base) / "canvas-ls" if base else Path("/tmp") / f"canvas-ls-{os.getuid()}"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    return folder


def default_socket() -> Path:
    return runtime_dir() / "engine.sock"
