"""Several holes in one canvas, and span rewrites (`Engine.fill`), on the tiny random model."""

from __future__ import annotations

import threading

import pytest
import torch

from canvas_ls.engine import Engine, FillError, Hole, InfillCancelled
from canvas_ls.engine.canvas import CanvasJob, DenoisingBatch, GapSpec, StepView
from canvas_ls.engine.engine import InfillRequest
from canvas_ls.engine.prefix_cache import PrefixCache
from tests.test_canvas import EOS, PREFIX, SUFFIX, confident, prefix_len

MIDDLE = "    return total / len(values)\n\n\ndef spread(values):\n"
PLAIN = {"gap_tokens": 8, "max_new_tokens": 16, "max_steps": 6, "token_healing": False}


def middle_ids(engine: Engine) -> list[int]:
    return engine.tokenizer.encode(MIDDLE, add_special_tokens=False)


def test_one_hole_is_the_single_infill(tiny_engine_fp32: Engine) -> None:
    """Same answers under a seed as `infill`, healing included, alone and batched."""
    for seed in range(4):
        for prefix in (PREFIX, PREFIX + "    total = "):
            settings = {"gap_tokens": 8, "max_new_tokens": 16, "seed": seed}
            single = tiny_engine_fp32.infill(prefix, SUFFIX, settings)
            filled = tiny_engine_fp32.fill(prefix, [Hole()], SUFFIX, settings)
            assert (filled.tokens, filled.steps, filled.text) == (single.tokens, single.steps, single.text)
            assert filled.gaps[0].text == single.text and len(filled.gaps) == 1
    batched = tiny_engine_fp32.infill_batch(
        [InfillRequest(PREFIX, SUFFIX, {"seed": s}, middle=[Hole()]) for s in (1, 2)]
    )
    assert [r.tokens for r in batched] == [tiny_engine_fp32.infill(PREFIX, SUFFIX, {"seed": s}).tokens for s in (1, 2)]


def test_clamped_code_between_holes_never_changes(tiny_engine: Engine) -> None:
    seen: list[StepView] = []
    settings = {**PLAIN, "suffix_head_tokens": 6, "max_new_tokens": 8}  # no hole grows: the layout stays put
    request = InfillRequest(PREFIX, SUFFIX, settings, on_step=seen.append,
                            middle=[Hole(), MIDDLE, Hole()])  # fmt: skip
    result = tiny_engine.run(request)
    middle = middle_ids(tiny_engine)
    head = tiny_engine.tokenizer.encode(SUFFIX, add_special_tokens=False)[:6]
    assert len(seen) == result.steps > 0 and len(result.gaps) == 2
    for view in seen:
        gap1 = 8
        assert view.canvas[gap1 : gap1 + len(middle)].tolist() == middle
        assert view.canvas[-6:].tolist() == head
        assert view.argmax.shape == (16,)  # the gap slots only: 8 + 8


def test_each_hole_ends_at_its_own_eos(tiny_engine: Engine) -> None:
    start = prefix_len(tiny_engine)
    second = start + 8 + len(middle_ids(tiny_engine))
    answer = {start: 40, start + 1: 41, second: 42, second + 1: 43, second + 2: 44}
    with confident(tiny_engine, lambda p: answer.get(p, EOS)):
        result = tiny_engine.fill(PREFIX, [Hole(), MIDDLE, Hole()], SUFFIX, PLAIN)
    assert [gap.tokens for gap in result.gaps] == [[40, 41], [42, 43, 44]]
    assert [gap.stop_reason for gap in result.gaps] == ["eos", "eos"]
    assert result.gaps[1].text == tiny_engine.tokenizer.decode([42, 43, 44])
    assert result.canvas_stops == ["converged"] and result.tokens_per_forward == pytest.approx(7 / result.steps)


def test_a_hole_that_fills_grows_and_the_canvas_reruns(tiny_engine: Engine) -> None:
    start = prefix_len(tiny_engine)
    # The first hole's answer is 11 tokens: its 8 slots fill without an EOS, so it grows to 16 and the canvas
    # re-runs; the second hole (after the grown first one, its positions shift) answers 2 tokens.
    middle = len(middle_ids(tiny_engine))

    def target(p: int) -> int:
        offset = p - start
        if offset < 11:
            return 60 + offset
        second = p - (start + 16 + middle)
        return 80 + second if 0 <= second < 2 else EOS

    with confident(tiny_engine, target):
        result = tiny_engine.fill(PREFIX, [Hole(), MIDDLE, Hole()], SUFFIX, PLAIN)
    assert result.canvases == 2
    assert result.gaps[0].tokens == list(range(60, 71)) and result.gaps[0].stop_reason == "eos"
    assert result.gaps[1].tokens == [80, 81]


