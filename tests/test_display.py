"""What the server shows of an answer, decided on answers known in advance: a backend that returns a literal
`Answer` (the typed reply all three backends give), behind the real Completer. The display decision has one owner,
`engine.confidence.judge`, fed by the answer's tokens: a typing request's answer the model does not stand behind is
cut to its confident head or hidden, with why; an invoked request is shown whole; one model call, the cache
re-decides; a Failed or Cancelled reply is said so."""

from __future__ import annotations

from typing import Any

from canvas_ls.server.backend import Answer, CancelFlag, Cancelled, CompletionRequest, Failed, Identity, Reply
from canvas_ls.server.completion import Completer, Source
from canvas_ls.server.config import ServerConfig
from canvas_ls.server.documents import Document
from canvas_ls.server.silence import Why
from canvas_ls.server.workspaces import RoutedBackend

DOC = "def size(x):\n    return \n"
LINE, CHARACTER = 1, 11  # after "return "
# "len(x)" is sure, " + oops" is not: min score 0.1
ANSWER = Answer("len(x) + oops", ("len", "(x)", " + oops"), (0.99, 0.98, 0.1), score_kind="min", min_confidence=0.5)


class Fixed:
    """A backend that answers every request with `reply`, and counts the calls."""

    adapters = False
    whole_models = True
    state, error, model_name, load_seconds = "ready", None, "fixed", 0.0
    identity = Identity("fixed", "fixed")

    def __init__(self, reply: Reply) -> None:
        self.reply, self.calls, self.cancelled_after_steps = reply, 0, []

    def load(self, model: str | None, device: str, on_done: Any = None) -> None: ...

    async def infill(self, request: CompletionRequest, cancel: CancelFlag) -> Reply:
        self.calls += 1
        return self.reply

    async def fill(self, *args: Any, **kwargs: Any) -> Reply:
        return self.reply

    def shutdown(self) -> None: ...


def completer(reply: Reply, **completion: Any) -> tuple[Completer, Fixed, Document]:
    config = ServerConfig()
    for name, value in completion.items():
        setattr(config.completion, name, value)
    fixed = Fixed(reply)
    return (
        Completer(RoutedBackend(fixed, lambda *_: fixed, None, False), config),
        fixed,
        Document.open("file:///size.py", DOC, 1, "python"),
    )


async def test_an_answer_under_the_threshold_is_cut_to_its_head_while_typing_and_shown_whole_when_invoked() -> None:
    complete, fixed, document = completer(ANSWER, show_head=True)
    typing = await complete.complete(document, LINE, CHARACTER)
    assert (typing.source, typing.edit.text if typing.edit else None) == ("model", "len(x)")
    assert typing.detail == "cut to its confident head: confidence 0.10 below 0.50 (min score)"
    invoked = await complete.complete(document, LINE, CHARACTER, invoked=True)
    assert (invoked.source, invoked.edit.text if invoked.edit else None, invoked.detail) == (
        "model",  # an invoked request asks for at least one token: a call of its own
        "len(x) + oops",
        None,
    )
    complete.config.completion.min_confidence = 0.05  # the user's threshold over the model's
    whole = await complete.complete(document, LINE, CHARACTER)  # the cache re-decides: no model call
    assert (whole.source, whole.edit.text if whole.edit else None, whole.detail) == ("cache", "len(x) + oops", None)
    complete.config.completion.min_confidence, complete.config.completion.show_head = 1.0, False
    hidden = await complete.complete(document, LINE, CHARACTER)
    assert (hidden.source, hidden.edit, hidden.why) == ("hidden", None, Why.LOW_CONFIDENCE)
    assert hidden.detail == (
        "hidden: confidence 0.10 below 1.00 (min score); nothing is shown here while typing: invoke a completion to "
        "see the model's answer"
    )
    assert fixed.calls == 2 and complete.stats.heads == 1


async def test_answers_without_confidences_are_shown_as_they_are() -> None:
    """An OpenAI-compatible server's answer carries no per-token confidences: nothing to judge, shown whole."""
    complete, _, document = completer(Answer("len(x) + 1"), min_confidence=0.9)
    outcome = await complete.complete(document, LINE, CHARACTER)
    assert (outcome.source, outcome.edit.text if outcome.edit else None, outcome.detail) == (
        "model",
        "len(x) + 1",
        None,
    )


async def test_failed_and_cancelled_replies_are_said_so() -> None:
    complete, _, document = completer(Failed("the engine answered 401: no"))
    outcome = await complete.complete(document, LINE, CHARACTER)
    assert (outcome.label, outcome.edit, complete.stats.errors) == ("error:the engine answered 401: no", None, 1)
    assert outcome.why is Why.ENGINE_FAILED and complete.stats.silent == {Why.ENGINE_FAILED: 1}
    complete, _, document = completer(Failed("the model is still loading", loading=True, why=Why.LOADING))
    outcome = await complete.complete(document, LINE, CHARACTER)
    assert (outcome.source, outcome.reason, outcome.why) == (Source.NOT_READY, "the model is still loading", "loading")
    assert complete.stats.errors == 0
    complete, _, document = completer(Cancelled())
    outcome = await complete.complete(document, LINE, CHARACTER)
    assert (outcome.source, outcome.why) == ("cancelled", Why.CANCELLED)


async def test_an_answer_that_leaves_nothing_to_show_says_which_way() -> None:
    """Empty: the model has nothing to add; text that would add syntax errors: it would break the code. Both are
    said even when the user asked (the model cannot be shown whatever its confidence)."""
    complete, _, document = completer(Answer(""))
    empty = await complete.complete(document, LINE, CHARACTER, invoked=True)
    assert (empty.source, empty.why) == ("rejected", Why.NOTHING_TO_ADD)
    assert empty.detail == "the model's answer is empty here"
    complete, _, document = completer(Answer("len(x))) +"))
    broken = await complete.complete(document, LINE, CHARACTER)
    assert (broken.source, broken.why) == ("rejected", Why.BREAKS_CODE)
    assert complete.stats.silent == {Why.BREAKS_CODE: 1} and complete.stats.shown == 0
