"""Acceptance statistics, local only: what canvas-ls showed and what became of it, for `canvas-ls stats`.

One SQLite database (the standard library's sqlite3) under the user's state folder, never sent anywhere and never
holding code: per event its time, what happened (shown, accepted, partial, dismissed), the kind of suggestion, the
language, the workspace folder, the model, a length in characters, the latency and the suggestion's confidence
score with the model's own threshold for it (what `personal.py` learns the display threshold from; its thresholds
live in the same database). At most
`MAX_EVENTS` rows (the oldest go first). A database that is corrupt is moved aside and a new one started; one that
is locked or on a disk that refuses writes loses that event; either way the user is told once and completion goes
on.

How the server learns what became of a suggestion, per kind:
  completion  the inline completion item carries a command (`ACCEPTED_COMMAND`, the LSP 3.18 item's `command`,
              which the editor runs when the user accepts it, with the characters taken for a partial accept); one
              that the next request for the document finds neither accepted nor being typed through was dismissed
              (typed over, or the cursor went elsewhere), after a partial accept of the part it finds kept where
              it was shown, followed by the rest of the line that followed it then (VS Code runs no command on a
              partial accept: its accept next word / line are seen this way; a part ending inside a word, or
              followed by other text on its line, is not counted);
              characters counted by a partial accept are not counted again when the rest is accepted;
  next edit   the edit the next-edit key would accept (the first one shown): accepted when the next request for the
              document (a completion or a next edit) finds its new text there, followed by the text that followed
              the range it replaces; else dismissed;
  fill, rewrite
              applied by the user's command: kept when the next request finds the filled span (and what follows it)
              still there, dismissed when it was undone or typed over.
A document's close settles all of its suggestions by the same rules, on its last text.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from operator import itemgetter
from pathlib import Path
from typing import Any

from . import personal

log = logging.getLogger(__name__)
ACCEPTED_COMMAND = "canvas-ls.accepted"
MAX_EVENTS = 100_000
PRUNE_EVERY = 1_000  # inserts between two looks at the bound
EVENTS = ("shown", "accepted", "partial", "dismissed")
COMPLETION, NEXT_EDIT, FILL, REWRITE = "completion", "next edit", "fill", "rewrite"  # the kinds of suggestion
AFTER_CHARS = 20  # what follows an edit that must still follow it for the edit to count as kept
SCHEMA = """CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY, at REAL NOT NULL, event TEXT NOT NULL, kind TEXT NOT NULL, language TEXT NOT NULL,
    workspace TEXT NOT NULL, model TEXT NOT NULL, chars INTEGER NOT NULL, latency_ms REAL, shown_id INTEGER,
    score REAL, calibrated REAL)"""


# Requests asked, per day, kind, language, model and why nothing was shown ("": something was): the shown rate and
# the latency of every request, not only of those that showed something. Counted in memory, written every
# `FLUSH_EVERY` requests, at a document's close and when the server shuts down.
REQUESTS_SCHEMA = """CREATE TABLE IF NOT EXISTS requests (
    day TEXT NOT NULL, kind TEXT NOT NULL, language TEXT NOT NULL, model TEXT NOT NULL, why TEXT NOT NULL,
    count INTEGER NOT NULL, latency_ms REAL NOT NULL, PRIMARY KEY (day, kind, language, model, why))"""
UPSERT_REQUESTS = (
    "INSERT INTO requests VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (day, kind, language, model, why) "
    "DO UPDATE SET count = count + excluded.count, latency_ms = latency_ms + excluded.latency_ms"
)
FLUSH_EVERY = 50


def default_path() -> Path:
    """The user's state folder ($XDG_STATE_HOME, else ~/.local/state) / canvas-ls / stats.sqlite3."""
    base = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(base) / "canvas-ls" / "stats.sqlite3"


