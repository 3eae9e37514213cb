"""Batched decoding: requests that share decoder forwards get what they would have got alone."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from transformers import DynamicCache

from canvas_ls.engine import Engine, InfillCancelled
from canvas_ls.engine.canvas import StepView
from canvas_ls.engine.conditioning import SelfConditioning
from canvas_ls.engine.encoding import encode, encode_rows
from canvas_ls.engine.engine import InfillRequest
from tests.test_canvas import EOS, confident

PREFIXES = ["def add(a, b):\n    return ", "x = 1\n" * 30 + "y = ", "import os\n\n\ndef main():\n    path = os."]
SUFFIXES = ["\n", "\n\nprint(y)\n", "\n    return path\n"]


def test_batched_requests_match_single_ones(tiny_engine_fp32: Engine) -> None:
    engine = tiny_engine_fp32
    settings = [{"gap_tokens": 8, "max_new_tokens": 8, "max_steps": 5, "seed": s} for s in (1, 2, 3)]
    alone = [engine.infill(p, s, o) for p, s, o in zip(PREFIXES, SUFFIXES, settings, strict=True)]
    together = engine.infill_batch(
        [InfillRequest(p, s, o) for p, s, o in zip(PREFIXES, SUFFIXES, settings, strict=True)]
    )
    for single, batched in zip(alone, together, strict=True):
        assert batched.tokens == single.tokens
        assert batched.steps == single.steps
        assert batched.confidence == pytest.approx(single.confidence, abs=1e-4)


@contextlib.contextmanager
def counted_encodes(model: Any) -> Iterator[list[int]]:
    """The rows of each encoder forward run inside the block."""
    encoder, rows = model.model.encoder, []
    original = encoder.forward
    encoder.forward = lambda *args, **kwargs: rows.append(kwargs["input_ids"].shape[0]) or original(*args, **kwargs)
    try:
        yield rows
    finally:
        del encoder.forward


def test_prefixes_encoded_together_hold_what_each_would_alone(tiny_engine_fp32: Engine) -> None:
    """One encoder forward over rows with different cached and new lengths (left-padded both), two of them
    crossing the tiny model's 256-token sliding window: each row's cache ends up as its own forward leaves it."""
    model = tiny_engine_fp32.loaded.model
    assert model.config.get_text_config().sliding_window == 256
    generator = torch.Generator().manual_seed(0)
    shapes = [(0, 5), (100, 200), (300, 40), (50, 0)]  # (already cached, new) tokens per row
    ids = [torch.randint(3, 200, (cached + new,), generator=generator).tolist() for cached, new in shapes]

    def cached(row: int) -> DynamicCache:
        cache = DynamicCache(config=model.config.get_text_config(decoder=True))
        if shapes[row][0]:
            encode(model, torch.tensor([ids[row][: shapes[row][0]]]), cache, 0)
        return cache

    alone = [cached(row) for row in range(len(shapes))]
    for row, (start, new) in enumerate(shapes):
        if new:
            encode(model, torch.tensor([ids[row][start:]]), alone[row], start)
    together = [cached(row) for row in range(len(shapes))]
    with counted_encodes(model) as batches:
        encode_rows(
            model, together, [ids[row][start:] for row, (start, _) in enumerate(shapes)], [s for s, _ in shapes]
        )
    assert batches == [2, 1]  # 5 and 40 new tokens together; 200 alone (padding 5 up to 200 costs more than it saves)
    for solo, batched in zip(alone, together, strict=True):
        for a, b in zip(solo.layers, batched.layers, strict=True):
            assert a.keys.shape == b.keys.shape
            torch.testing.assert_close(b.keys, a.keys, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(b.values, a.values, atol=1e-5, rtol=1e-4)


def test_requests_admitted_together_share_encoder_forwards(tiny_engine_fp32: Engine) -> None:
    """The resident engine admits requests that arrived together in one `add_many`: their prefixes share encoder
    forwards (rows of similar lengths together), not one forward each; the answers are unchanged."""
    engine = tiny_engine_fp32
    settings = {"gap_tokens": 8, "max_new_tokens": 8, "max_steps": 5, "seed": 7, "reuse_prefix": False}
    alone = [engine.infill(p, s, settings) for p, s in zip(PREFIXES, SUFFIXES, strict=True)]
    batch = engine.batch()
    with counted_encodes(engine.loaded.model) as batches:
        assert batch.add_many([InfillRequest(p, s, settings) for p, s in zip(PREFIXES, SUFFIXES, strict=True)]) == []
    assert batches == [2, 1]  # the two short prefixes in one forward; the long one ("x = 1" x 30) in its own
    outcomes = []
    while batch:
        outcomes += batch.step()
    by_prefix = {request.prefix: outcome for request, outcome in outcomes}
    for prefix, single in zip(PREFIXES, alone, strict=True):
        assert by_prefix[prefix].tokens == single.tokens


def test_a_bad_request_admitted_with_others_fails_alone(tiny_engine: Engine) -> None:
    batch = tiny_engine.batch()
    bad = InfillRequest(PREFIXES[0], SUFFIXES[0], {"gap_tokens": 0})
    good = InfillRequest(PREFIXES[1], SUFFIXES[1], {"gap_tokens": 8, "max_new_tokens": 8})
    failed = batch.add_many([bad, good])
    assert [request for request, _ in failed] == [bad] and len(batch) == 1


def test_rows_with_different_gaps_and_continuations(tiny_engine: Engine) -> None:
    """Row 0 ends in its first canvas; row 1 needs three canvases (no EOS for 20 tokens, gaps of 8)."""
    lengths = [len(tiny_engine.tokenizer.encode(p, add_special_tokens=False)) + 1 for p in PREFIXES[:2]]

    def target(position: int) -> int:  # each row's answer depends on the offset from its own prefix end
        if lengths[1] <= position < lengths[1] + 20:
            return 60 + (position - lengths[1]) % 5
        return 50 if lengths[0] <= position < lengths[0] + 3 else EOS

    plain = {"gap_tokens": 8, "token_healing": False}  # the answers are laid out from the prefixes' own ids
    requests = [InfillRequest(PREFIXES[0], SUFFIXES[0], plain),
                InfillRequest(PREFIXES[1], SUFFIXES[1], {**plain, "max_new_tokens": 64})]  # fmt: skip
    with confident(tiny_engine, target):
        short, long = tiny_engine.infill_batch(requests)
        alone = tiny_engine.infill(PREFIXES[1], SUFFIXES[1], {**plain, "max_new_tokens": 64})
    assert short.tokens == [50, 50, 50] and short.canvases == 1
    assert long.tokens == alone.tokens and long.canvases == alone.canvases == 3


def test_a_cancelled_row_leaves_the_batch_and_the_others_finish(tiny_engine: Engine) -> None:
    cancel = threading.Event()

    def stop_after_two(view: StepView) -> None:
        if view.step == 2:
            cancel.set()

    settings = {"gap_tokens": 8, "max_new_tokens": 8, "max_steps": 6}
    alone = [tiny_engine.infill(PREFIXES[row], SUFFIXES[row], settings) for row in (0, 2)]
    results = tiny_engine.infill_batch([
        InfillRequest(PREFIXES[0], SUFFIXES[0], settings),
        InfillRequest(PREFIXES[1], SUFFIXES[1], settings, cancel, stop_after_two),
        InfillRequest(PREFIXES[2], SUFFIXES[2], settings),
    ])  # fmt: skip
    assert isinstance(results[1], InfillCancelled) and results[1].steps == 2
    assert results[0].steps > 2 and results[2].steps > 2
    # the last row moved up into the cancelled one's place, its self-conditioning with it: answers as alone
    assert [results[0].tokens, results[2].tokens] == [single.tokens for single in alone]
    assert [results[0].steps, results[2].steps] == [single.steps for single in alone]


def test_self_conditioning_rows_are_written_in_place_and_move_up_when_a_row_leaves() -> None:
    conditioning = SelfConditioning(vocab_size=5, dtype=torch.float32, device=torch.device("cpu"))
    logits, mask = conditioning.inputs(rows=3, width=2)  # laid out for the batch (no row conditioned yet)
    assert logits.shape == (3, 2, 5) and mask.tolist() == [False] * 3 and not conditioning.any(3)
    for row in range(3):
        conditioning.write(row, torch.full((2, 5), float(row + 1)), temperature=2.0)
    written = conditioning.buffer
    assert conditioning.inputs(3, 2)[0].data_ptr() == written.data_ptr()  # the same buffer, step after step
    conditioning.keep([0, 2])  # row 1 left: row 2 moves up
    conditioning.clear(0)  # row 0 opened a new canvas
    logits, mask = conditioning.inputs(2, 2)
    assert mask.tolist() == [False, True] and conditioning.flags[:3] == [False, True, False]
    assert logits[1].tolist() == [[1.5] * 5] * 2
    logits, mask = conditioning.inputs(2, 3)  # a wider canvas joined: the rows are carried over, the new slots zero
    assert logits[1, :2].tolist() == [[1.5] * 5] * 2 and logits[1, 2].tolist() == [0.0] * 5
    assert conditioning.reallocations == 2
    conditioning.write(0, torch.ones(3, 5), temperature=1.0)
    conditioning.keep([3])  # row 0 left; the one after it joined past the buffer's 3 rows: nothing to move
    assert conditioning.flags[:3] == [False, False, False] and not conditioning.any(3)


def test_a_batchs_steps_reuse_one_self_conditioning_buffer(tiny_engine_fp32: Engine) -> None:
    """No per-step [rows, width, V] tensor: the buffer is laid out once for the batch and written in place."""
    settings = {"gap_tokens": 8, "max_new_tokens": 8, "max_steps": 6, "stability_threshold": 99}
    batch = tiny_engine_fp32.batch()
    batch.add_many([InfillRequest(PREFIXES[row], SUFFIXES[0], settings) for row in range(2)])
    conditioning = batch._batch.conditioning
    pointers = set()
    while batch:
        batch.step()
        if conditioning.buffer is not None:
            pointers.add(conditioning.buffer.data_ptr())
    assert conditioning.reallocations == 1 and len(pointers) == 1


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


def test_a_real_request_preempts_a_full_batch_of_background_work(tiny_engine: Engine) -> None:
    """The resident engine's scheduler with room for one row, taken by background work: a real request that
    arrives is still seen, the background row is stopped before the next step, and the real one runs."""
    from canvas_ls.engine.batcher import Batcher

    preempted: list[int] = []
    batcher = Batcher(tiny_engine, max_batch=1, on_preempt=lambda: preempted.append(1))
    endless = {"max_new_tokens": 16, "gap_tokens": 16, "max_steps": 500, "stability_threshold": 1000,
               "confidence_threshold": 1e-9}  # fmt: skip
    started = threading.Event()
    background = batcher.submit(InfillRequest("def f(x):\n    return ", "\n", endless, threading.Event(),
                                              on_step=lambda view: started.set(), background=True))  # fmt: skip
    assert started.wait(60)  # it is denoising, alone in the batch
    real = batcher.submit(InfillRequest("def g(y):\n    return ", "\n", {"max_steps": 2}, threading.Event()))
    assert not isinstance(real.result(timeout=60), InfillCancelled)
    assert isinstance(background.result(timeout=60), InfillCancelled) and preempted == [1]
