"""Which model a name means: the shipped default, a local folder holding a config, or a Hugging Face hub id the hub
can serve here. No torch: the CLI checks `--model` with it before it imports the model's libraries (seconds), so
that a mistyped folder or an unreachable hub is refused at once; `loading.load_model` checks with it too."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import ModelLoadError
from .paths import DEFAULT_MODEL_DIR


def model_source(name: str | None) -> tuple[Path | None, str]:
    """The model's folder (None for a hub id) and what transformers loads it from, or a ModelLoadError saying why
    `name` names no model here (None: the shipped default)."""
    if name is None:
        if not (DEFAULT_MODEL_DIR / "config.json").is_file():
            raise ModelLoadError(
                f"no model given and no default model is installed at {DEFAULT_MODEL_DIR}; pass --model PATH_OR_ID"
            )
        name = str(DEFAULT_MODEL_DIR)
    local = Path(name).expanduser()
    if local.exists():
        if not local.is_dir():
            raise ModelLoadError(f"model '{name}' is a file; give the folder that holds config.json")
        if not (local / "config.json").is_file():
            raise ModelLoadError(f"folder '{name}' holds no model (no config.json in it)")
        return local, str(local)
    if _looks_like_path(name):
        raise ModelLoadError(f"model folder '{name}' does not exist")
    unreachable = _hub_unreachable(name)
    if unreachable is not None:
        raise ModelLoadError(
            f"model '{name}' is not a local folder, not in the Hugging Face cache, and {unreachable}: download "
            "it where the hub can be reached and pass its folder (--model /path/to/it)"
        )
    return None, name


def _looks_like_path(name: str) -> bool:
    """A hub id is `name` or `org/name`; anything else that names no existing folder was meant as a path."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or (os.sep != "/" and os.sep in name)


def _hub_unreachable(name: str, timeout_s: float = 3.0) -> str | None:
    """Why the model hub cannot serve `name` here (None: it is cached, or the hub is reachable; or `name` is no hub
    id at all, which the hub client says itself): offline (HF_HUB_OFFLINE) and not cached, at once, or a connection
    tried for a few seconds, instead of the hub client's retries (~28 s) before it says the same."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants, try_to_load_from_cache

    try:
        cached = isinstance(try_to_load_from_cache(name, "config.json"), str)
    except ValueError:  # not a hub id at all: the hub client says so itself
        return None
    if cached:
        return None
    if constants.HF_HUB_OFFLINE:
        return "could not be fetched from the model hub, which HF_HUB_OFFLINE switches off"
    endpoint = urlparse(constants.ENDPOINT)
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((endpoint.hostname or "", port), timeout=timeout_s).close()
    except OSError as exc:
        return f"the hub ({constants.ENDPOINT}) cannot be reached from this machine ({exc})"
    return None
