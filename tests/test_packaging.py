"""The package as users install it: a wheel built from this checkout, installed into a fresh virtualenv outside it.

The wheel holds one import name of our own (`canvas_ls.engine`, `canvas_ls.server`: no top-level `engine` or
`server` to collide with other packages) and the default model; `canvas-ls complete` and `canvas-ls serve` run from
the virtualenv, outside the checkout, and find nothing of the checkout's. The virtualenv sees the system's packages
(torch and the rest are not downloaded again): what must come from the wheel is checked by path."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("packaging")
    source = folder / "source"  # the tracked files only: setuptools builds in the tree (build/, *.egg-info)
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for name in filter(None, tracked.decode().split("\0")):
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", str(source),
                    "--wheel-dir", str(folder / "dist")], check=True, cwd=folder, capture_output=True)  # fmt: skip
    (wheel,) = (folder / "dist").glob("canvas_ls-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert tops == {"canvas_ls", next(top for top in tops if top.endswith(".dist-info"))}
    assert "canvas_ls/engine/default_model/model.safetensors" in names
    env = folder / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(env)], check=True)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(env / "bin" / "python"), "install", "--quiet",
                    "--no-deps", str(wheel)], check=True, capture_output=True)  # fmt: skip
    return env


def test_the_wheel_installs_one_import_name_and_runs_outside_the_checkout(venv: Path, tmp_path: Path) -> None:
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import canvas_ls.engine as e, canvas_ls.server as s, importlib.util as u;"
         "print(e.__file__); print(s.__file__); print(u.find_spec('engine'), u.find_spec('server'))"],
        cwd=tmp_path, capture_output=True, text=True, check=True,
    ).stdout.split("\n")  # fmt: skip
    site = str(venv / "lib")
    assert where[0].startswith(site) and where[1].startswith(site)  # not the checkout's folders
    assert where[2] == "None None"  # no top-level `engine` or `server`

    source = tmp_path / "area.py"
    source.write_text("def area(width, height):\n    return \n")
    done = subprocess.run([str(venv / "bin" / "canvas-ls"), "complete", str(source), "--line", "1", "--character",
                           "11", "--json"], cwd=tmp_path, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["model"] == str(Path(where[0]).parent / "default_model")  # the model inside the installed wheel
    assert result["steps"] >= 1 and result["prefix_tokens"] > 0


def frame(message: dict) -> bytes:
    body = json.dumps(message).encode()
    return b"Content-Length: %d\r\n\r\n" % len(body) + body


def test_the_installed_server_answers_initialize(venv: Path, tmp_path: Path) -> None:
    messages = [
        {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"processId": None, "rootUri": None,
                                                                          "capabilities": {}}},
        {"jsonrpc": "2.0", "method": "initialized", "params": {}},
        {"jsonrpc": "2.0", "id": 2, "method": "shutdown"},
        {"jsonrpc": "2.0", "method": "exit"},
    ]  # fmt: skip
    done = subprocess.run([str(venv / "bin" / "canvas-ls"), "serve", "--log-level", "ERROR"], cwd=tmp_path,
                          input=b"".join(frame(m) for m in messages), capture_output=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    body = done.stdout.split(b"\r\n\r\n", 1)[1]
    first = json.JSONDecoder().raw_decode(body.decode())[0]
    assert first["id"] == 1 and first["result"]["serverInfo"]["name"] == "canvas-ls"
    assert "inlineCompletionProvider" in first["result"]["capabilities"]


def test_the_server_starts_without_torch_matplotlib_or_a_benchmark() -> None:
    """The language server answers before torch is imported (the backend loads the engine in its worker), and the
    keystroke path imports no benchmark module and no plotting library."""
    code = ("import sys, canvas_ls.server.lsp, canvas_ls.server.cli; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'matplotlib') "
            "or '.bench' in m))")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_runtime_install_pulls_no_matplotlib() -> None:
    """`pip install .` is the language server and the engine: the benchmarks' plotting library is an extra."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.lower().startswith("matplotlib")]
    assert project["optional-dependencies"]["bench"] == ["matplotlib>=3.8", "gguf>=0.19,<0.20"]
