"""A LoRA adapter folder as bytes, to send to a team deployment: the language server packs a workspace's adapter
(`pack`), the deployment's gateway checks what it receives (`check`) and a replica unpacks it into a folder of its
own (`unpack`), named by its SHA-256 (`ADAPTER_PREFIX` + hex: what requests then name). No torch.

The archive is an uncompressed tar of the adapter's two files (peft's `adapter_config.json` and
`adapter_model.safetensors`), written the same way every time (sorted, no owner, no times), so that the same adapter
has the same digest on every machine. Nothing else is accepted in one: no folders, links or other names.
"""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
ADAPTER_PREFIX = "sha256:"
MAX_ADAPTER_BYTES = 512 << 20  # a rank-16 adapter of DiffusionGemma's attention and MLP is ~100 MB in bf16


class AdapterArchiveError(ValueError):
    """Bytes that are not an adapter archive; the message says why."""


def pack(folder: Path) -> bytes:
    """The adapter `folder`'s two files as a tar (the same bytes for the same files)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for name in ADAPTER_FILES:
            data = (folder / name).read_bytes()
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            archive.addfile(info, io.BytesIO(data))
    return out.getvalue()


def name_of(data: bytes) -> str:
    """What requests name an uploaded adapter by: `ADAPTER_PREFIX` and the archive's SHA-256."""
    return ADAPTER_PREFIX + hashlib.sha256(data).hexdigest()


def check(data: bytes) -> None:
    """AdapterArchiveError unless `data` is a tar of exactly the adapter's two files, as regular files."""
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as archive:
            members = archive.getmembers()
    except tarfile.TarError as exc:
        raise AdapterArchiveError(f"not a tar archive ({exc})") from None
    names = sorted(member.name for member in members)
    if names != sorted(ADAPTER_FILES) or not all(member.isfile() for member in members):
        raise AdapterArchiveError(f"an adapter archive holds {' and '.join(ADAPTER_FILES)} as files, not {names}")


def unpack(data: bytes, folder: Path) -> Path:
    """`data` (checked) written as the adapter folder `folder`; written beside it first, then renamed, so that a
    folder that exists is whole."""
    check(data)
    if folder.is_dir():
        return folder
    partial = folder.with_name(folder.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as archive:
        for name in ADAPTER_FILES:
            source = archive.extractfile(name)
            assert source is not None  # `check`: a regular file
            (partial / name).write_bytes(source.read())
    partial.rename(folder)
    return folder
