"""The denoising loop's invariants, on a tiny random model (CPU, seconds)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import pytest
import torch

from canvas_ls.engine import Engine, InfillCancelled, compiled
from canvas_ls.engine.canvas import StepView

PREFIX = "def mean(values):\n    total = sum(values)\n"  # ends at a token boundary: nothing to heal
SUFFIX = "\n\n\ndef mode(values):\n    counts = Counter(values)\n    return counts.most_common(1)[0][0]\n"
EOS = 1


@contextmanager
def decoder_forwards(wrap: Callable[[dict[str, Any], torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """Every eager decoder forward's logits (`compiled.eager_logits`, what a step reads) passed through
    `wrap(inputs, logits)`: what the tests see of, or script into, each forward."""
    real = compiled.eager_logits
    compiled.eager_logits = lambda model, inputs: wrap(inputs, real(model, inputs))
    try:
        yield
    finally:
        compiled.eager_logits = real


@contextmanager
def patched_logits(engine: Engine, logits_at: Callable[[int], torch.Tensor]) -> Iterator[None]:
    """Patch the decoder so that the canvas slot at position p gets the logits `logits_at(p)` ([V]), and nothing
    else moves them (the token cache of the document is off)."""
    settings = engine.settings
    engine.settings = replace(settings, workspace_cache=0.0)

    def scripted(inputs: dict[str, Any], logits: torch.Tensor) -> torch.Tensor:
        positions = inputs["decoder_position_ids"]  # [B, L]: every row of a batched forward
        return torch.stack([torch.stack([logits_at(int(p)) for p in row]) for row in positions]).to(logits)

    try:
        with decoder_forwards(scripted):
            yield
    finally:
        engine.settings = settings


def one_hot(token: int, vocab: int = 512, low: float = -30.0, high: float = 30.0) -> torch.Tensor:
    logits = torch.full((vocab,), low)
    logits[token] = high
    return logits


@contextmanager
def confident(engine: Engine, target: Callable[[int], int]) -> Iterator[None]:
    """Patch the model so that each canvas position p predicts token target(p) with near-one-hot logits."""
    vocab = engine.loaded.model.config.text_config.vocab_size
    with patched_logits(engine, lambda p: one_hot(target(p), vocab)):
        yield


def prefix_len(engine: Engine) -> int:
    return len(engine.tokenizer.encode(PREFIX, add_special_tokens=False)) + 1  # + BOS


def test_suffix_head_is_clamped_after_every_step(tiny_engine: Engine) -> None:
    """What the model is given at every forward: the gap slots, then the suffix head's own tokens, unchanged."""
    gap = 8
    head = tiny_engine.tokenizer.encode(SUFFIX, add_special_tokens=False)[:12]
    inputs: list[torch.Tensor] = []
    with decoder_forwards(lambda given, logits: inputs.append(given["decoder_input_ids"].clone()) or logits):
        result = tiny_engine.infill(PREFIX, SUFFIX, {"gap_tokens": gap, "suffix_head_tokens": 12, "max_steps": 6,
                                                     "max_new_tokens": 16})  # fmt: skip
    assert result.suffix_head_tokens == 12
    assert len(inputs) == result.forward_passes > 1
    for given in inputs:
        assert given.shape == (1, gap + 12)
        assert given[0, gap:].tolist() == head
    assert any(not torch.equal(inputs[0][0, :gap], later[0, :gap]) for later in inputs[1:])  # the gap does change


def test_text_is_cut_at_the_first_eos(tiny_engine: Engine) -> None:
    start = prefix_len(tiny_engine)
    pattern = {0: 40, 1: 41, 2: EOS, 3: 42, 4: 43}  # offset in the gap -> token; then EOS fill

    with confident(tiny_engine, lambda p: pattern.get(p - start, EOS)):
        result = tiny_engine.infill(PREFIX, SUFFIX, {"gap_tokens": 8})
    assert result.tokens == [40, 41]
    assert result.text == tiny_engine.tokenizer.decode([40, 41])
    assert result.stop_reason == "eos"
    assert len(result.confidence) == 2 and all(c > 0.99 for c in result.confidence)


