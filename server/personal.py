"""Personal calibration: the display threshold learned from the user's own accepts and dismissals.

A model's calibrated threshold (its `canvas_ls.json`, written by `canvas-ls bench calibrate` on benchmark data) is
where each language starts. Every inline suggestion shown is recorded with its confidence score, and what became
of it (accepted whole or in part, or dismissed) by the statistics (`acceptance.py`); an invoked one is shown whatever
its score, so those below the threshold tell what a lower one would show. Per language and model, once `MIN_SHOWN`
suggestions are settled (and again after each `EVERY` more), the threshold moves toward the lowest one at which the
share of shown suggestions the user accepted meets the target (`completion.acceptance_target`, 30%):

  - below the target: up to the lowest score above the current threshold from which on, in the recent suggestions
    (`WINDOW`), enough were accepted (at least `SUPPORT` of them counted), else one `STEP` up;
  - at or above it: down to the lowest score below the current threshold that still meets the target with at least
    `SUPPORT` suggestions between the two (invoked suggestions are the evidence there), else, when the share is
    `MARGIN` above the target, one `STEP` down: showing more is the only way to learn what the threshold hides;
  - each move half way (`SMOOTH`) and at most one `STEP`, within `RANGE` of where it started.

The thresholds are kept beside the events (table `thresholds`): they survive a restart, `canvas-ls stats` shows them
over time, `canvas-ls stats --reset-threshold` (or the `canvas-ls.resetThreshold` command) starts again from the
model's own, and `completion.personal_threshold: false` turns the learning off. The user's own
`completion.min_confidence`, where set, overrides all of it. On the keystroke path the threshold is read from
memory; the database is read when the thresholds load and when one moves.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)
RESET_THRESHOLD_COMMAND = "canvas-ls.resetThreshold"
MIN_SHOWN = 30  # settled suggestions at or above the threshold before it moves
EVERY = 10  # settled suggestions between two looks
WINDOW = 200  # the most recent settled suggestions a look weighs
SUPPORT = 10  # suggestions a candidate threshold must keep to be trusted
STEP = 0.05
SMOOTH = 0.5
RANGE = 0.3
MARGIN = 0.1
SCHEMA = """CREATE TABLE IF NOT EXISTS thresholds (
    id INTEGER PRIMARY KEY, at REAL NOT NULL, language TEXT NOT NULL, model TEXT NOT NULL, start REAL NOT NULL,
    value REAL, rate REAL, samples INTEGER NOT NULL)"""


def accepted_share(samples: list[tuple[float, bool]], threshold: float) -> tuple[float | None, int]:
    """Of the `samples` (score, accepted?) a `threshold` would show: the share accepted (None: none shown), and
    how many."""
    kept = [taken for score, taken in samples if score >= threshold]
    return (sum(kept) / len(kept) if kept else None), len(kept)


def proposal(samples: list[tuple[float, bool]], current: float, target: float) -> float:
    """Where the threshold should go, from `samples` (score, accepted?) of settled suggestions (see the module)."""

    def rate(threshold: float) -> tuple[float, int]:
        share, count = accepted_share(samples, threshold)
        return share or 0.0, count

    share, count = rate(current)
    if count < MIN_SHOWN:
        return current
    if share < target:
        for candidate in sorted({score for score, _ in samples if score > current}):
            candidate_share, kept = rate(candidate)
            if kept < SUPPORT:
                break
            if candidate_share >= target:
                return candidate
        return current + STEP
    lowest = current
    for candidate in sorted({score for score, _ in samples if score < current}, reverse=True):
        if rate(candidate)[0] < target:
            break
        if sum(candidate <= score < current for score, _ in samples) >= SUPPORT:  # enough evidence below
            lowest = candidate
    if lowest < current:
        return lowest
    return current - STEP if share >= target + MARGIN else current


def moved(current: float, start: float, toward: float) -> float:
    """One move from `current` toward `toward`: half way, at most `STEP`, within `RANGE` of `start` and [0, 1]."""
    step = max(-STEP, min(STEP, (toward - current) * SMOOTH))
    return round(max(max(0.0, start - RANGE), min(min(1.0, start + RANGE), current + step)), 4)


class Thresholds:
    """The learned thresholds of one server: `threshold` for the display decision, `settled` from the statistics."""

    def __init__(self, connect: Callable[[], sqlite3.Connection | None], target: float = 0.3,
                 enabled: bool = True) -> None:  # fmt: skip
        self.connect = connect  # the statistics' database (None: unavailable)
        self.target, self.enabled = target, enabled
        # (language, model, the model's own threshold) -> the learned one: a model's single-line and multi-line
        # thresholds are learned apart, and a recalibrated model starts again
        self.learned: dict[tuple[str, str, float], float] | None = None
        self.counts: dict[tuple[str, str, float], int] = {}  # settled since the last look

    def threshold(self, language: str, model: str, start: float) -> float:
        """The threshold to show `model`'s typing suggestions in `language` at, where the model's own is `start`:
        the one learned for it, else `start`."""
        if not self.enabled:
            return start
        return self._loaded().get((language, model, start), start)

    def settled(self, language: str, model: str, start: float | None) -> None:
        """A suggestion with a score was accepted or dismissed: every `EVERY` of them, the threshold is looked at."""
        if not self.enabled or start is None:
            return
        key = (language, model, start)
        self.counts[key] = self.counts.get(key, 0) + 1
        if self.counts[key] % EVERY == 0:
            self.look(language, model, start)

    def look(self, language: str, model: str, start: float) -> float | None:
        """Move `language`/`model`'s threshold as the recent settled suggestions say; the new value (None: the
        database is unavailable)."""
        db = self.connect()
        if db is None:
            return None
        try:
            since = reset_at(db)  # only events after the last reset count
            self.learned = latest(db)  # as recorded, a reset made meanwhile (`canvas-ls stats`) included
            current = self.learned.get((language, model, start), start)
            rows = db.execute(
                "SELECT s.score, EXISTS (SELECT 1 FROM events a WHERE a.shown_id = s.id AND a.event IN"
                " ('accepted', 'partial')) FROM events s WHERE s.event = 'shown' AND s.language = ? AND s.model = ?"
                " AND s.calibrated = ? AND s.score IS NOT NULL AND s.at > ?"
                " AND EXISTS (SELECT 1 FROM events f WHERE f.shown_id = s.id) ORDER BY s.id DESC LIMIT ?",
                (language, model, start, since, WINDOW),
            ).fetchall()
            samples = [(score, bool(taken)) for score, taken in rows]
            value = moved(current, start, proposal(samples, current, self.target))
            if value != current:
                share = accepted_share(samples, current)[0]  # accepted of those the old threshold showed
                with db:
                    db.execute("INSERT INTO thresholds (at, language, model, start, value, rate, samples)"
                               " VALUES (?, ?, ?, ?, ?, ?, ?)",
                               (time.time(), language, model, start, value, share, len(samples)))  # fmt: skip
                log.info("display threshold for %s (%s): %.3f -> %.3f", language, model, current, value)
        except sqlite3.DatabaseError as exc:  # the statistics say it once; the threshold stays
            log.warning("personal threshold: %s", exc)
            return None
        self._loaded()[(language, model, start)] = value
        return value

    def reset(self) -> None:
        """Every language and model starts again from its model's threshold (the events so far no longer count)."""
        self.learned = {}
        self.counts.clear()
        db = self.connect()
        if db is not None:
            reset(db)

    def _loaded(self) -> dict[tuple[str, str, float], float]:
        if self.learned is None:
            self.learned = {}
            db = self.connect()
            if db is not None:
                try:
                    self.learned = latest(db)
                except sqlite3.DatabaseError as exc:
                    log.warning("personal threshold: %s", exc)
        return self.learned


