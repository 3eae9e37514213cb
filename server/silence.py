"""Why a completion request showed nothing: one closed list, the same words in every editor.

Every request that ends without a suggestion carries one `Why` (`Outcome.why`), with the details in its reason
(both values of a confidence below the threshold, the engine's error message). `canvas/status` returns the last
outcomes and the count per reason; an invoked request that shows nothing says why in the editor
(`window/showMessage`). The list may grow: editors show a value they do not know as its text.
"""

from __future__ import annotations

from enum import StrEnum


class Why(StrEnum):
    NOT_OPEN = "not open"  # the editor asked about a document it never opened in the server
    PAST_END = "past the end"  # the position is past the end of the document
    LANGUAGE_OFF = "language off"  # completion is turned off for the document's language
    IN_WORD = "inside a word"  # the cursor is inside an identifier: nothing is asked there
    LOADING = "loading"  # the model is still loading
    LOAD_FAILED = "model failed"  # the model or its engine failed to start (the error says why)
    ENGINE_MISMATCH = "engine mismatch"  # the resident engine is another installation's, version's or model's
    UNREACHABLE = "engine unreachable"  # a remote (team) engine does not answer; it is asked again every few seconds
    ENGINE_FAILED = "engine failed"  # the engine refused the request, went away or failed (its message)
    LOW_CONFIDENCE = "low confidence"  # below the display threshold while typing (both values in the reason)
    NOTHING_TO_ADD = "nothing to add"  # the model's answer was empty here
    BREAKS_CODE = "breaks the code"  # the answer would add syntax errors, or only repeat the code after the cursor
    SUPERSEDED = "superseded"  # a newer keystroke's request replaced it
    CANCELLED = "cancelled"  # the editor cancelled it while it ran
    CHANGED = "changed"  # the document, or the model that answers it, changed while it ran

    @property
    def words(self) -> str:
        """The reason as a sentence for the user."""
        return WORDS[self]


# The user moved on (typed, cancelled): nothing to tell them about that request.
MOVED_ON = frozenset({Why.SUPERSEDED, Why.CANCELLED, Why.CHANGED})


def sentence(why: Why, detail: str | None) -> str:
    """What an editor tells the user about a request that showed nothing."""
    return f"no suggestion: {why.words}" + (f" ({detail})" if detail else "")


WORDS = {
    Why.NOT_OPEN: "the document is not open in the server",
    Why.PAST_END: "the position is past the end of the document",
    Why.LANGUAGE_OFF: "completion is off for this language (the languages option)",
    Why.IN_WORD: "the cursor is inside a word",
    Why.LOADING: "the model is still loading",
    Why.LOAD_FAILED: "the model failed to load",
    Why.ENGINE_MISMATCH: "the running engine belongs to another canvas-ls installation, version or model",
    Why.UNREACHABLE: "the team engine does not answer (asked again every few seconds)",
    Why.ENGINE_FAILED: "the engine failed",
    Why.LOW_CONFIDENCE: "the model's confidence is below the display threshold",
    Why.NOTHING_TO_ADD: "the model has nothing to add here",
    Why.BREAKS_CODE: "the model's answer would break the code",
    Why.SUPERSEDED: "a newer keystroke replaced the request",
    Why.CANCELLED: "the editor cancelled the request",
    Why.CHANGED: "the document or the model changed while the model answered",
}