def test_adaptive_stopping_ends_before_the_step_cap(tiny_engine: Engine) -> None:
    start = prefix_len(tiny_engine)
    with confident(tiny_engine, lambda p: 50 if p - start < 3 else EOS):
        result = tiny_engine.infill(PREFIX, SUFFIX, {"gap_tokens": 8, "max_steps": 12})
    assert result.canvas_stops == ["converged"]
    assert result.steps < 12
    assert result.tokens == [50, 50, 50]
    assert result.tokens_per_forward == pytest.approx(4 / result.steps, abs=1e-3)


def test_a_full_gap_continues_in_the_next_canvas(tiny_engine: Engine) -> None:
    start = prefix_len(tiny_engine)
    # 11 answer tokens, then EOS: the 8-slot gap fills, a second canvas finishes the answer.
    with confident(tiny_engine, lambda p: 60 + (p - start) if p - start < 11 else EOS):
        result = tiny_engine.infill(PREFIX, SUFFIX, {"gap_tokens": 8, "max_new_tokens": 64})
    assert result.tokens == list(range(60, 71))
    assert result.canvases == 2
    assert result.stop_reason == "eos"


def test_max_new_tokens_bounds_an_answer_that_never_ends(tiny_engine: Engine) -> None:
    with confident(tiny_engine, lambda p: 70):
        result = tiny_engine.infill(PREFIX, SUFFIX, {"gap_tokens": 8, "max_new_tokens": 20})
    assert result.tokens == [70] * 20
    assert result.canvases == 3
    assert result.stop_reason == "max_tokens"


def test_same_seed_same_output(tiny_engine: Engine) -> None:
    settings = {"gap_tokens": 8, "max_new_tokens": 16, "max_steps": 5}
    first = tiny_engine.infill(PREFIX, SUFFIX, {**settings, "seed": 7})
    again = tiny_engine.infill(PREFIX, SUFFIX, {**settings, "seed": 7})
    other = tiny_engine.infill(PREFIX, SUFFIX, {**settings, "seed": 8})
    assert first.tokens == again.tokens and first.confidence == again.confidence
    assert other.tokens != first.tokens  # a random model, so different noise gives a different canvas


@pytest.mark.parametrize("k", [1, 3])
def test_cancel_after_step_k_stops_by_step_k_plus_1(tiny_engine: Engine, k: int) -> None:
    cancel = threading.Event()
    steps: list[int] = []

    def on_step(view: StepView) -> None:
        steps.append(view.step)
        if view.step == k:
            cancel.set()

    with pytest.raises(InfillCancelled) as info:
        tiny_engine.infill(PREFIX, SUFFIX, {"max_steps": 10, "gap_tokens": 8}, cancel=cancel, on_step=on_step)
    assert info.value.steps == k
    assert steps == list(range(1, k + 1))


def test_prompt_layout_puts_the_suffix_in_the_encoder(tiny_engine: Engine) -> None:
    seen: list[StepView] = []
    result = tiny_engine.infill(
        PREFIX, SUFFIX, {"layout": "prompt", "gap_tokens": 8, "max_new_tokens": 8, "max_steps": 3}, on_step=seen.append
    )
    assert result.layout == "prompt"
    assert result.suffix_head_tokens == 0
    assert all(view.canvas.shape == (8,) for view in seen)  # the canvas holds only the middle
    suffix_len = len(tiny_engine.tokenizer.encode(SUFFIX, add_special_tokens=False))
    assert result.prefix_tokens > prefix_len(tiny_engine) + suffix_len  # prefix, suffix and the instruction


def test_empty_prefix_and_suffix(tiny_engine: Engine) -> None:
    result = tiny_engine.infill("", "", {"gap_tokens": 4, "max_new_tokens": 4, "max_steps": 2})
    assert result.prefix_tokens == 1 and result.suffix_head_tokens == 0
    assert len(result.tokens) <= 4


def test_model_settings_come_from_canvas_ls_json(tiny_engine: Engine) -> None:
    assert tiny_engine.settings.layout == "canvas"  # the tiny model's canvas_ls.json says so


def test_left_to_right_baseline_commits_one_token_per_forward(tiny_engine: Engine) -> None:
    start = prefix_len(tiny_engine)
    with confident(tiny_engine, lambda p: 80 + (p - start) if p - start < 5 else EOS):
        parallel = tiny_engine.infill(PREFIX, SUFFIX, {"gap_tokens": 8})
        baseline = tiny_engine.infill(PREFIX, SUFFIX, {"gap_tokens": 8, "order": "left_to_right"})
    assert baseline.tokens == parallel.tokens == list(range(80, 85))
    assert baseline.forward_passes == 6  # five tokens and the EOS, one per forward
    assert parallel.forward_passes < baseline.forward_passes


