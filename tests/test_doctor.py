"""`canvas-ls doctor` finds each fault made on purpose, with its fix: no model files, a torch that cannot import, a
resident engine of another installation, a runtime folder too open or owned by another user, the VS Code extension
missing, a model larger than free memory; and passes a healthy set-up. Each run is the real command, in a process of
its own, with a PATH holding only the fake editors the test puts there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from canvas_ls.engine.paths import default_socket
from tests.test_identity import health_when_up, other_installation_engine


def doctor(tmp: Path, *args: str, code: str | None = None, **env: str) -> tuple[int, dict[str, dict[str, Any]]]:
    """Run `canvas-ls doctor --json`: its exit status and its checks by name. `code`: what a fake `code` on PATH
    lists as installed extensions (None: no VS Code)."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    if code is not None:
        (bin_dir / "code").write_text(f"#!/bin/sh\nprintf '{code}\\n'\n")
        (bin_dir / "code").chmod(0o755)
    environment = {**os.environ, "HOME": str(tmp / "home"), "PATH": str(bin_dir),
                   "XDG_RUNTIME_DIR": env.pop("XDG_RUNTIME_DIR", str(tmp / "run")), **env}  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "canvas_ls.server.cli", "doctor", "--json", *args],
                          capture_output=True, text=True, env=environment, timeout=120)  # fmt: skip
    report = json.loads(done.stdout)
    assert report["ok"] == (done.returncode == 0), done.stderr
    return done.returncode, {check["name"]: check for check in report["checks"]}


def test_a_healthy_set_up_passes(fixed_model_dir: Path, tmp_path: Path) -> None:
    status, checks = doctor(tmp_path, "--model", str(fixed_model_dir), code="ms-python.python\\ncanvas-ls.canvas-ls")
    assert status == 0
    assert {name: check["status"] for name, check in checks.items() if check["status"] == "broken"} == {}
    assert (checks["model"]["status"], checks["vscode"]["detail"]) == ("ok", "the canvas-ls extension is installed")
    assert checks["neovim"] == {"name": "neovim", "status": "note", "detail": "no `nvim` on PATH", "fix": None}


def test_a_model_folder_without_its_files(tmp_path: Path) -> None:
    empty = tmp_path / "model"
    empty.mkdir()
    status, checks = doctor(tmp_path, "--model", str(empty))
    assert (status, checks["model"]) == (1, {
        "name": "model", "status": "broken",
        "detail": f"{empty} lacks config.json, tokenizer.json, weights (*.safetensors)",
        "fix": f"{empty} is not a whole model: copy it again, or train one (canvas-ls train)",
    })  # fmt: skip


def test_a_model_larger_than_free_memory(fixed_model_dir: Path, tmp_path: Path) -> None:
    big = tmp_path / "big"
    big.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (big / name).write_bytes((fixed_model_dir / name).read_bytes())
    with open(big / "model.safetensors", "wb") as weights:
        weights.truncate(2**40)  # a sparse terabyte: its size, not its disk
    status, checks = doctor(tmp_path, "--model", str(big), "--device", "cpu")
    assert (status, checks["model"]["status"]) == (1, "broken")
    assert checks["model"]["detail"].startswith(f"{big}: 1,024.0 GiB of weights, ")
    assert checks["model"]["detail"].endswith(" free: it does not fit")
    assert checks["model"]["fix"] == "--quantize int8 (or int4 on a GPU) to hold it in a half or a quarter of that, " \
                                     "or a smaller model"  # fmt: skip


def test_a_torch_that_cannot_import(fixed_model_dir: Path, tmp_path: Path) -> None:
    fake = tmp_path / "site" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('raise ImportError("libtorch_cpu.so: cannot open shared object file")\n')
    status, checks = doctor(tmp_path, "--model", str(fixed_model_dir), PYTHONPATH=str(fake.parent))
    assert (status, checks["torch"]) == (1, {
        "name": "torch", "status": "broken",
        "detail": "torch does not import: ImportError: libtorch_cpu.so: cannot open shared object file",
        "fix": f"{sys.executable} -m pip install --force-reinstall torch==2.13.0 (a CPU build; a CUDA build from "
               "pytorch.org for a GPU)",
    })  # fmt: skip


@pytest.mark.parametrize("fault", ["too open", "another user's"])
def test_a_runtime_folder_others_can_reach(fixed_model_dir: Path, tmp_path: Path, fault: str) -> None:
    folder = tmp_path / "run" / "canvas-ls"
    folder.mkdir(parents=True)
    if fault == "too open":
        folder.chmod(0o777)
        expected = (f"{folder} has mode 0o777: others may reach the engine's socket", f"chmod 700 {folder}")
    else:
        if os.getuid() != 0:
            pytest.skip("giving a folder to another user needs root (CI runs as root)")
        os.chown(folder, 65534, 65534)
        expected = (f"{folder} belongs to uid 65534, not to you (0): another user could read or replace the engine's "
                    "socket", f"sudo rm -r {folder}, or set XDG_RUNTIME_DIR to a folder of your own")  # fmt: skip
    status, checks = doctor(tmp_path, "--model", str(fixed_model_dir))
    assert (status, checks["runtime folder"]["status"]) == (1, "broken")
    assert (checks["runtime folder"]["detail"], checks["runtime folder"]["fix"]) == expected


def test_a_resident_engine_of_another_installation(fixed_model_dir: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    runtime = tempfile.mkdtemp(prefix="cls-")  # short: a unix socket's path has at most 107 bytes
    monkeypatch.setenv("XDG_RUNTIME_DIR", runtime)
    socket = default_socket(str(fixed_model_dir), "auto")
    process = other_installation_engine(fixed_model_dir, socket)
    try:
        health = health_when_up(process, socket)
        status, checks = doctor(tmp_path, "--model", str(fixed_model_dir), XDG_RUNTIME_DIR=runtime)
    finally:
        process.kill()
        process.wait()
    ours = str(Path(__file__).resolve().parent.parent)
    assert (status, checks["resident engine"]) == (1, {
        "name": "resident engine", "status": "broken",
        "detail": f"the engine at {socket} is not this installation's: it belongs to another canvas-ls (installation "
                  f"'/opt/other-venv/canvas_ls', this server's '{ours}')",
        "fix": f"kill {health['pid']} (it belongs to another canvas-ls; it also exits after 30 idle minutes)",
    })  # fmt: skip


def test_a_corrupt_statistics_database(fixed_model_dir: Path, tmp_path: Path) -> None:
    database = tmp_path / "state" / "canvas-ls" / "stats.sqlite3"
    database.parent.mkdir(parents=True)
    database.write_bytes(b"not a database " * 100)
    status, checks = doctor(tmp_path, "--model", str(fixed_model_dir), XDG_STATE_HOME=str(tmp_path / "state"))
    assert (status, checks["statistics"]) == (1, {
        "name": "statistics", "status": "broken", "detail": f"{database} cannot be read (file is not a database)",
        "fix": "canvas-ls stats --clear (the language server also moves a corrupt one aside by itself)",
    })  # fmt: skip


def test_the_vs_code_extension_missing(fixed_model_dir: Path, tmp_path: Path) -> None:
    status, checks = doctor(tmp_path, "--model", str(fixed_model_dir), code="ms-python.python")
    assert (status, checks["vscode"]) == (1, {
        "name": "vscode", "status": "broken", "detail": f"{tmp_path / 'bin' / 'code'} has no canvas-ls extension",
        "fix": "code --install-extension canvas-ls.vsix (built by `npm run package` in editors/vscode)",
    })  # fmt: skip
