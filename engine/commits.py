"""A repository's commits as edits: what next-edit training learns from and `bench edits` replays.

    git rev-list --first-parent (oldest first) -> per commit: its changed source files (git diff-tree)
    -> per file: the before and after texts -> hunks (difflib's line opcodes, in file order)

A commit is split into a held-out part (the newest `held_out` commits, which the benchmark replays and training
never sees) and a training part (the rest). Skipped, and counted by why: merge commits, renamed, added and deleted
files, binary-looking and huge files, files of languages the corpus does not hold. A folder with no git history is a
`ValueError` with a message for the user.

The recent edits are shown to the model the same way wherever it sees them (`recent_edits_comment`): comment lines
before the window, newest last, each `'old' -> 'new'`.
"""

from __future__ import annotations

import difflib
import shutil
import subprocess
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

COMMENT = {"python": "#", "lua": "--"}  # line-comment marks; the other languages': "//"
MAX_FILE_BYTES = 200_000  # a bigger file (generated, minified, data) is skipped
MAX_HUNK_CHARS = 4_000  # a file with a hunk over this (a rewrite, not an edit) is skipped
GIT_TIMEOUT_S = 60
RECENT_EDITS = 4  # the recent edits shown before a window: in training, and the server's default
COMPARE_BLOCK = 256  # characters compared at once by `differing`


def recent_edits_comment(language: str, edits: list[tuple[str, str]]) -> str:
    """The recent edits `(old, new)` as comment lines, newest last ("" for none): what the canvas is conditioned on,
    the same in training, in the benchmark and in the server."""
    if not edits:
        return ""
    mark = COMMENT.get(language, "//")
    lines = [f"{mark} recent edits, newest last:", *(f"{mark} {old!r} -> {new!r}" for old, new in edits)]
    return "\n".join(lines) + "\n"


def differing(old: str, new: str) -> tuple[int, int, int]:
    """(start, old_end, new_end): where `old` and `new` differ, between their common head and common tail. Compared
    a block at a time (C-level string equality), then a character at a time: a client that sends the whole text
    with each keystroke pays this on every change."""
    limit, old_len, new_len = min(len(old), len(new)), len(old), len(new)
    head = 0
    while head + COMPARE_BLOCK <= limit and old[head : head + COMPARE_BLOCK] == new[head : head + COMPARE_BLOCK]:
        head += COMPARE_BLOCK
    while head < limit and old[head] == new[head]:
        head += 1
    tail, room = 0, limit - head
    while tail + COMPARE_BLOCK <= room and (old[old_len - tail - COMPARE_BLOCK : old_len - tail]
                                            == new[new_len - tail - COMPARE_BLOCK : new_len - tail]):  # fmt: skip
        tail += COMPARE_BLOCK
    while tail < room and old[old_len - 1 - tail] == new[new_len - 1 - tail]:
        tail += 1
    return head, old_len - tail, new_len - tail


@dataclass(frozen=True)
class Hunk:
    """One changed run of lines: `before[start:end]` becomes `text`."""

    start: int
    end: int
    text: str

    def narrowed(self, before: str) -> Hunk:
        """The same change as a user types it: only the characters that differ (`count = 0` -> `amount = 0` is
        `c` -> `am`), what an editor sends and what the recent edits show."""
        old = before[self.start : self.end]
        head, old_end, new_end = differing(old, self.text)
        return Hunk(self.start + head, self.start + old_end, self.text[head:new_end])


@dataclass(frozen=True)
class FileChange:
    commit: str
    path: str
    language: str
    before: str
    after: str
    hunks: tuple[Hunk, ...]  # in file order; applying all of them to `before` gives `after`

    def applied(self, count: int) -> tuple[str, list[Hunk]]:
        """`before` with the first `count` hunks applied, and every hunk's place in that text (the applied ones as
        they now stand, the rest still to do)."""
        text, shift, placed = self.before, 0, []
        for number, hunk in enumerate(self.hunks):
            start, end = hunk.start + shift, hunk.end + shift
            if number < count:
                text = text[:start] + hunk.text + text[end:]
                shift += len(hunk.text) - (hunk.end - hunk.start)
                placed.append(Hunk(start, start + len(hunk.text), hunk.text))
            else:
                placed.append(Hunk(start, end, hunk.text))
        return text, placed