def test_single_line_stops_at_the_canvas_that_breaks_the_line(tiny_engine: Engine) -> None:
    start = prefix_len(tiny_engine)
    newline = next(i for i in range(6, 300) if "\n" in tiny_engine.tokenizer.decode([i]))
    # No EOS ever; a line break at gap offset 10 (in the second 8-slot canvas).
    with confident(tiny_engine, lambda p: newline if p - start == 10 else 70):
        multi = tiny_engine.infill(PREFIX, SUFFIX, {"gap_tokens": 8, "max_new_tokens": 40})
        single = tiny_engine.infill(PREFIX, SUFFIX, {"gap_tokens": 8, "max_new_tokens": 40, "single_line": True})
    assert multi.canvases == 5 and multi.stop_reason == "max_tokens"
    assert single.canvases == 2 and newline in single.tokens


def test_min_new_tokens_bars_eos_from_the_first_slots(tiny_engine: Engine) -> None:
    """A model sure the gap is empty (EOS everywhere, token 7 its second choice) still answers min_new_tokens."""
    sure_empty = one_hot(EOS, tiny_engine.loaded.model.config.text_config.vocab_size)
    sure_empty[7] = 10.0
    with patched_logits(tiny_engine, lambda p: sure_empty):
        empty = tiny_engine.infill(PREFIX, SUFFIX, {"gap_tokens": 8, "max_steps": 4})
        forced = tiny_engine.infill(PREFIX, SUFFIX, {"gap_tokens": 8, "max_steps": 4, "min_new_tokens": 2})
    assert empty.tokens == [] and empty.stop_reason == "eos"
    assert forced.tokens == [7, 7] and forced.stop_reason == "eos"
    assert all(0.0 <= c <= 1.0 for c in forced.confidence)


def test_answer_scoped_stopping_ignores_the_eos_fill(tiny_engine: Engine) -> None:
    """Answer [40, 41] then EOS, all sure; the slots after the EOS undecided (flat logits). Waiting for the whole
    gap runs to the step cap; waiting for the answer stops once it is stable and confident."""
    start = prefix_len(tiny_engine)
    vocab = tiny_engine.loaded.model.config.text_config.vocab_size
    answer_then_eos = {0: 40, 1: 41, 2: EOS}

    def logits_at(position: int) -> torch.Tensor:
        offset = position - start
        return one_hot(answer_then_eos[offset], vocab) if offset < 3 else torch.zeros(vocab)  # after: uniform

    settings = {"gap_tokens": 8, "max_steps": 10}
    with patched_logits(tiny_engine, logits_at):
        whole = tiny_engine.infill(PREFIX, "", {**settings, "stop_scope": "gap"})
        answer = tiny_engine.infill(PREFIX, "", settings)  # the default
    assert whole.tokens == answer.tokens == [40, 41]
    assert whole.steps == 10 and whole.canvas_stops == ["step_cap"]
    assert answer.steps == 2 and answer.canvas_stops == ["converged"]


# -- token healing -----------------------------------------------------------------------------------------------

HEAL_PREFIX = "def mean(values):\n    total = "  # ends in ' =' ' ' where the model saw ' =' ' sum'


def test_token_healing_cuts_the_prefix_back_and_constrains_the_first_slot(tiny_engine: Engine) -> None:
    """The lone ' ' token is cut from the encoder's ids; the answer's first token re-writes it (the model's favourite
    there, token 40, does not start with a space, so the healed answer takes the best token that does) and the text
    at the cursor leaves it out."""
    tokenizer = tiny_engine.tokenizer
    spaced = next(i for i in range(6, 500) if tokenizer.decode([i]).startswith(" ") and len(tokenizer.decode([i])) > 1)
    vocab = tiny_engine.loaded.model.config.text_config.vocab_size
    logits = one_hot(40, vocab)
    logits[spaced] = 20.0  # second choice
    logits[EOS] = 10.0
    settings = {"gap_tokens": 8, "max_new_tokens": 1, "max_steps": 4}
    with patched_logits(tiny_engine, lambda p: logits):
        healed = tiny_engine.infill(HEAL_PREFIX, "\n", settings)
        plain = tiny_engine.infill(HEAL_PREFIX, "\n", {**settings, "token_healing": False})
    plain_ids = tokenizer.encode(HEAL_PREFIX, add_special_tokens=False)
    assert tokenizer.decode(plain_ids[-1:]) == " "  # the premise: a lone space token at the end
    assert plain.healed == "" and plain.tokens == [40] and plain.prefix_tokens == len(plain_ids) + 1
    assert healed.healed == " " and healed.tokens == [spaced]
    assert healed.prefix_tokens == len(tokenizer.encode(HEAL_PREFIX.rstrip(" "), add_special_tokens=False)) + 1
    assert healed.text == tokenizer.decode([spaced])[1:]  # what goes at the cursor, after the user's space