@dataclass
class Pending:
    """A suggestion shown in a document whose fate is not known yet."""

    shown_id: int
    offset: int  # where it was inserted
    text: str
    kind: str  # COMPLETION, NEXT_EDIT, FILL or REWRITE
    language: str
    workspace: str
    model: str
    score: float | None = None  # its confidence score (None: not judged)
    calibrated: float | None = None  # the model's own threshold for it (`personal.py` starts there)
    after: str = ""  # the text that followed it when shown (edits: held with it when kept)
    taken: int = 0  # characters already counted as taken by partial accepts (the accept command's)

    def held(self, text: str) -> bool:
        """Whether the document `text` holds it where it was shown (an edit: with what followed it; a completion
        accepted is often typed after at once)."""
        whole = self.text + (self.after if self.kind != COMPLETION else "")
        return text[self.offset : self.offset + len(whole)] == whole

    def kept(self, text: str) -> int:
        """The characters of a completion's start that the document `text` holds where it was shown, followed by
        the rest of the line that followed it then: a partial accept that ran no command (VS Code's accept next
        word or line) seen afterwards, the user gone on (a new line typed, the cursor elsewhere). 0 when none is
        kept, when other text was typed after the part on its line, or when the part ends inside one of the
        suggestion's words (its first letters typed by hand, then left)."""
        start = text[self.offset : self.offset + len(self.text)]
        common = next((i for i, (a, b) in enumerate(zip(start, self.text, strict=False)) if a != b), len(start))
        line = _line(self.after, 0)
        for k in range(min(common, len(self.text) - 1), 0, -1):
            if _line(text, self.offset + k) == line and not (_word(self.text[k - 1]) and _word(self.text[k])):
                return k
        return 0


def _line(text: str, start: int) -> str:
    """The rest of the line from `start`, at most `AFTER_CHARS` of it."""
    return text[start : start + AFTER_CHARS].partition("\n")[0]


def _word(char: str) -> bool:
    return char.isalnum() or char == "_"


