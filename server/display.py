"""What the editor is shown of a model's answer: the one display decision.

Inline completion, the completion-menu fallback, `canvas/fill` and the cache's re-decisions call `decide`; next edits
call `reaches` with their predictor's threshold; `bench calibrate` scores its answers with the same scorer
(`engine.confidence.judge`), so the threshold it writes means what it means here. No other module compares a
confidence with a threshold.

    answer -> shaped edit (or Hidden: nothing left to show) -> invoked? (Shown whole: the user asked)
           -> threshold (the user's, else the one learned from the user's accepts (`personal.py`), else the
              model's calibrated one for this kind of request)
           -> score of the tokens that write the shown text, between the document's text around it
           -> Shown | Cut (its confident head, when asked for) | Hidden(why)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..engine.confidence import HIDDEN, judge
from .backend import Answer
from .config import CompletionOptions
from .edits import Edit
from .silence import Why


@dataclass(frozen=True)
class Shown:
    edit: Edit
    score: float | None = None  # its confidence score (None: not judged: nothing to judge it by)


@dataclass(frozen=True)
class Cut:
    """The answer's confident head, shown instead of the whole answer, and why."""

    edit: Edit
    why: str


@dataclass(frozen=True)
class Hidden:
    """Nothing is shown: `reason` in words for the user, `why` from the closed list (the threshold, or the answer
    itself left nothing to show: it wrote nothing, or only text that would break the code)."""

    reason: str
    why: Why = Why.LOW_CONFIDENCE


Decision = Shown | Cut | Hidden


def reaches(confidence: float, threshold: float) -> bool:
    """Whether a confidence is high enough to show at `threshold`."""
    return confidence >= threshold


def decide(answer: Answer, edit: Edit | None, text: str, invoked: bool, options: CompletionOptions,
           reshape: Callable[[str], Edit | None], learned: float | None = None) -> Decision:  # fmt: skip
    """What to show of `answer`, whose shaped, syntax-checked edit of the document `text` is `edit` (None: nothing
    of it can be shown). An invoked request shows it whole; a typing request only as far as the model stands behind
    it: whole, else (with `options.show_head`) its confident head as `reshape` makes it an edit, else nothing.
    `learned`: the threshold learned from this user's accepts for the model's own (`personal.py`)."""
    if edit is None:
        if not answer.text.strip():
            return Hidden("the model's answer is empty here", Why.NOTHING_TO_ADD)
        return Hidden("the answer would add syntax errors or only repeat the code after the cursor", Why.BREAKS_CODE)
    # the user's threshold, else the one calibrated for the model and this kind of request (reported with the answer)
    threshold = next(t for t in (options.min_confidence, learned, answer.min_confidence) if t is not None)
    if answer.score_kind is None or (threshold <= 0 and options.min_confidence is not None):
        return Shown(edit)  # nothing to judge it by (a server that gives no confidences), or the user's "show all"
    score, head = judge(answer, edit.text, threshold, (text[: edit.start], text[edit.end :]))
    if invoked or reaches(score, threshold):
        return Shown(edit, score)  # asked for (scored all the same: what a lower threshold would show), or confident
    why = f"confidence {score:.2f} below {threshold:.2f} ({answer.score_kind} score)"
    if threshold >= HIDDEN:  # a calibration that stands behind nothing here (or the user's 1.0)
        why += "; nothing is shown here while typing: invoke a completion to see the model's answer"
    cut = reshape(head) if options.show_head else None
    if cut is None or not cut.text.strip():
        return Hidden(f"hidden: {why}")
    return Cut(cut, f"cut to its confident head: {why}")