def test_token_healing_still_lets_the_model_answer_nothing(tiny_engine: Engine) -> None:
    with confident(tiny_engine, lambda p: EOS):
        result = tiny_engine.infill(HEAL_PREFIX, "\n", {"gap_tokens": 8, "max_steps": 4})
    assert result.tokens == [] and result.text == "" and result.healed == ""


@pytest.mark.parametrize("prefix", ["x = f(", "x = 1\n", "if x:\n\t", "", "s = 'é'"])
def test_token_healing_leaves_prefixes_that_end_at_a_boundary(tiny_engine: Engine, prefix: str) -> None:
    result = tiny_engine.infill(prefix, "\n", {"gap_tokens": 4, "max_steps": 2, "min_new_tokens": 1})
    assert result.healed == "" and result.text == tiny_engine.tokenizer.decode(result.tokens, skip_special_tokens=True)
    assert result.prefix_tokens == len(tiny_engine.tokenizer.encode(prefix, add_special_tokens=False)) + 1


def test_streamed_drafts_leave_the_healed_text_out(tiny_engine: Engine) -> None:
    seen: list[StepView] = []
    tiny_engine.infill(HEAL_PREFIX, "\n", {"gap_tokens": 8, "max_steps": 3, "min_new_tokens": 1}, on_step=seen.append)
    assert seen and all(view.healed == " " for view in seen)
    first_canvas = [view for view in seen if view.canvas_index == 0]
    firsts = {tiny_engine.tokenizer.decode(view.argmax[:1].tolist()) for view in first_canvas}
    assert all(text.startswith(" ") for text in firsts)  # the constraint held on the slot the drafts start with


@pytest.mark.parametrize("mode", ["processed", "raw", "off"])
def test_self_conditioning_reads_the_processed_or_the_raw_logits(tiny_engine_fp32: Engine, mode: str) -> None:
    """Step 2 reads step 1's logits: temperature-scaled (transformers' sampler) or as the model gave them (what
    `canvas-ls train` feeds its no-grad pass); or none, every step run as the first."""
    seen: list[tuple[torch.Tensor | None, torch.Tensor]] = []

    def record(inputs: dict[str, Any], logits: torch.Tensor) -> torch.Tensor:
        given = inputs.get("self_conditioning_logits")  # the batch's buffer: the next step writes over it
        seen.append((None if given is None else given.clone(), logits.clone()))
        return logits

    settings = {"gap_tokens": 8, "max_steps": 4, "t_min": 0.2, "t_max": 0.6, "stability_threshold": 3}
    with decoder_forwards(record):
        tiny_engine_fp32.infill(PREFIX, SUFFIX, {**settings, "self_condition": mode})
    assert seen[0][0] is None and len(seen) >= 2
    if mode == "off":
        assert all(given is None for given, _ in seen)
        return
    first_logits, second_input = seen[0][1], seen[1][0]
    temperature = 0.6  # the first step runs at t_max
    torch.testing.assert_close(second_input, first_logits / temperature if mode == "processed" else first_logits)


@pytest.mark.parametrize(
    ("prefix", "cut"), [("x = ", " "), ("def f():\n    ", " "), ("    if x:\n        ", " "), ("foo(a, ", " ")]
)
def test_token_healing_finds_the_boundary_a_following_word_would_use(
    tiny_engine: Engine, prefix: str, cut: str
) -> None:
    """The text cut is what a word typed next would take into its own token; the rest is tokenized alone."""
    assert tiny_engine.healing.cut(prefix) == cut
    word = tiny_engine.tokenizer.encode(prefix + "return", add_special_tokens=False)
    kept = tiny_engine.tokenizer.encode(prefix[: -len(cut)], add_special_tokens=False)
    assert word[: len(kept)] == kept  # the kept ids are the ones the prefix has when a word follows