class Recorder:
    """The server's side: records events, and keeps each document's last shown suggestion until its fate is known.
    Never raises: a database that fails is reported once through `notify` and recording stops or starts anew."""

    def __init__(self, path: Path | None = None, enabled: bool = True,
                 notify: Callable[[str], None] | None = None) -> None:  # fmt: skip
        self.path = path or default_path()
        self.enabled = enabled
        self.notify = notify or (lambda message: log.warning("%s", message))
        self.pending: dict[str, dict[str, Pending]] = {}  # uri -> kind -> its last shown suggestion of that kind
        self.on_settled: Callable[[Pending], None] | None = None  # told each accept or dismissal (`personal.py`)
        self._db: sqlite3.Connection | None = None
        self._inserts = 0
        self._said: set[str] = set()
        self._requests: dict[tuple[str, str, str, str, str], tuple[int, float]] = {}  # not yet written

    # -- what the server calls -------------------------------------------------------------------------------

    def shown(self, uri: str, offset: int, text: str, kind: str, language: str, workspace: str, model: str,
              latency_ms: float, score: float | None = None, calibrated: float | None = None,
              after: str = "") -> int | None:  # fmt: skip
        """A suggestion shown (with its confidence `score` and the model's own threshold for it, where judged; an
        edit with the text `after` it): its id (for the accept command), or None when nothing is recorded. The
        document's previous suggestion of the kind, if still unsettled, was dismissed."""
        previous = self.pending.get(uri, {}).pop(kind, None)
        if previous is not None:
            self._fate(previous, "dismissed", 0)
        shown_id = self._insert("shown", kind, language, workspace, model, len(text), latency_ms, score=score,
                                calibrated=calibrated)  # fmt: skip
        if shown_id is not None:
            self.pending.setdefault(uri, {})[kind] = Pending(shown_id, offset, text, kind, language, workspace, model,
                                                             score, calibrated, after[:AFTER_CHARS])  # fmt: skip
        return shown_id

    def requested(self, kind: str, language: str, model: str, why: str, latency_ms: float) -> None:
        """A request answered: `why` nothing was shown ("": something was), in `latency_ms`."""
        if not self.enabled:
            return
        key = (time.strftime("%Y-%m-%d"), kind, language, model, why)
        count, total = self._requests.get(key, (0, 0.0))
        self._requests[key] = (count + 1, total + latency_ms)
        if sum(count for count, _ in self._requests.values()) >= FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        """The requests counted since the last flush, written."""
        counted, self._requests = self._requests, {}
        db = self._open() if counted and self.enabled else None
        if db is None:
            return
        try:
            with db:
                db.executemany(UPSERT_REQUESTS, [(*key, count, total) for key, (count, total) in counted.items()])
        except sqlite3.DatabaseError as exc:
            self._failed(exc)

    def still_shown(self, uri: str) -> int | None:
        """The id of the completion the user is typing through in `uri` (its rest is shown again), if any."""
        pending = self.pending.get(uri, {}).get(COMPLETION)
        return None if pending is None else pending.shown_id

    def accepted(self, shown_id: int, chars: int | None = None) -> None:
        """The editor ran the accept command: the whole suggestion, or `chars` of it (a partial accept)."""
        for kinds in self.pending.values():
            for kind, pending in list(kinds.items()):
                if pending.shown_id == shown_id:
                    whole = chars is None or pending.taken + chars >= len(pending.text)
                    if whole:
                        del kinds[kind]
                        self._fate(pending, "accepted", len(pending.text) - pending.taken)
                    else:
                        taken = max(0, chars or 0)
                        pending.taken += taken
                        self._fate(pending, "partial", taken)
                    return

    def settle(self, uri: str, text: str | None, cursor: int | None = None) -> None:
        """The document's next request, at offset `cursor` (or its close: `text` None): each of its suggestions
        was dismissed unless the document now holds it where it was shown (accepted or kept; a completion typed
        through to its end) or, for a completion, the text from there to the cursor is a start of it (being typed
        through: still pending)."""
        for kind, pending in list(self.pending.get(uri, {}).items()):
            if text is not None and pending.held(text):
                self._fate(self.pending[uri].pop(kind), "accepted", len(pending.text) - pending.taken)
                continue
            typed = text[pending.offset : cursor] if text is not None and cursor is not None else ""
            if kind == COMPLETION and typed and pending.text.startswith(typed):
                continue
            kept = pending.kept(text) if kind == COMPLETION and text is not None else 0
            if kept > pending.taken:  # a part taken without the accept command (VS Code's accept next word/line)
                self._fate(pending, "partial", kept - pending.taken)
            self._fate(self.pending[uri].pop(kind), "dismissed", 0)
        if not self.pending.get(uri, True):
            del self.pending[uri]

    def _fate(self, pending: Pending, event: str, chars: int) -> None:
        """What became of a shown suggestion (accepted, partial, dismissed): recorded, and told to `on_settled`."""
        self._insert(event, pending.kind, pending.language, pending.workspace, pending.model, chars, None,
                     pending.shown_id)  # fmt: skip
        if self.on_settled is not None and pending.score is not None and self.enabled:
            self.on_settled(pending)

    def database(self) -> sqlite3.Connection | None:
        """The open database (None: recording is off or the database cannot be opened)."""
        return self._open() if self.enabled else None

    # -- the database ----------------------------------------------------------------------------------------

    def _insert(self, event: str, kind: str, language: str, workspace: str, model: str, chars: int,
                latency_ms: float | None, shown_id: int | None = None,
                score: float | None = None, calibrated: float | None = None) -> int | None:  # fmt: skip
        if not self.enabled:
            return None
        db = self._open()
        if db is None:
            return None
        try:
            with db:
                row = db.execute(
                    "INSERT INTO events (at, event, kind, language, workspace, model, chars, latency_ms,"
                    " shown_id, score, calibrated) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        time.time(),
                        event,
                        kind,
                        language,
                        workspace,
                        model,
                        chars,
                        latency_ms,
                        shown_id,
                        score,
                        calibrated,
                    ),
                )
            self._inserts += 1
            if self._inserts % PRUNE_EVERY == 0:
                prune(db, MAX_EVENTS)
            return row.lastrowid
        except sqlite3.DatabaseError as exc:
            self._failed(exc)
            return None

    def _open(self) -> sqlite3.Connection | None:
        if self._db is None:
            try:
                self._db = connect(self.path)
            except sqlite3.DatabaseError as exc:
                self._failed(exc)
        return self._db

    def _failed(self, exc: sqlite3.DatabaseError) -> None:
        """Locked, read-only, full: this event is lost (said once). Corrupt: moved aside, a new one next time."""
        if self._db is not None:
            self._db.close()
            self._db = None
        text = str(exc)
        if isinstance(exc, sqlite3.OperationalError) and ("locked" in text or "readonly" in text or "full" in text
                                                          or "unable to open" in text):  # fmt: skip
            self._say(f"canvas-ls: the statistics database {self.path} cannot be written ({text}); events are not "
                      "recorded meanwhile (completion goes on)")  # fmt: skip
            return
        aside = move_aside(self.path)
        self._say(f"canvas-ls: the statistics database was unreadable ({text}): moved to {aside}, a new one started")

    def _say(self, message: str) -> None:
        if message.split(" (")[0] not in self._said:
            self._said.add(message.split(" (")[0])
            self.notify(message)