def reset_at(db: sqlite3.Connection) -> float:
    """When the thresholds were last reset (0: never)."""
    return db.execute("SELECT max(at) FROM thresholds WHERE value IS NULL").fetchone()[0] or 0.0


def latest(db: sqlite3.Connection) -> dict[tuple[str, str, float], float]:
    """Each language, model and model's own threshold's learned one, as last recorded since the last reset."""
    rows = db.execute("SELECT language, model, start, value FROM thresholds WHERE value IS NOT NULL AND at > ?"
                      " ORDER BY id", (reset_at(db),)).fetchall()  # fmt: skip
    return {(language, model, start): value for language, model, start, value in rows}


def reset(db: sqlite3.Connection) -> None:
    """A reset row: the thresholds start again from the models' own, and only events after it count."""
    with db:
        db.execute("INSERT INTO thresholds (at, language, model, start, value, rate, samples)"
                   " VALUES (?, '', '', 0, NULL, NULL, 0)", (time.time(),))  # fmt: skip


def history(db: sqlite3.Connection) -> list[dict[str, Any]]:
    """Every recorded move and reset, oldest first (`canvas-ls stats`)."""
    rows = db.execute("SELECT at, language, model, start, value, rate, samples FROM thresholds ORDER BY id").fetchall()
    return [dict(zip(("at", "language", "model", "start", "value", "rate", "samples"), row, strict=True))
            for row in rows]  # fmt: skip