@dataclass
class Mined:
    changes: list[FileChange] = field(default_factory=list)
    commits: int = 0  # the commits read (merges included)
    skipped: Counter[str] = field(default_factory=Counter)


def hunks(before: str, after: str) -> tuple[Hunk, ...]:
    """The line hunks that turn `before` into `after`, in file order, as character offsets of `before`."""
    old, new = before.splitlines(keepends=True), after.splitlines(keepends=True)
    old_at = [0]
    for line in old:
        old_at.append(old_at[-1] + len(line))
    matcher = difflib.SequenceMatcher(None, old, new, autojunk=False)
    return tuple(Hunk(old_at[i1], old_at[i2], "".join(new[j1:j2]))
                 for tag, i1, i2, j1, j2 in matcher.get_opcodes() if tag != "equal")  # fmt: skip


def _git_bytes(repo: Path, *args: str) -> bytes:
    """What `git -C repo ARGS` writes; ValueError with git's message when it fails."""
    done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, timeout=GIT_TIMEOUT_S,
                          stdin=subprocess.DEVNULL)  # fmt: skip
    if done.returncode != 0:
        raise ValueError(f"git {' '.join(args[:2])} in {repo}: {done.stderr.decode(errors='replace').strip()}")
    return done.stdout


def _git(repo: Path, *args: str) -> str:
    return _git_bytes(repo, *args).decode("utf-8", errors="surrogateescape")


def history(repo: Path) -> list[tuple[str, list[str]]]:
    """(commit, parents) along the first-parent line of HEAD, oldest first."""
    if not _inside_work_tree(repo):
        raise ValueError(f"{repo} is not a git repository: next edits are mined from its commits")
    try:
        lines = _git(repo, "rev-list", "--first-parent", "--parents", "--reverse", "HEAD").splitlines()
    except ValueError:
        raise ValueError(f"{repo} has no commits: next edits are mined from its history") from None
    return [(commit, parents) for commit, *parents in (line.split() for line in lines if line.strip())]


def _inside_work_tree(repo: Path) -> bool:
    try:
        return _git(repo, "rev-parse", "--is-inside-work-tree").strip() == "true"
    except (ValueError, OSError):
        return False


def split(commits: list[tuple[str, list[str]]], held_out: int) -> tuple[list, list]:
    """(training, held-out): the newest `held_out` commits held out (at least one left to train on when any)."""
    cut = max(len(commits) - held_out, min(1, len(commits) - 1), 0)
    return commits[:cut], commits[cut:]


def mine(repo: Path, commits: list[tuple[str, list[str]]]) -> Mined:
    """Each commit's changed source files, with their hunks; what cannot be an edit skipped and counted."""
    mined = Mined()
    for commit, parents in commits:
        mined.commits += 1
        if len(parents) != 1:
            mined.skipped["merge commit" if parents else "root commit"] += 1
            continue
        raw = _git(repo, "diff-tree", "-r", "-M", "--no-commit-id", "--raw", "-z", parents[0], commit)
        fields = raw.split("\0")
        at = 0
        while at < len(fields) - 1:
            meta = fields[at].split()
            status = meta[4] if len(meta) == 5 else "?"
            paths = fields[at + 1 : at + (3 if status[:1] in "RC" else 2)]
            at += 1 + len(paths)
            change = _file_change(repo, commit, meta, status, paths, mined.skipped)
            if change is not None:
                mined.changes.append(change)
    return mined


def _file_change(repo: Path, commit: str, meta: list[str], status: str, paths: list[str],
                 skipped: Counter[str]) -> FileChange | None:  # fmt: skip
    from .corpus import EXTENSIONS  # here: the server imports this module for `differing` alone

    language = EXTENSIONS.get(Path(paths[-1]).suffix)
    if status[:1] in "RC":
        skipped["renamed or copied file"] += 1
    elif status in ("A", "D"):
        skipped["added or deleted file"] += 1
    elif status != "M" or language is None:
        skipped["not a source file of a known language"] += 1
    else:
        before, after = _blob(repo, meta[2]), _blob(repo, meta[3])
        if before is None or after is None:
            skipped["binary or huge file"] += 1
            return None
        found = hunks(before, after)
        if any(h.end - h.start > MAX_HUNK_CHARS or len(h.text) > MAX_HUNK_CHARS for h in found):
            skipped["hunk over its size cap"] += 1
            return None
        if found:
            return FileChange(commit, paths[-1], language, before, after, found)
    return None