def connect(path: Path) -> sqlite3.Connection:
    """The database at `path` (made 0600 in a 0700 folder), checked: raises sqlite3.DatabaseError when it is not one."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    new = not path.exists()
    db = sqlite3.connect(path, timeout=0.2)
    if new:
        os.chmod(path, 0o600)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")  # statistics: no fsync on the keystroke path
    db.execute(SCHEMA)
    columns = {row[1] for row in db.execute("PRAGMA table_info(events)")}
    for column in ("score", "calibrated"):  # a database from before scores were kept
        if column not in columns:
            db.execute(f"ALTER TABLE events ADD COLUMN {column} REAL")
    db.execute("CREATE INDEX IF NOT EXISTS events_shown_id ON events (shown_id)")
    db.execute(personal.SCHEMA)
    db.execute(REQUESTS_SCHEMA)
    db.execute("SELECT count(*) FROM events").fetchone()
    return db


def _files(path: Path) -> list[Path]:
    """The database's files: itself and its write-ahead log's two."""
    return [path.with_name(path.name + suffix) for suffix in ("", "-wal", "-shm")]


def move_aside(path: Path) -> Path:
    aside = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}")
    for source, target in zip(_files(path), _files(aside), strict=True):
        if source.exists():
            source.replace(target)
    return aside


def clear(path: Path) -> None:
    """Every recorded event gone (`canvas-ls stats --clear`)."""
    for file in _files(path):
        file.unlink(missing_ok=True)


def prune(db: sqlite3.Connection, keep: int) -> None:
    """At most `keep` events: the oldest go (a tenth more than needed, so that this runs rarely)."""
    count = db.execute("SELECT count(*) FROM events").fetchone()[0]
    if count > keep:
        with db:
            db.execute("DELETE FROM events WHERE id IN (SELECT id FROM events ORDER BY id LIMIT ?)",
                       (count - keep + keep // 10,))  # fmt: skip


class StatisticsCollector:
    """The statistics' counts for a Prometheus scrape: the resident engine's /metrics on the user's own socket
    (`canvas-ls engine`; never an engine that serves others over TCP). Read from the database at each scrape (read
    only, 0.2 s at most), by event, kind and language: counts and characters, never code. Gauges: the database is
    bounded, its oldest events go."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or default_path()

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        events = GaugeMetricFamily(
            "canvas_suggestions",
            "Suggestions in the local statistics database (canvas-ls stats), by event, kind and language",
            labels=["event", "kind", "language"],
        )
        chars = GaugeMetricFamily(
            "canvas_suggestion_chars_accepted",
            "Characters accepted (whole or in part), by kind and language",
            labels=["kind", "language"],
        )
        for event, kind, language, count, accepted in self._rows():
            events.add_metric([event, kind, language], count)
            if event in ("accepted", "partial"):
                chars.add_metric([kind, language], accepted)
        yield events
        yield chars

    def _rows(self) -> list[tuple[str, str, str, int, int]]:
        if not self.path.exists():
            return []
        try:
            db = sqlite3.connect(f"{self.path.as_uri()}?mode=ro", uri=True, timeout=0.2)
            try:
                return db.execute("SELECT event, kind, language, count(*), sum(chars) FROM events GROUP BY event, "
                                  "kind, language ORDER BY event, kind, language").fetchall()  # fmt: skip
            finally:
                db.close()
        except sqlite3.DatabaseError as exc:
            log.warning("the statistics database cannot be read for /metrics: %s", exc)
            return []


# -- canvas-ls stats -----------------------------------------------------------------------------------------------


