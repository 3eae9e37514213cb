"""How much the model stands behind an answer: one sequence score from the per-token confidences, and the
confident head of an answer. Torch-free: the language server applies the display threshold itself.

A token's confidence is the probability the last denoising step gave the token that was kept (`InfillResult
.confidence`). A diffusion model scores every slot with both sides in view, so an early token that the code after
the gap contradicts is scored low, unlike an autoregressive model's running probability.

Scores (`canvas-ls bench calibrate` picks the one that separates good answers from bad best on a calibration set):
  "min"        the weakest token: one wrong token spoils a completion;
  "mean"       the average token confidence;
  "geometric"  exp(mean log confidence), the length-normalised log-probability of the answer;
  "useful"     geometric x min(1, characters written / LINE_CHARS): how likely the answer is right times how much of
               a line it saves. A confident `)` or `else:` is cheap to get right and saves little typing; on a
               repository's held-out lines such short answers were the most confident wrong ones (a line's first
               token with the rest left to the next line), and this score told good answers from bad better than
               the others (`bench calibrate`'s areas under the ROC curve: README).
  "anchored"   useful x `copy_support`: an answer that copies another line of the document (the document's token
               cache makes such copies near certain token by token) counts only as far as the copy's surroundings
               agree with the cursor's. Which line to copy is the cache's real doubt, and the last step's per-token
               confidence no longer shows it: every token of the copy is certain given the others. On a
               repository's held-out lines (one-line answers), half the answers above the `useful` threshold were
               such copies, and most of the wrong ones copied a line from unlike surroundings (README).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

SCORES: tuple[str, ...] = ("min", "mean", "geometric", "useful", "anchored")
# "useful": an answer writing this many characters (its blanks aside) is worth a whole line; "anchored": a copied
# line whose surroundings agree over this many characters is as well supported as one the document never wrote
LINE_CHARS = 32
AROUND_CHARS = 32_768  # of the document on each side of an answer that `copy_support` reads (~ the token cache's)
# How `canvas-ls bench calibrate` chooses a threshold (its --target and --min-shown), and how many held-out lines a
# workspace's tuned model is calibrated on after `train --workspace`
TARGET = 0.5  # precision (share of shown answers that are good) the threshold must reach
MIN_SHOWN = 10  # answers a threshold must still show
WORKSPACE_LINES = 200
_FLOOR = 1e-6  # a token reported as probability 0 (rounded) still has a finite log


def sequence_score(confidence: Sequence[float], kind: str, text: str | None = None,
                   support: float | None = None) -> float:  # fmt: skip
    """The answer's score in [0, 1] (`text`: what its tokens write, which "useful" and "anchored" need; `support`:
    the answer's `copy_support`, which "anchored" needs); an empty answer scores 1 (there is nothing to doubt, and
    nothing is shown)."""
    if kind not in SCORES:
        raise ValueError(f"unknown confidence score '{kind}' (known: {', '.join(SCORES)})")
    if kind in ("useful", "anchored") and text is None:
        raise ValueError(f"the '{kind}' score needs the text the answer writes")
    if kind == "anchored" and support is None:
        raise ValueError("the 'anchored' score needs the answer's copy support (`copy_support`)")
    if not confidence:
        return 1.0
    if kind == "min":
        return min(confidence)
    if kind == "mean":
        return sum(confidence) / len(confidence)
    geometric = math.exp(sum(math.log(max(c, _FLOOR)) for c in confidence) / len(confidence))
    if kind == "geometric":
        return geometric
    useful = geometric * min(1.0, len((text or "").strip()) / LINE_CHARS)
    return useful if kind == "useful" else useful * (support if support is not None else 1.0)


def copy_support(text: str, before: str, after: str) -> float:
    """How far the document stands behind an answer that copies its own lines, in [0, 1]. The answer completes
    lines (the cursor line's text before it, the answer, the rest of its last line after it); where the document,
    the answer in place, holds those lines elsewhere (blanks at their ends aside), the characters that agree around
    a copy (back from its first line's start against `before`'s, on from its last line's end against `after`'s),
    the most over the copies, / LINE_CHARS, at most 1. 1 for an answer that copies no line, or writes nothing."""
    before, after = before[-AROUND_CHARS:], after[:AROUND_CHARS]
    start = before.rfind("\n") + 1  # the cursor line's start, and the end of the answer's last line
    end = after.find("\n")
    end = len(after) if end < 0 else end
    completed = before[start:] + text + after[:end]
    wanted = [line.strip() for line in completed.split("\n")]
    if not any(wanted):
        return 1.0
    document = before[:start] + completed + after[end:]
    lines = document.split("\n")
    stripped = [line.strip() for line in lines]
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line) + 1)
    here = start  # the completed lines' first character in `document`
    best = -1
    for first in range(len(lines) - len(wanted) + 1):
        if starts[first] == here or stripped[first : first + len(wanted)] != wanted:
            continue
        stop = starts[first + len(wanted)] - 1  # the copy's last line's end
        agree = _agreement(document, starts[first], here, -1) + _agreement(document, stop, here + len(completed), 1)
        best = max(best, agree)
    return 1.0 if best < 0 else min(1.0, best / LINE_CHARS)


def answer_support(kind: str, text: str, around: tuple[str, str] | None) -> float | None:
    """The `copy_support` a score of `kind` needs for an answer writing `text` between the document's `around`
    (before, after): only "anchored" reads it (None for the others, which then cost no search of the document); 1
    where the text around the answer is not known."""
    if kind != "anchored":
        return None
    return copy_support(text, *around) if around is not None else 1.0


def _agreement(document: str, there: int, here: int, way: int) -> int:
    """Characters equal going back (`way` -1: before the two offsets) or on (+1: from them), up to LINE_CHARS."""
    count = 0
    while count < LINE_CHARS:
        a, b = (there - count - 1, here - count - 1) if way < 0 else (there + count, here + count)
        if min(a, b) < 0 or max(a, b) >= len(document) or document[a] != document[b]:
            break
        count += 1
    return count


def shown_tokens(token_texts: Sequence[str], healed: str, shown: str) -> int:
    """How many leading tokens write `shown` (the part of the answer the editor shows: its first line, say), when
    the answer starts with it; else all of them. `healed`: the prefix text the first token re-writes."""
    text = "".join(token_texts)
    if not text.startswith(healed) or not text[len(healed) :].startswith(shown):
        return len(token_texts)
    end, written = len(healed) + len(shown.rstrip()), 0
    for count, piece in enumerate(token_texts, 1):
        written += len(piece)
        if written >= end:
            return count
    return len(token_texts)


def confident_head(token_texts: Sequence[str], confidence: Sequence[float], kind: str, threshold: float,
                   healed: str = "", support: float | None = None) -> str:  # fmt: skip
    """The longest run of whole tokens from the start whose score reaches `threshold`, as text for the cursor
    (`healed`: the prefix text the first token re-writes, not part of the answer; `support`: the whole answer's
    `copy_support`, which its heads keep: a head of a copied line is that copy's start). Empty when the first
    token alone falls short. One pass: each head's score from running sums (`sequence_score`'s, incrementally)."""
    if kind not in SCORES:
        raise ValueError(f"unknown confidence score '{kind}' (known: {', '.join(SCORES)})")
    joined = "".join(token_texts)
    cut = len(healed) if joined.startswith(healed) else 0  # what `removeprefix(healed)` takes off, once long enough
    kept, lowest, total, logs, length = 0, 1.0, 0.0, 0.0, 0
    first = last = -1  # the first and last non-blank characters written so far (offsets in `joined`)
    first_after_cut = -1
    for count, (piece, value) in enumerate(zip(token_texts, confidence, strict=False), 1):
        for at, char in enumerate(piece, length):
            if not char.isspace():
                first = at if first < 0 else first
                first_after_cut = at if first_after_cut < 0 and at >= cut else first_after_cut
                last = at
        length += len(piece)
        lowest, total, logs = min(lowest, value), total + value, logs + math.log(max(value, _FLOOR))
        if kind == "min":
            score = lowest
        elif kind == "mean":
            score = total / count
        else:
            score = math.exp(logs / count)
            if kind != "geometric":
                start = first_after_cut if length >= cut and cut else first  # the head's text, healed part off
                written = 0 if start < 0 or last < start else last - start + 1
                score *= min(1.0, written / LINE_CHARS) * (support if kind == "anchored" and support is not None
                                                           else 1.0)  # fmt: skip
        if score >= threshold:
            kept = count
        elif kind == "min":
            break  # a longer run only gets weaker
    return "".join(token_texts[:kept]).removeprefix(healed)


class Written(Protocol):
    """An answer's tokens as the display decision reads them (`InfillResult`, the server's `Answer`)."""

    token_texts: Sequence[str]
    confidence: Sequence[float]
    healed: str  # the prefix text the first token re-writes (token healing)
    score_kind: str | None


def judge(answer: Written, shown: str, threshold: float, around: tuple[str, str]) -> tuple[float, str]:
    """An answer as the editor would show `shown` of it between the document's text `around` it (before, after):
    the score of the tokens that write `shown` (the answer's kind of score, as `scores` gives it), and their
    confident head at `threshold`. What `server/display.py:decide` compares with the threshold."""
    kind = answer.score_kind or "geometric"
    texts, confidence, written = judged_tokens(answer, shown)
    found, support = _scored(confidence, written, shown, around, (kind,))
    head = confident_head(texts, confidence, kind, threshold, answer.healed, support if kind == "anchored" else None)
    return found[kind], head


def scores(answer: Written, shown: str, around: tuple[str, str],
           kinds: Sequence[str] = SCORES) -> tuple[dict[str, float], float]:  # fmt: skip
    """The one scorer: the scores of `kinds` of the tokens that write `shown` between the document's text `around`
    it, and its `copy_support` (computed once, only where "anchored" is asked for; 1.0 otherwise). The server's
    display decision (`judge`) and `bench calibrate` (`server/calibration.py`) both score with it, so a threshold
    calibrated means what the server compares."""
    _, confidence, written = judged_tokens(answer, shown)
    return _scored(confidence, written, shown, around, kinds)


def _scored(confidence: Sequence[float], written: str, shown: str, around: tuple[str, str],
            kinds: Sequence[str]) -> tuple[dict[str, float], float]:  # fmt: skip
    support = copy_support(shown, *around) if "anchored" in kinds else 1.0
    return {kind: sequence_score(confidence, kind, written, support) for kind in kinds}, support


def judged_tokens(answer: Written, shown: str) -> tuple[list[str], list[float], str]:
    """The tokens of an answer that write `shown` (its texts and confidences) and the text they write, the healed
    prefix text aside: what a score of `shown` is computed from."""
    count = shown_tokens(answer.token_texts, answer.healed, shown)
    texts, confidence = list(answer.token_texts[:count]), list(answer.confidence[:count])
    return texts, confidence, "".join(texts).removeprefix(answer.healed)


MODES: tuple[str, ...] = ("single_line", "multi_line")  # the server's requests: a line begun, a blank line
# The threshold of a kind of request the model stands behind none of: only answers certain of every token reach it
# (none of 1,200 calibration answers did), so nothing is shown there while typing (`bench calibrate` writes it)
HIDDEN = 1.0


@dataclass(frozen=True)
class Display:
    """A model's display policy, from its folder's `canvas_ls.json` ("display": {"score", "min_confidence",
    "multi_line": {"score", "min_confidence"}}), written by `canvas-ls bench calibrate`: the score and threshold of
    answers to a begun line (the rest of it), and of those to a blank line (a block; the same unless given): the two
    kinds of answers differ, and a threshold chosen on one does not hold on the other. Uncalibrated: every answer is
    shown."""

    score: str = "geometric"
    min_confidence: float = 0.0
    multi_line: tuple[str, float] | None = None

    def for_request(self, single_line: bool) -> tuple[str, float]:
        """(score, threshold) of a request's answers."""
        if single_line or self.multi_line is None:
            return self.score, self.min_confidence
        return self.multi_line

    @classmethod
    def from_record(cls, record: dict[str, Any] | None) -> Display:
        record = record or {}
        blocks = record.get("multi_line")
        line = (record.get("score", cls.score), record.get("min_confidence", cls.min_confidence))
        block = (blocks.get("score"), blocks.get("min_confidence")) if isinstance(blocks, dict) else blocks
        for policy in (line, block) if blocks is not None else (line,):
            if not (isinstance(policy, tuple) and policy[0] in SCORES and isinstance(policy[1], int | float)
                    and 0.0 <= policy[1] <= 1.0):  # fmt: skip
                raise ValueError(f"bad display settings {record!r}: score one of {SCORES}, min_confidence in [0, 1]")
        return cls(line[0], float(line[1]), None if block is None else (block[0], float(block[1])))


def model_display(model_dir: Path | None) -> Display:
    """The display policy of a model folder (the default policy when it has none)."""
    import json

    from .settings import MODEL_SETTINGS_FILE, SettingsError

    path = None if model_dir is None else model_dir / MODEL_SETTINGS_FILE
    if path is None or not path.is_file():
        return Display()
    try:
        return Display.from_record(json.loads(path.read_text()).get("display"))
    except (json.JSONDecodeError, ValueError) as exc:
        raise SettingsError(f"{path}: {exc}") from exc
