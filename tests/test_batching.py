"""Batched decoding: requests that share decoder forwards get what they would have got alone."""

from __future__ import annotations

import threading

import pytest

from engine import Engine, InfillCancelled
from engine.canvas import StepView
from engine.engine import InfillRequest
from tests.test_canvas import EOS, confident

PREFIXES = ["def add(a, b):\n    return ", "x = 1\n" * 30 + "y = ", "import os\n\n\ndef main():\n    path = os."]
SUFFIXES = ["\n", "\n\nprint(y)\n", "\n    return path\n"]


def test_batched_requests_match_single_ones(tiny_engine: Engine) -> None:
    settings = [{"gap_tokens": 8, "max_new_tokens": 8, "max_steps": 5, "seed": s} for s in (1, 2, 3)]
    alone = [tiny_engine.infill(p, s, o) for p, s, o in zip(PREFIXES, SUFFIXES, settings, strict=True)]
    together = tiny_engine.infill_batch(
        [InfillRequest(p, s, o) for p, s, o in zip(PREFIXES, SUFFIXES, settings, strict=True)]
    )
    for single, batched in zip(alone, together, strict=True):
        assert batched.tokens == single.tokens
        assert batched.steps == single.steps
        # bf16 on this CPU: a batched matmul may round the logits a hair differently from a single one
        assert batched.confidence == pytest.approx(single.confidence, abs=2e-3)


def test_rows_with_different_gaps_and_continuations(tiny_engine: Engine) -> None:
    """Row 0 ends in its first canvas; row 1 needs three canvases (no EOS for 20 tokens, gaps of 8)."""
    lengths = [len(tiny_engine.tokenizer.encode(p, add_special_tokens=False)) + 1 for p in PREFIXES[:2]]

    def target(position: int) -> int:  # each row's answer depends on the offset from its own prefix end
        if lengths[1] <= position < lengths[1] + 20:
            return 60 + (position - lengths[1]) % 5
        return 50 if lengths[0] <= position < lengths[0] + 3 else EOS

    requests = [InfillRequest(PREFIXES[0], SUFFIXES[0], {"gap_tokens": 8}),
                InfillRequest(PREFIXES[1], SUFFIXES[1], {"gap_tokens": 8, "max_new_tokens": 64})]  # fmt: skip
    with confident(tiny_engine, target):
        short, long = tiny_engine.infill_batch(requests)
        alone = tiny_engine.infill(PREFIXES[1], SUFFIXES[1], {"gap_tokens": 8, "max_new_tokens": 64})
    assert short.tokens == [50, 50, 50] and short.canvases == 1
    assert long.tokens == alone.tokens and long.canvases == alone.canvases == 3


def test_a_cancelled_row_leaves_the_batch_and_the_others_finish(tiny_engine: Engine) -> None:
    cancel = threading.Event()

    def stop_after_two(view: StepView) -> None:
        if view.step == 2:
            cancel.set()

    settings = {"gap_tokens": 8, "max_new_tokens": 8, "max_steps": 6}
    results = tiny_engine.infill_batch([
        InfillRequest(PREFIXES[0], SUFFIXES[0], settings),
        InfillRequest(PREFIXES[1], SUFFIXES[1], settings, cancel, stop_after_two),
        InfillRequest(PREFIXES[2], SUFFIXES[2], settings),
    ])  # fmt: skip
    assert isinstance(results[1], InfillCancelled) and results[1].steps == 2
    assert results[0].steps > 2 and results[2].steps > 2


def test_a_request_joins_a_running_batch_between_steps(tiny_engine: Engine) -> None:
    """Iteration-level scheduling: B joins while A is denoising, A leaves when it ends; each gets its solo answer."""
    settings = [{"gap_tokens": 8, "max_new_tokens": 8, "max_steps": 6, "seed": s} for s in (4, 5)]
    first, second = (InfillRequest(p, s, o) for p, s, o in zip(PREFIXES, SUFFIXES, settings, strict=False))
    alone = [tiny_engine.infill(r.prefix, r.suffix, r.overrides) for r in (first, second)]
    batch = tiny_engine.batch()
    batch.add(first)
    ended = batch.step() + batch.step()
    assert ended == [] and len(batch) == 1  # A is two steps in
    batch.add(second)
    rows = []
    while batch:
        rows.append(len(batch))
        ended += batch.step()
    outcomes = {id(request): outcome for request, outcome in ended}
    assert rows[0] == 2  # the next forward carried both
    for request, single in zip((first, second), alone, strict=True):
        result = outcomes[id(request)]
        assert result.tokens == single.tokens and result.steps == single.steps