def summary(path: Path, since_s: float | None = None) -> dict[str, Any]:
    """The statistics since `since_s` seconds ago (None: all): totals, by language, kind and model, and the display
    thresholds learned from them (`personal.py`): the current ones and every move."""
    if not path.exists():
        return {"path": str(path), "events": 0, "total": _rates({}), "by_language": {}, "by_kind": {}, "by_model": {},
                "thresholds": {"learned": [], "history": []}}  # fmt: skip
    db = connect(path)
    try:
        since = time.time() - since_s if since_s else 0.0
        rows = db.execute("SELECT event, kind, language, model, chars, latency_ms, at FROM events WHERE at >= ?",
                          (since,)).fetchall()  # fmt: skip
        asked = db.execute("SELECT day, kind, language, model, why, count, latency_ms FROM requests WHERE day >= ?",
                           (time.strftime("%Y-%m-%d", time.localtime(since)),)).fetchall()  # fmt: skip
        learned = personal.latest(db)
        history = [move for move in personal.history(db) if move["at"] >= since]
    finally:
        db.close()
    report: dict[str, Any] = {"path": str(path), "events": len(rows), "total": _rates(_count(rows), asked)}
    report["thresholds"] = {
        "learned": [{"language": language, "model": model, "start": start, "value": value}
                    for (language, model, start), value in sorted(learned.items())],
        "history": history,
    }  # fmt: skip
    report["days"] = _days(rows, asked)
    for name, column in (("by_language", 2), ("by_kind", 1), ("by_model", 3)):
        report[name] = _grouped(rows, asked, itemgetter(column), itemgetter(column))  # the same column in both
    return report


Row = tuple[Any, ...]


def _grouped(rows: list[Row], asked: list[Row], event_key: Callable[[Row], str],
             request_key: Callable[[Row], str]) -> dict[str, dict[str, Any]]:  # fmt: skip
    """The events `rows` and the requests `asked` grouped by their keys: each group's counts and rates."""
    events: dict[str, list[Row]] = {}
    for row in rows:
        events.setdefault(event_key(row), []).append(row)
    requests: dict[str, list[Row]] = {}
    for row in asked:
        requests.setdefault(request_key(row), []).append(row)
    return {key: _rates(_count(events.get(key, [])), requests.get(key, []))
            for key in sorted(events.keys() | requests.keys())}  # fmt: skip


