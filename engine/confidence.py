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
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCORES: tuple[str, ...] = ("min", "mean", "geometric", "useful")
LINE_CHARS = 32  # "useful": an answer writing this many characters (its blanks aside) is worth a whole line
# How `canvas-ls bench calibrate` chooses a threshold (its --target and --min-shown), and how many held-out lines a
# workspace's tuned model is calibrated on after `train --workspace`
TARGET = 0.5  # precision (share of shown answers that are good) the threshold must reach
MIN_SHOWN = 10  # answers a threshold must still show
WORKSPACE_LINES = 200
_FLOOR = 1e-6  # a token reported as probability 0 (rounded) still has a finite log


def sequence_score(confidence: Sequence[float], kind: str, text: str | None = None) -> float:
    """The answer's score in [0, 1] (`text`: what its tokens write, which "useful" needs); an empty answer scores 1
    (there is nothing to doubt, and nothing is shown)."""
    if kind not in SCORES:
        raise ValueError(f"unknown confidence score '{kind}' (known: {', '.join(SCORES)})")
    if kind == "useful" and text is None:
        raise ValueError("the 'useful' score needs the text the answer writes")
    if not confidence:
        return 1.0
    if kind == "min":
        return min(confidence)
    if kind == "mean":
        return sum(confidence) / len(confidence)
    geometric = math.exp(sum(math.log(max(c, _FLOOR)) for c in confidence) / len(confidence))
    if kind == "geometric":
        return geometric
    return geometric * min(1.0, len((text or "").strip()) / LINE_CHARS)


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
                   healed: str = "") -> str:  # fmt: skip
    """The longest run of whole tokens from the start whose score reaches `threshold`, as text for the cursor
    (`healed`: the prefix text the first token re-writes, not part of the answer). Empty when the first token
    alone falls short."""
    kept = 0
    for count in range(1, len(confidence) + 1):
        if sequence_score(confidence[:count], kind, "".join(token_texts[:count]).removeprefix(healed)) >= threshold:
            kept = count
        elif kind == "min":
            break  # a longer run only gets weaker
    return "".join(token_texts[:kept]).removeprefix(healed)


def judge(answer: dict[str, Any], shown: str, threshold: float) -> tuple[float, str]:
    """An engine answer (`InfillResult` fields: token_texts, confidence, score_kind, healed) as the editor would
    show `shown` of it: the score of the tokens that write `shown`, and their confident head at `threshold`."""
    count = shown_tokens(answer["token_texts"], answer.get("healed", ""), shown)
    texts, confidence = answer["token_texts"][:count], answer["confidence"][:count]
    kind = answer["score_kind"]
    healed = answer.get("healed", "")
    head = confident_head(texts, confidence, kind, threshold, healed)
    return sequence_score(confidence, kind, "".join(texts).removeprefix(healed)), head


@dataclass(frozen=True)
class Display:
    """A model's display policy, from its folder's `canvas_ls.json` ("display": {"score", "min_confidence"}),
    written by `canvas-ls bench calibrate`. Uncalibrated: every answer is shown."""

    score: str = "geometric"
    min_confidence: float = 0.0

    @classmethod
    def from_record(cls, record: dict[str, Any] | None) -> Display:
        record = record or {}
        display = cls(str(record.get("score", cls.score)), float(record.get("min_confidence", cls.min_confidence)))
        if display.score not in SCORES or not 0.0 <= display.min_confidence <= 1.0:
            raise ValueError(f"bad display settings {record!r}: score one of {SCORES}, min_confidence in [0, 1]")
        return display


def model_display(model_dir: Path | None) -> Display:
    """The display policy of a model folder (the default policy when it has none)."""
    import json

    from canvas_ls.engine.settings import MODEL_SETTINGS_FILE, SettingsError

    path = None if model_dir is None else model_dir / MODEL_SETTINGS_FILE
    if path is None or not path.is_file():
        return Display()
    try:
        return Display.from_record(json.loads(path.read_text()).get("display"))
    except (json.JSONDecodeError, ValueError) as exc:
        raise SettingsError(f"{path}: {exc}") from exc