def test_a_hole_past_its_budget_is_truncated(tiny_engine: Engine) -> None:
    with confident(tiny_engine, lambda p: 70):
        result = tiny_engine.fill(PREFIX, [Hole(), MIDDLE, Hole()], SUFFIX, {**PLAIN, "max_new_tokens": 12})
    assert [len(gap.tokens) for gap in result.gaps] == [12, 12]  # 8, then grown by 4 to the per-hole cap
    assert [gap.stop_reason for gap in result.gaps] == ["truncated", "truncated"]
    assert result.canvases == 2
    small = tiny_engine.fill(PREFIX, [Hole(), MIDDLE, Hole()], SUFFIX, {**PLAIN, "fill_tokens": 20})
    assert sum(len(gap.tokens) for gap in small.gaps) <= 20


def test_multi_hole_fill_batched_equals_alone(tiny_engine_fp32: Engine) -> None:
    requests = [
        InfillRequest(PREFIX, SUFFIX, {**PLAIN, "seed": 3}, middle=[Hole(), MIDDLE, Hole()]),
        InfillRequest(PREFIX, SUFFIX, {**PLAIN, "seed": 4}),
        InfillRequest(PREFIX, SUFFIX, {**PLAIN, "seed": 5}, middle=[Hole("return total", 0.5)]),
    ]
    batched = tiny_engine_fp32.infill_batch(requests)
    alone = [tiny_engine_fp32.run(request) for request in requests]
    assert [r.gaps for r in batched] == [r.gaps for r in alone]
    assert [r.steps for r in batched] == [r.steps for r in alone]


def test_rewrite_starts_from_the_span_with_a_share_renoised(tiny_engine: Engine) -> None:
    span = tiny_engine.tokenizer.encode("return total * 2", add_special_tokens=False)
    model = tiny_engine.loaded.model
    for strength in (0.25, 0.5, 0.75):
        params = tiny_engine.prepare(InfillRequest(PREFIX, SUFFIX, PLAIN)).params
        spec = GapSpec(len(span) + 4, tuple(span), strength)
        job = CanvasJob(model, [2, 40, 41], [], params, tiny_engine.stop_ids, segments=[spec])
        start = job.gap_canvas[0].tolist()
        init = [*span, EOS, EOS, EOS, EOS]
        kept = sum(a == b for a, b in zip(start, init, strict=True))
        renoised = round(strength * len(init))
        assert len(init) - renoised <= kept <= len(init) - renoised + 1  # noise may hit the same token by chance
    # strength 1 is a plain hole: the span's text is ignored, the answer is the plain hole's.
    plain = tiny_engine.fill(PREFIX, [Hole()], SUFFIX, {**PLAIN, "seed": 9})
    full = tiny_engine.fill(PREFIX, [Hole("return total * 2", 1.0)], SUFFIX, {**PLAIN, "seed": 9})
    assert full.tokens == plain.tokens


def test_a_rewrite_keeps_its_spans_tokens_where_a_step_accepts_none(tiny_engine: Engine) -> None:
    """A rewrite's kept slots hold the span's text through the steps (not only the first forward): a step that
    accepts no token there puts the span's token back instead of noise."""
    span = tiny_engine.tokenizer.encode("return total * 2", add_special_tokens=False)
    model = tiny_engine.loaded.model
    params = tiny_engine.prepare(InfillRequest(PREFIX, SUFFIX, PLAIN)).params
    job = CanvasJob(model, [2, 40, 41], [], params, tiny_engine.stop_ids, segments=[GapSpec(len(span) + 4,
                    tuple(span), 0.5)])  # fmt: skip
    assert job.anchor is not None
    kept, ids = job.anchor
    assert int(kept.sum()) == len(span) + 4 - round(0.5 * (len(span) + 4))
    batch = DenoisingBatch(model, pad_id=tiny_engine.stop_ids[-1])
    batch.add(job)
    held = 0
    while not job.done:
        batch.step()
        if job.done or job.anchor is None:  # done, or re-run from its drafts after the hole grew (anchors go)
            break
        unaccepted = kept & ~job.sampler.accepted_token_mask
        assert torch.equal(job.gap_canvas[unaccepted], ids[unaccepted])
        held += int(unaccepted.sum())
    assert held > 0 and job.out.steps > 1
    plain = CanvasJob(model, [2, 40, 41], [], params, tiny_engine.stop_ids, segments=[GapSpec(8)])
    assert plain.anchor is None  # a hole has nothing to keep


