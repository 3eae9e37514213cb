"""Where a canvas-ls process may listen: the TCP addresses and socket paths the engine, `canvas-ls team serve` and
the language server refuse, and why. No torch here: a command checks its address before it imports the model's
libraries (seconds), so that a refusal is immediate."""

from __future__ import annotations

import ipaddress
import stat
from pathlib import Path


class ServeError(ValueError):
    """An address or socket the engine refuses to listen on; the message says why."""


def check_address(host: str, token: str | None, allow_remote: bool) -> None:
    """TCP needs a bearer token, and an IP address: a loopback one unless `allow_remote` (`check_host`)."""
    if not token:
        raise ServeError("TCP needs a bearer token (--token, --token-file or $CANVAS_LS_TOKEN)")
    check_host(host, allow_remote)


def check_host(host: str, allow_remote: bool) -> None:
    """An IP address to listen on: a loopback one unless `allow_remote` (a host name is refused, since what it
    resolves to can change under the listener)."""
    if not loopback(host) and not allow_remote:
        raise ServeError(f"{host} is not a loopback address; pass --allow-remote to listen on it")


def loopback(host: str) -> bool:
    """Whether `host` (an IP address, or "localhost") is a loopback address; a host name is refused."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        raise ServeError(f"'{host}' is not an IP address; give one, such as 127.0.0.1 or ::1") from None


def check_socket(path: Path) -> None:
    """A socket path may be new or an old socket (replaced); anything else there is refused, never deleted."""
    if path.is_symlink() or (path.exists() and not stat.S_ISSOCK(path.lstat().st_mode)):
        raise ServeError(f"{path} exists and is not a socket; remove it or choose another --socket")
