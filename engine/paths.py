"""Where canvas-ls keeps things on this machine: the user's cache (runs, reports, workspace models) and a private
runtime folder with the resident engine's socket, lock and log; and how its background processes yield the CPU."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import stat
from pathlib import Path
from urllib.parse import unquote, urlparse

# The model a user gets when they name none: trained by `canvas-ls train`, shipped inside the package.
DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "default_model"
# A resident engine exits after this many seconds without requests (`canvas-ls engine --idle-exit`,
# `engine.idle_exit_s`).
IDLE_EXIT_S = 1800.0
# The HTTP status of a request the engine dropped (its client went away, a newer request superseded it, a real
# request preempted a background one): not an error, "cancelled".
CANCELLED_STATUS = 499
# The engine's HTTP API (its endpoints, their fields and the result's shape): /health names it, and a language server
# sends requests only to an engine of the API version it speaks (a team deployment of another version gets none).
API_VERSION = 1
API_HEADER = "x-canvas-api"  # every answer of the engine carries its API version in this header
# The resident engine's defaults: requests sharing one decoder forward, the largest request body (a 1k-token prefix
# is ~4 KB: this only stops abuse and accidents), and the prefix KV cache's bound in MB.
MAX_BATCH = 8
MAX_BODY_BYTES = 4 << 20
PREFIX_CACHE_MB = 256


def cache_dir() -> Path:
    """The user's cache folder for canvas-ls: training runs, benchmark reports, workspace models."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "canvas-ls"


def runtime_path() -> Path:
    """Where the user's private runtime folder is (`runtime_dir` makes it)."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    return Path(base) / "canvas-ls" if base else Path("/tmp") / f"canvas-ls-{os.getuid()}"


def runtime_dir() -> Path:
    """The user's private folder for the socket, the lock file and the engine log (created 0700). One that another
    user owns (made ahead in /tmp to catch the socket) or that is a link is refused, never used."""
    folder = runtime_path()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    problem = foreign_folder(folder)
    if problem is not None:
        raise PermissionError(f"{problem} (`canvas-ls doctor` says how to fix it)")
    os.chmod(folder, 0o700)
    return folder


def foreign_folder(folder: Path) -> str | None:
    """Why `folder` cannot be this user's private folder (a link or a file, or another user's), or None."""
    info = folder.lstat()
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        return f"{folder} is not a folder (a link or a file)"
    if info.st_uid != os.getuid():
        return (f"{folder} belongs to uid {info.st_uid}, not to you ({os.getuid()}): another user could read or "
                "replace the engine's socket")  # fmt: skip
    return None


def default_socket(model: str | None = None, device: str | None = None, adapter: str | None = None,
                   quantize: str | None = None) -> Path:  # fmt: skip
    """One engine per installation, model, device, adapter and quantisation: an editor configured for another model,
    or a server of another canvas-ls installation (another virtualenv, another version), never reaches it."""
    device = None if device in (None, "auto") else device
    quantize = None if quantize in (None, "auto") else quantize
    key = "\0".join((*installation().values(), resolved_model(model), str(device)))
    key += f"\0{Path(adapter).expanduser().resolve()}" if adapter else ""
    key += f"\0quantize={quantize}" if quantize else ""
    digest = hashlib.sha1(key.encode()).hexdigest()[:12]
    return runtime_dir() / f"engine-{digest}.sock"


@functools.cache
def installation() -> dict[str, str]:
    """Which canvas-ls this is: the folder its code runs from and its version. A server takes answers only from an
    engine of the same installation (`server/backend.py:ResidentBackend`)."""
    from importlib import metadata

    try:
        version = metadata.version("canvas-ls")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return {"installation": str(Path(__file__).resolve().parent.parent), "version": version}


@functools.lru_cache(maxsize=64)
def resolved_model(model: str | None) -> str:
    """A model as the engine loads it: the shipped default's folder for None, a folder's resolved path, else the
    name as given (a hub id). Resolved once per name: the language server resolves its configured model and each
    workspace model's base when it reads them (`workspaces.same_base`), so that a request touches no file."""
    if model is None:
        return str(DEFAULT_MODEL_DIR)
    folder = Path(model).expanduser()
    return str(folder.resolve()) if folder.exists() else model


def fingerprint(folder: Path | str | None) -> str:
    """What a model (or adapter) folder holds, as it holds it now: a digest of its files' names, sizes and
    modification times (not their bytes: taken at every load, in microseconds). "" for no folder (a hub id)."""
    if folder is None or not Path(folder).is_dir():
        return ""
    digest = hashlib.sha1()
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if entry.is_file():
            stat = entry.stat()
            digest.update(f"{entry.name}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def lowest_priority() -> None:
    """SCHED_IDLE for this process and the threads it starts (torch's come later): it runs only on a core nothing
    else wants. Where the platform has no SCHED_IDLE, the lowest nice value."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)


def die_with_parent(signal_number: int) -> None:
    """Linux: this process gets `signal_number` when the process that started it dies (PR_SET_PDEATHSIG); elsewhere
    nothing."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal_number)  # PR_SET_PDEATHSIG


def file_path(uri: str) -> str | None:
    """The path a `file:` URI names (percent-decoded, not resolved); None for any other scheme."""
    parsed = urlparse(uri)
    return unquote(parsed.path) if parsed.scheme == "file" else None


def document_repository(document: object) -> str | None:
    """The repository a document (a `file:` URI or a path) belongs to: the nearest folder above it holding `.git`
    (looked up once per folder, on the request path: no `git` process, unlike `workspaces.repository_root`); None
    for other documents (unsaved buffers, other schemes, files outside any repository)."""
    if not isinstance(document, str) or not document:
        return None
    if document.startswith("file:"):
        path = file_path(document) or ""
    elif "://" in document or document.startswith("untitled:"):
        return None
    else:
        path = document
    return _root_above(os.path.dirname(os.path.abspath(path)))


@functools.lru_cache(maxsize=1024)
def _root_above(folder: str) -> str | None:
    current = Path(folder)
    for candidate in (current, *current.parents):
        if (candidate / ".git").exists():
            return str(candidate)
    return None
