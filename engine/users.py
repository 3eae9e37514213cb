"""A team deployment's users (`canvas-ls team`): who may ask, and how often.

The token file holds one user per line, `NAME sha256:HEX`: the SHA-256 of the user's bearer token, never the token
(tokens are 32 random bytes, so a plain digest is enough; the file leaks no token). `canvas-ls team token add NAME`
writes a line and prints the token once. The file is read again when it changes, so a revoked token is refused
within a second (and a new one is let in at once). A token is checked against every line in constant time
(`hmac.compare_digest`, no early exit): the time of a refusal says nothing of which user or how much of a guess was
right.

Each user's requests pass a token bucket (`RateLimit`): `rate` requests a second on average, bursts of `burst`; a
request over it is answered 429 with the seconds until the bucket holds a request again (Retry-After).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import math
import os
import re
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["RateLimit", "TokenFile", "TokenFileError", "add_user", "revoke_user"]

NAME = re.compile(r"[A-Za-z0-9_.@-]{1,64}")
RELOAD_S = 1.0  # how often the file's modification time is looked at


class TokenFileError(ValueError):
    """A token file that cannot be read or a user name it cannot hold; the message says which line or why."""


def digest(token: str) -> str:
    return "sha256:" + hashlib.sha256(token.encode()).hexdigest()


def _parse(path: Path) -> dict[str, str]:
    users: dict[str, str] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, hashed = line.partition(" ")
        hashed = hashed.strip()
        if not NAME.fullmatch(name) or not re.fullmatch(r"sha256:[0-9a-f]{64}", hashed):
            raise TokenFileError(f"{path}:{number}: expected 'NAME sha256:HEX' (from `canvas-ls team token add`)")
        users[name] = hashed
    return users


@dataclass
class TokenFile:
    """The users of a token file, re-read when the file changes (at most once per `RELOAD_S`)."""

    path: Path
    users: dict[str, str] = field(default_factory=dict)
    _stamp: tuple[int, int] | None = None
    _looked: float = -math.inf

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        self.refresh(force=True)

    def refresh(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._looked < RELOAD_S:
            return
        self._looked = now
        try:
            stat = self.path.stat()
        except OSError as exc:
            raise TokenFileError(f"cannot read the token file {self.path}: {exc.strerror}") from None
        stamp = (stat.st_mtime_ns, stat.st_size)
        if stamp != self._stamp:
            self.users, self._stamp = _parse(self.path), stamp

    def user(self, authorization: str | None) -> str | None:
        """The user whose token `authorization` ("Bearer TOKEN") carries, or None (missing, wrong or revoked). A
        token that matches nobody has the file looked at again at once (a user just added is let in)."""
        found = self._match(authorization, force=False)
        return found if found is not None else self._match(authorization, force=True)

    def _match(self, authorization: str | None, force: bool) -> str | None:
        with contextlib.suppress(TokenFileError, OSError):  # a file being rewritten: the last users read stay
            self.refresh(force)
        scheme, _, token = (authorization or "").partition(" ")
        given = digest(token.strip()) if scheme.lower() == "bearer" and token.strip() else "sha256:"
        found = None
        for name, hashed in self.users.items():  # every line compared, whatever matched: constant time
            if hmac.compare_digest(given.encode(), hashed.encode()):
                found = name
        return found


def add_user(path: Path, name: str) -> str:
    """Add `name` with a new token to the file (created 0600) and return the token; refused if the name is taken."""
    if not NAME.fullmatch(name):
        raise TokenFileError(f"a user name is 1-64 letters, digits or . _ @ -, got {name!r}")
    users = _parse(path) if path.exists() else {}
    if name in users:
        raise TokenFileError(f"{name} is already in {path}; revoke it first to give a new token")
    token = "cls_" + secrets.token_urlsafe(32)
    users[name] = digest(token)
    _write(path, users)
    return token


def revoke_user(path: Path, name: str) -> None:
    users = _parse(path) if path.exists() else {}
    if users.pop(name, None) is None:
        raise TokenFileError(f"no user {name!r} in {path}")
    _write(path, users)


def _write(path: Path, users: dict[str, str]) -> None:
    """Write the file whole and rename it into place (a server reading it never sees half a file), mode 0600."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    text = "# canvas-ls team users: NAME sha256:DIGEST of the token (`canvas-ls team token add|revoke`)\n"
    text += "".join(f"{name} {hashed}\n" for name, hashed in sorted(users.items()))
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as sink:
        sink.write(text)
    os.replace(temporary, path)


@dataclass
class RateLimit:
    """A token bucket per user: `rate` requests a second, bursts of `burst`. `take(user)` is 0.0 when the request
    may go, else the seconds until it could (the 429's Retry-After)."""

    rate: float
    burst: int
    buckets: dict[str, tuple[float, float]] = field(default_factory=dict)  # user -> (tokens, when counted)

    def take(self, user: str, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        tokens, then = self.buckets.get(user, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - then) * self.rate)
        if tokens >= 1.0:
            self.buckets[user] = (tokens - 1.0, now)
            return 0.0
        self.buckets[user] = (tokens, now)
        return (1.0 - tokens) / self.rate