def _blob(repo: Path, sha: str) -> str | None:
    """The text of a blob; None when it is huge or does not read as text."""
    if int(_git(repo, "cat-file", "-s", sha)) > MAX_FILE_BYTES:
        return None
    data = _git_bytes(repo, "cat-file", "blob", sha)
    if b"\0" in data[:8000]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


@dataclass(frozen=True)
class EditText:
    """One next-edit training example in text: after the `recent` edits, the changed lines `old` (as they stand
    between `head` and `tail`) become `new`; `old == new` for a window the model must leave alone."""

    language: str
    recent: tuple[tuple[str, str], ...]  # (old, new) as typed, newest last
    head: str
    old: str
    new: str
    tail: str

    @property
    def prompt(self) -> str:
        """What the model reads before the lines, as the server writes it (`recent_edits_comment` first)."""
        return recent_edits_comment(self.language, list(self.recent)) + self.head


def edit_texts(changes: list[FileChange], history_edits: int = RECENT_EDITS) -> list[EditText]:
    """Per file change: each hunk after the ones before it (the earlier hunks, as typed, are the recent edits), and
    one unchanged line away from every hunk after all of them (a no-op)."""
    found: list[EditText] = []
    for change in changes:
        typed: list[tuple[str, str]] = []
        for number in range(len(change.hunks)):
            text, placed = change.applied(number)
            at = placed[number]
            start = text.rfind("\n", 0, at.start) + 1
            end = at.end if at.end > at.start and text[at.end - 1] == "\n" else _line_end(text, at.end)
            new = text[start : at.start] + at.text + text[at.end : end]
            found.append(EditText(change.language, tuple(typed[-history_edits:]), text[:start], text[start:end],
                                  new, text[end:]))  # fmt: skip
            narrow = at.narrowed(text)
            typed.append((text[narrow.start : narrow.end], narrow.text))
        text, placed = change.applied(len(change.hunks))
        quiet = farthest_line(text, placed)
        if quiet is not None:
            end = _line_end(text, quiet)
            found.append(EditText(change.language, tuple(typed[-history_edits:]), text[:quiet], text[quiet:end],
                                  text[quiet:end], text[end:]))  # fmt: skip
    return found


def training_edits(repository: Path, held_out: int, tree: Path) -> tuple[list[EditText], dict[str, object]]:
    """The repository's older commits as next-edit examples (the newest `held_out` left for `bench edits`), and what
    was mined and skipped. With commits held out, the files as they were at the last training commit are written
    under `tree` (`tree_at` in the report): the corpus to train on, so that no held-out commit's result is seen.
    ValueError for a folder with no history."""
    training, held = split(history(repository), held_out)
    mined = mine(repository, training)
    texts = edit_texts(mined.changes)
    at = training[-1][0] if held and training else None
    if at is not None:
        tree_at(repository, at, tree)
    return texts, {"commits": mined.commits, "held_out_commits": len(held), "file_changes": len(mined.changes),
                   "examples": len(texts), "no_ops": sum(t.old == t.new for t in texts),
                   "skipped": dict(mined.skipped), "tree_at": at}  # fmt: skip


def tree_at(repository: Path, commit: str, dest: Path) -> Path:
    """The repository's files at `commit`, written afresh under `dest` (`git archive`)."""
    import io
    import tarfile

    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    archive = _git_bytes(repository, "archive", "--format=tar", commit)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    return dest


def _line_end(text: str, offset: int) -> int:
    """The offset after the newline that ends the line of `offset` (the text's end on its last line)."""
    end = text.find("\n", offset)
    return len(text) if end < 0 else end + 1


def farthest_line(text: str, placed: list[Hunk], at_least: int = 4) -> int | None:
    """The start of the non-blank line farthest from every hunk, when more than `at_least` lines from all."""
    starts = [0] + [i + 1 for i, char in enumerate(text) if char == "\n" and i + 1 < len(text)]
    lines = [(text.count("\n", 0, h.start), text.count("\n", 0, max(h.start, h.end - 1))) for h in placed]
    best, distance = None, at_least
    for number, start in enumerate(starts):
        gap = min(max(first - number, number - last, 0) for first, last in lines)
        if gap > distance and text[start : _line_end(text, start)].strip():
            best, distance = start, gap
    return best