def test_a_confident_model_keeps_a_lightly_renoised_span(tiny_engine: Engine) -> None:
    """A model that predicts the span restores it: the rewrite's canvas starts there and ends there."""
    span = tiny_engine.tokenizer.encode("return total * 2", add_special_tokens=False)
    start = prefix_len(tiny_engine)
    with confident(tiny_engine, lambda p: span[p - start] if 0 <= p - start < len(span) else EOS):
        result = tiny_engine.fill(PREFIX, [Hole("return total * 2", 0.3)], SUFFIX, PLAIN)
    assert result.gaps[0].text == "return total * 2"


def test_a_fill_reuses_the_prefix_kv_of_the_last_one(tiny_engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    # an empty prefix cache of the engine's own size (the session's engine may hold this prefix from other tests)
    monkeypatch.setattr(tiny_engine, "prefix_cache", PrefixCache(tiny_engine.prefix_cache.max_bytes))
    long_prefix = PREFIX * 12  # past the prefix cache's grid
    first = tiny_engine.fill(long_prefix, [Hole(), MIDDLE, Hole()], SUFFIX, PLAIN)
    again = tiny_engine.fill(long_prefix + "    x = 1\n", [Hole(), MIDDLE, Hole()], SUFFIX, PLAIN)
    assert first.prefix_reused_tokens == 0
    assert again.prefix_reused_tokens >= 64


def test_cancelled_mid_fill(tiny_engine: Engine) -> None:
    cancel = threading.Event()

    def stop_after_two(view: StepView) -> None:
        if view.step == 2:
            cancel.set()

    request = InfillRequest(PREFIX, SUFFIX, {**PLAIN, "max_steps": 8}, cancel, stop_after_two, [Hole(), MIDDLE, Hole()])
    with confident(tiny_engine, lambda p: 70), pytest.raises(InfillCancelled) as stopped:
        tiny_engine.run(request)
    assert stopped.value.steps == 2


@pytest.mark.parametrize(
    ("middle", "settings", "message"),
    [
        ([MIDDLE], {}, "no hole"),
        ([Hole(), "x", Hole(), "y", Hole()], {"max_holes": 2}, "3 holes, over the limit of 2"),
        ([Hole(), MIDDLE * 40, Hole()], {"max_canvas_tokens": 256}, "over max_canvas_tokens=256"),
        ([Hole(), MIDDLE, Hole()], {"fill_tokens": 10}, "over fill_tokens=10"),
        ([Hole("x", 0.0)], {}, "strength must be in (0, 1]"),
        ([Hole()], {"layout": "prompt"}, "need the 'canvas' layout"),
    ],
)
def test_fills_that_cannot_be_laid_out(tiny_engine: Engine, middle: list, settings: dict, message: str) -> None:
    with pytest.raises(FillError, match=message.replace("(", r"\(").replace("]", r"\]").replace("*", r"\*")):
        tiny_engine.fill(PREFIX, middle, SUFFIX, settings)


def test_each_hole_is_token_healed(tiny_engine: Engine) -> None:
    """A hole after an indentation re-writes it (the first slot must start with the cut text); the answer's text
    leaves it out."""
    result = tiny_engine.fill(PREFIX + "    ", [Hole(), "\n" + MIDDLE + "    ", Hole()], SUFFIX,
                              {"gap_tokens": 8, "min_new_tokens": 1})  # fmt: skip
    for gap in result.gaps:
        first = tiny_engine.tokenizer.decode(gap.tokens[:1])
        assert gap.healed and first.startswith(gap.healed)
        assert gap.text == tiny_engine.tokenizer.decode(gap.tokens).removeprefix(gap.healed)
    assert torch.is_inference_mode_enabled() is False
