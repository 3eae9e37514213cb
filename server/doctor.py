"""`canvas-ls doctor`: is this installation able to complete code, and if not, what fixes it.

Each check prints ok, a note (something optional is absent: no editor of that kind, no extra), or what is wrong and
the command that fixes it; the command exits 1 when something is broken. It reads and asks, never changes anything,
and contacts no network: Python and torch (version, device, the CPU's kernels), the model folder (its files, the
weights' size against free memory), the runtime folder (owner and mode), the resident engine on the model's socket
(which installation and version answers there), the grammars, the editor set-ups it can find (VS Code's extension
and its `canvasLs.command`, Neovim's plugin on the runtime path, Emacs's load-path), the statistics database and the
optional extras.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from ..engine.paths import DEFAULT_MODEL_DIR, default_socket, foreign_folder, installation, runtime_path

OK, NOTE, BROKEN = "ok", "note", "broken"
WEIGHTS = ("*.safetensors", "*.bin", "*.gguf")
MODEL_FILES = ("config.json", "tokenizer.json")
VSCODE_EXTENSION = "canvas-ls.canvas-ls"  # publisher.name in editors/vscode/package.json


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # OK, NOTE or BROKEN
    detail: str
    fix: str | None = None  # the command or change that fixes it (BROKEN), or that enables it (NOTE)


def run(model: str | None = None, device: str = "auto") -> list[Check]:
    """Every check, in the order a request meets them."""
    checks = [_python(), *_torch(device), _model(model, device), _runtime()]
    checks += [_engine(model, device), _grammars(), *_editors(), _statistics(), *_extras()]
    return checks


def report(checks: list[Check], as_json: bool = False) -> str:
    if as_json:
        return json.dumps({"ok": all(c.status != BROKEN for c in checks), "checks": [asdict(c) for c in checks]},
                          indent=2)  # fmt: skip
    marks = {OK: "ok  ", NOTE: "--  ", BROKEN: "FAIL"}
    lines = []
    for check in checks:
        lines.append(f"{marks[check.status]} {check.name:<16} {check.detail}")
        if check.fix:
            lines.append(f"{'':<22}fix: {check.fix}" if check.status == BROKEN else f"{'':<22}{check.fix}")
    broken = sum(c.status == BROKEN for c in checks)
    lines.append("" if not broken else f"\n{broken} problem{'s' * (broken != 1)} found")
    return "\n".join(lines).rstrip()


# -- the checks ------------------------------------------------------------------------------------------------


def _python() -> Check:
    version = ".".join(map(str, sys.version_info[:3]))
    where = installation()
    detail = f"Python {version} ({sys.executable}); canvas-ls {where['version']} from {where['installation']}"
    return Check("python", OK, detail)  # an older Python cannot install canvas-ls (requires-python)


def _torch(device: str) -> Iterator[Check]:
    try:
        import torch
    except Exception as exc:  # a broken install raises anything at import
        yield Check("torch", BROKEN, f"torch does not import: {type(exc).__name__}: {_line(exc)}",
                    f"{sys.executable} -m pip install --force-reinstall torch==2.13.0 (a CPU build; a CUDA build "
                    "from pytorch.org for a GPU)")  # fmt: skip
        return
    from ..engine.loading import cpu_has_native_bf16

    kernels = torch.backends.cpu.get_cpu_capability()
    bf16 = "native bf16 (the model runs in bf16)" if cpu_has_native_bf16() else "no native bf16 (fp32)"
    yield Check("torch", OK, f"torch {torch.__version__}; CPU kernels {kernels}, {bf16}; {os.cpu_count()} cores")
    if torch.cuda.is_available():
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        yield Check("gpu", OK, f"CUDA {torch.version.cuda}: {names}")
    elif device.startswith("cuda"):
        yield Check("gpu", BROKEN, "--device cuda, but this torch sees no CUDA GPU",
                    "use --device cpu or auto, or install a CUDA build of torch (pytorch.org)")  # fmt: skip
    else:
        yield Check("gpu", NOTE, "no CUDA GPU: the model runs on the CPU (the shipped model is sized for it)")


def _model(model: str | None, device: str) -> Check:
    name = model or str(DEFAULT_MODEL_DIR)
    folder = Path(name).expanduser()
    if model is not None and not folder.exists():
        if "/" in model and not model.startswith((".", "/", "~")):
            return Check("model", NOTE, f"{model} is a hub id: downloaded on first use, then from the cache")
        return Check("model", BROKEN, f"model folder {folder} does not exist", "give a model folder (--model DIR) "
                     "or leave it out for the shipped model")  # fmt: skip
    missing = [f for f in MODEL_FILES if not (folder / f).is_file()]
    weights = [p for pattern in WEIGHTS for p in folder.glob(pattern)]
    if missing or not weights:
        what = ", ".join(missing + ([] if weights else ["weights (*.safetensors)"]))
        fix = (
            f"{sys.executable} -m pip install --force-reinstall --no-deps canvas-ls (the shipped model's files)"
            if model is None
            else f"{folder} is not a whole model: copy it again, or train one (canvas-ls train)"
        )
        return Check("model", BROKEN, f"{folder} lacks {what}", fix)
    size = sum(p.stat().st_size for p in weights)
    free = _free_memory(device)
    detail = f"{folder}: {_gb(size)} of weights, {_gb(free)} free" if free else f"{folder}: {_gb(size)} of weights"
    if free and size > free:
        return Check("model", BROKEN, detail + ": it does not fit", "--quantize int8 (or int4 on a GPU) to hold it "
                     "in a half or a quarter of that, or a smaller model")  # fmt: skip
    return Check("model", OK, detail)


def _runtime() -> Check:
    folder = runtime_path()
    if not folder.exists():
        return Check("runtime folder", OK, f"{folder} (made 0700 when the first engine starts)")
    problem = foreign_folder(folder)
    if problem is not None:
        return Check("runtime folder", BROKEN, problem, f"sudo rm -r {folder}, or set XDG_RUNTIME_DIR to a folder "
                     "of your own")  # fmt: skip
    info = folder.lstat()
    if info.st_mode & 0o077:
        return Check("runtime folder", BROKEN, f"{folder} has mode {oct(info.st_mode & 0o777)}: others may reach the "
                     "engine's socket", f"chmod 700 {folder}")  # fmt: skip
    return Check("runtime folder", OK, f"{folder} (yours, 0700)")


def _engine(model: str | None, device: str) -> Check:
    from .backend import engine_health, engine_mismatch

    try:
        socket = default_socket(model, device)
    except OSError as exc:
        return Check("resident engine", BROKEN, f"no socket path: {_line(exc)}", "fix the runtime folder (above)")
    if not socket.exists():
        return Check("resident engine", OK, "none running for this model (the language server starts it)")
    health = engine_health(socket)
    if health is None:
        return Check("resident engine", OK, f"{socket.name}: nothing answers (a stale socket; replaced on start)")
    why = engine_mismatch(health, model, None)
    if why is not None:
        return Check("resident engine", BROKEN, f"the engine at {socket} is not this installation's: {why}",
                     f"kill {health.get('pid', '<its pid>')} (it belongs to another canvas-ls; it also exits after "
                     "30 idle minutes)")  # fmt: skip
    return Check("resident engine", OK, f"pid {health.get('pid')} answers: {health.get('model')} on "
                 f"{health.get('device')}, queue {health.get('queue')}")  # fmt: skip


def _grammars() -> Check:
    from .languages import GRAMMARS

    failed = []
    for grammar in GRAMMARS.values():
        try:
            getattr(importlib.import_module(grammar.module), grammar.function)()
        except Exception as exc:  # an import or ABI error
            failed.append(f"{grammar.name} ({grammar.module}: {_line(exc)})")
    if failed:
        modules = " ".join(sorted({f.split(" (")[1].split(":")[0].replace("_", "-") for f in failed}))
        return Check("grammars", BROKEN, "these languages cannot be parsed: " + "; ".join(failed),
                     f"{sys.executable} -m pip install --force-reinstall {modules}")  # fmt: skip
    return Check("grammars", OK, f"{len(GRAMMARS)} languages: {', '.join(GRAMMARS)}")


def _editors() -> list[Check]:
    """Each editor found, set up for canvas-ls or not. One not set up is a problem only when no editor is: someone who
    uses VS Code and has Neovim installed for other things is told how, not failed."""
    checks = [_vscode(), _neovim(), _emacs()]
    if any(check.status == OK for check in checks):
        return [Check(c.name, NOTE, c.detail, f"to use it there: {c.fix}") if c.status == BROKEN else c
                for c in checks]  # fmt: skip
    return checks


def _vscode() -> Check:
    code = shutil.which("code") or shutil.which("code-server")
    if code is None:
        return Check("vscode", NOTE, "no `code` on PATH (VS Code not installed here, or not on PATH)")
    listed = _output([code, "--list-extensions"])
    if listed is None:
        return Check("vscode", NOTE, f"{code} --list-extensions did not answer")
    if VSCODE_EXTENSION not in {line.strip().lower() for line in listed.splitlines()}:
        return Check("vscode", BROKEN, f"{code} has no canvas-ls extension", f"{Path(code).name} --install-extension "
                     "canvas-ls.vsix (built by `npm run package` in editors/vscode)")  # fmt: skip
    command = _vscode_command()
    if command and shutil.which(command[0]) is None:
        return Check("vscode", BROKEN, f"canvasLs.command {command} names {command[0]!r}, which is not on PATH",
                     f"set canvasLs.command to [\"{sys.executable}\", \"-m\", \"canvas_ls.server.cli\", \"serve\"] "
                     "or canvasLs.pythonPath")  # fmt: skip
    return Check("vscode", OK, "the canvas-ls extension is installed" + (f"; canvasLs.command {command}" if command
                                                                           else ""))  # fmt: skip


def _vscode_command() -> list[str] | None:
    for settings in (Path.home() / ".config/Code/User/settings.json", Path.home() / ".local/share/code-server/User"
                     "/settings.json"):  # fmt: skip
        try:
            command = json.loads(settings.read_text(encoding="utf-8")).get("canvasLs.command")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(command, list) and command and all(isinstance(part, str) for part in command):
            return command
    return None


def _neovim() -> Check:
    nvim = shutil.which("nvim")
    if nvim is None:
        return Check("neovim", NOTE, "no `nvim` on PATH")
    found = _output([nvim, "--headless", "+lua io.write(#vim.api.nvim_get_runtime_file('lua/canvas_ls/init.lua', "
                     "false))", "+qa!"])  # fmt: skip
    if found is None:
        return Check("neovim", NOTE, f"{nvim} did not answer")
    if found.strip() in ("", "0"):
        return Check("neovim", BROKEN, "the canvas_ls plugin is not on Neovim's runtime path",
                     f"add editors/neovim to it: vim.opt.rtp:append('{_repo_editor('neovim')}') in init.lua, or "
                     "your plugin manager")  # fmt: skip
    return Check("neovim", OK, "the canvas_ls plugin is on the runtime path")


def _emacs() -> Check:
    emacs = shutil.which("emacs")
    if emacs is None:
        return Check("emacs", NOTE, "no `emacs` on PATH")
    located = _output([emacs, "--batch", "-l", str(Path.home() / ".emacs.d/init.el"), "--eval",
                       "(princ (or (locate-library \"canvas-ls\") \"\"))"])  # fmt: skip
    if located is None:
        located = _output([emacs, "--batch", "--eval", '(princ (or (locate-library "canvas-ls") ""))'])
    if not (located or "").strip():
        return Check(
            "emacs",
            BROKEN,
            "canvas-ls.el is not on Emacs's load-path",
            f"(add-to-list 'load-path \"{_repo_editor('emacs')}\") (require 'canvas-ls) in init.el",
        )
    return Check("emacs", OK, f"canvas-ls.el at {located.strip().splitlines()[-1]}")


def _statistics() -> Check:
    import sqlite3

    from .acceptance import connect, default_path

    path = default_path()
    if not path.exists():
        return Check("statistics", OK, f"{path}: none recorded yet (`canvas-ls stats` once you have used it)")
    try:
        db = connect(path)
        try:
            count = db.execute("SELECT count(*) FROM events").fetchone()[0]
        finally:
            db.close()
    except sqlite3.DatabaseError as exc:
        return Check("statistics", BROKEN, f"{path} cannot be read ({_line(exc)})", "canvas-ls stats --clear (the "
                     "language server also moves a corrupt one aside by itself)")  # fmt: skip
    return Check("statistics", OK, f"{path}: {count:,} events (counts only, no code)")


def _extras() -> Iterator[Check]:
    for module, extra, use in (("torchao", "quantize", "--quantize int8/int4"), ("ray", "team", "canvas-ls team"),
                               ("matplotlib", "bench", "the benchmarks' plots")):  # fmt: skip
        if importlib.util.find_spec(module) is None:
            yield Check(f"extra {extra}", NOTE, f"not installed ({use})", f"pip install 'canvas-ls[{extra}]'")
        else:
            yield Check(f"extra {extra}", OK, f"installed ({use})")


# -- helpers -----------------------------------------------------------------------------------------------------


def _free_memory(device: str) -> int | None:
    """Bytes free where the model would load: the GPU's free memory when it runs there, else the system's
    MemAvailable."""
    if device != "cpu":
        try:
            import torch

            if torch.cuda.is_available():
                return int(torch.cuda.mem_get_info()[0])
        except Exception:  # no torch: the torch check says so
            pass
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _output(command: list[str], timeout: float = 20.0) -> str | None:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def _repo_editor(name: str) -> str:
    folder = Path(installation()["installation"]) / "editors" / name
    return str(folder) if folder.is_dir() else f"<canvas-ls checkout>/editors/{name}"


def _gb(size: int | None) -> str:
    return f"{(size or 0) / 2**30:,.1f} GiB" if (size or 0) >= 2**28 else f"{(size or 0) / 2**20:,.1f} MiB"


def _line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__