def _days(rows: list[tuple[Any, ...]], asked: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
    """Per day (local time), oldest first: shown, accepted (whole or in part), the acceptance rate, the latency of
    what was shown (p50), and the requests, the share that showed something and their mean latency."""
    days = []
    for day, rates in _grouped(rows, asked, lambda row: time.strftime("%Y-%m-%d", time.localtime(row[6])),
                               lambda row: row[0]).items():  # fmt: skip
        days.append({"day": day, "shown": rates["shown"], "accepted": rates["accepted"] + rates["partial"],
                     **{key: rates[key] for key in ("acceptance_rate", "latency_p50_ms", "requests", "shown_rate",
                                                    "latency_mean_ms")}})  # fmt: skip
    return days


def _count(rows: list[tuple[Any, ...]]) -> dict[str, Any]:
    counts: dict[str, Any] = {event: 0 for event in EVENTS}
    latencies = sorted(row[5] for row in rows if row[0] == "shown" and row[5] is not None)
    for row in rows:
        counts[row[0]] += 1
    counts["chars_accepted"] = sum(row[4] for row in rows if row[0] in ("accepted", "partial"))
    counts["latency_p50_ms"] = latencies[len(latencies) // 2] if latencies else None
    return counts


def _rates(counts: dict[str, Any], asked: list[tuple[Any, ...]] | None = None) -> dict[str, Any]:
    """The counts with their rates, and of the requests `asked` (rows of the requests table): how many, the share
    that showed something, their mean latency."""
    counts = {**{event: 0 for event in EVENTS}, "chars_accepted": 0, "latency_p50_ms": None, **counts}
    shown = counts["shown"]
    counts["acceptance_rate"] = (counts["accepted"] + counts["partial"]) / shown if shown else None
    requests = sum(row[5] for row in asked or [])
    counts["requests"] = requests
    counts["shown_rate"] = sum(row[5] for row in asked or [] if row[4] == "") / requests if requests else None
    counts["latency_mean_ms"] = sum(row[6] for row in asked or []) / requests if requests else None
    return counts


def format_summary(report: dict[str, Any]) -> str:
    lines = [f"statistics: {report['path']} ({report['events']} events; local only, no code)", "",
             f"{'':<22}{'asked':>7}{'shown%':>7}{'shown':>7}{'accepted':>10}{'partial':>9}{'dismissed':>11}"
             f"{'rate':>7}{'chars':>8}{'p50 ms':>8}"]  # fmt: skip

    def line(name: str, row: dict[str, Any]) -> str:
        rate = f"{row['acceptance_rate']:.0%}" if row["acceptance_rate"] is not None else "-"
        shown_rate = f"{row['shown_rate']:.0%}" if row["shown_rate"] is not None else "-"
        p50 = f"{row['latency_p50_ms']:.0f}" if row["latency_p50_ms"] is not None else "-"
        return (f"{name[:22]:<22}{row['requests']:>7}{shown_rate:>7}{row['shown']:>7}{row['accepted']:>10}"
                f"{row['partial']:>9}{row['dismissed']:>11}{rate:>7}{row['chars_accepted']:>8}{p50:>8}")  # fmt: skip

    lines.append(line("all", report["total"]))
    for title, key in (("language", "by_language"), ("kind", "by_kind"), ("model", "by_model")):
        for name, row in report[key].items():
            lines.append(line(f"{title} {Path(name).name if key == 'by_model' else name}", row))
    learned = report["thresholds"]["learned"]
    if learned:
        lines += ["", "display thresholds learned from your accepts (the model's own -> yours):"]
        for row in learned:
            moves = sum(1 for move in report["thresholds"]["history"]
                        if (move["language"], move["model"], move["start"]) == (row["language"], row["model"],
                                                                                row["start"]))  # fmt: skip
            lines.append(f"  {row['language']:<12}{Path(row['model']).name:<24}{row['start']:.3f} -> "
                         f"{row['value']:.3f}  ({moves} moves)")  # fmt: skip
    return "\n".join(lines)


def plot_summary(report: dict[str, Any], out: Path) -> Path:
    """Shown suggestions and the acceptance rate per day, and the learned display thresholds over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (days, latency, thresholds) = plt.subplots(3, 1, figsize=(8, 9))
    names = [day["day"] for day in report["days"]]
    days.bar(names, [day["shown"] for day in report["days"]], color="lightgray", label="shown")
    days.set_ylabel("shown")
    rate = days.twinx()
    rate.plot(names, [day["acceptance_rate"] for day in report["days"]], marker="o", label="accepted / shown")
    rate.plot(names, [day["shown_rate"] for day in report["days"]], marker="s", label="shown / asked")
    rate.set_ylim(0, 1)
    rate.set_ylabel("share")
    rate.legend(fontsize=8)
    days.set_title("suggestions shown and accepted, per day")
    days.tick_params(axis="x", rotation=30)
    latency.plot(names, [day["latency_p50_ms"] for day in report["days"]], marker="o", label="shown (p50)")
    latency.plot(names, [day["latency_mean_ms"] for day in report["days"]], marker="s", label="every request (mean)")
    latency.set_ylabel("ms")
    latency.set_title("latency, per day")
    latency.legend(fontsize=8)
    latency.tick_params(axis="x", rotation=30)
    series: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for move in report["thresholds"]["history"]:
        if move["value"] is not None:
            series.setdefault((move["language"], Path(move["model"]).name), []).append(move)
    for (language, model), moves in series.items():
        when = [time.strftime("%m-%d %H:%M", time.localtime(move["at"])) for move in moves]
        values = [move["value"] for move in moves]
        thresholds.step(when, values, where="post", marker="o", label=f"{language} ({model})")
    thresholds.set_ylim(0, 1)
    thresholds.set_title("display threshold learned from your accepts")
    if series:
        thresholds.legend(fontsize=8)
    thresholds.tick_params(axis="x", rotation=30)
    figure.tight_layout()
    figure.savefig(out, dpi=100)
    plt.close(figure)
    return out
