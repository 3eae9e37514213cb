"""The clamped suffix head's keys and values kept between full steps (`suffix_refresh`, engine/suffix_kv.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from canvas_ls.engine import Engine
from canvas_ls.engine.elementwise import eager_logits
from canvas_ls.engine.engine import InfillRequest
from canvas_ls.engine.regions import Hole
from canvas_ls.engine.settings import InfillSettings, SettingsError
from tests.test_batching import PREFIXES, SUFFIXES
from tests.test_canvas import PREFIX, SUFFIX, decoder_forwards

GAP, HEAD = 8, 12
NEVER_STABLE = {"gap_tokens": GAP, "suffix_head_tokens": HEAD, "max_new_tokens": GAP, "stability_threshold": 100}


def forwards(engine: Engine, settings: dict[str, Any], prefix: str = PREFIX, suffix: str = SUFFIX
             ) -> tuple[list[tuple[dict[str, Any], torch.Tensor]], Any]:  # fmt: skip
    """Each decoder forward's inputs (the tensors cloned) and logits, and the result."""
    seen: list[tuple[dict[str, Any], torch.Tensor]] = []

    def record(inputs: dict[str, Any], logits: torch.Tensor) -> torch.Tensor:
        kept = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        seen.append((kept, logits.clone()))
        return logits

    with decoder_forwards(record):
        result = engine.infill(prefix, suffix, settings)
    return seen, result


def test_full_steps_every_n_and_the_gap_alone_between(tiny_engine_fp32: Engine) -> None:
    seen, result = forwards(tiny_engine_fp32, {**NEVER_STABLE, "max_steps": 7, "suffix_refresh": 3})
    assert result.steps == 7
    assert [inputs["decoder_input_ids"].shape[1] for inputs, _ in seen] == [20, 8, 8, 20, 8, 8, 20]
    full, gap_only = seen[0][0], seen[1][0]
    # the gap-only step reads the prefix's cache and the suffix head's 12 recorded slots after it, at their positions
    assert gap_only["decoder_position_ids"].tolist() == full["decoder_position_ids"][:, :GAP].tolist()
    for layer, before in zip(gap_only["cache"].layers, full["cache"].layers, strict=True):
        assert layer.keys.shape[2] == before.keys.shape[2] + HEAD
        assert torch.equal(layer.keys[:, :, : before.keys.shape[2]], before.keys)


def test_the_recording_leaves_the_attention_layers_as_they_were(tiny_engine_fp32: Engine) -> None:
    """The wrappers that record are on the layers for the recording forward only: a compiled graph traced later (the
    compiling child's) must not meet them, nor the layers of a process that never recorded."""
    layers = tiny_engine_fp32.loaded.model.model.decoder.layers
    seen, _ = forwards(tiny_engine_fp32, {**NEVER_STABLE, "max_steps": 3, "suffix_refresh": 2})
    assert [inputs["decoder_input_ids"].shape[1] for inputs, _ in seen] == [20, 8, 20]
    assert all("append_to_cache" not in layer.self_attn.__dict__ for layer in layers)


def test_every_step_computes_the_whole_canvas_by_default(tiny_engine_fp32: Engine) -> None:
    assert InfillSettings().suffix_refresh == 1
    seen, _ = forwards(tiny_engine_fp32, {**NEVER_STABLE, "max_steps": 4})
    assert [inputs["decoder_input_ids"].shape[1] for inputs, _ in seen] == [20] * 4


def test_a_gap_only_forward_is_the_full_forward_while_the_gap_is_the_same(tiny_engine_fp32: Engine) -> None:
    """The recorded keys and values are the clamped slots' own: the gap alone, given the gap the full step saw,
    gets the logits the full step gave it (the suffix head attended to that very gap)."""
    model = tiny_engine_fp32.loaded.model
    seen, _ = forwards(tiny_engine_fp32, {**NEVER_STABLE, "max_steps": 2, "suffix_refresh": 2, "self_condition": "off"})
    (full, full_logits), (gap_only, _) = seen
    again = {**gap_only, "decoder_input_ids": full["decoder_input_ids"][:, :GAP]}
    with torch.inference_mode():
        logits = eager_logits(model, again)
    torch.testing.assert_close(logits, full_logits[:, :GAP], atol=1e-4, rtol=1e-4)


def test_a_new_canvas_records_again(tiny_engine_fp32: Engine) -> None:
    """An answer that fills its gap continues in a next canvas: its suffix head sits at new positions, so that
    canvas's first step computes it whole."""
    settings = {**NEVER_STABLE, "max_new_tokens": 2 * GAP, "max_steps": 3, "suffix_refresh": 4, "min_new_tokens": 16}
    seen, result = forwards(tiny_engine_fp32, settings)
    assert result.canvases == 2
    assert [inputs["decoder_input_ids"].shape[1] for inputs, _ in seen] == [20, 8, 8, 20, 8, 8]
    assert seen[3][0]["decoder_position_ids"][0, 0] == seen[0][0]["decoder_position_ids"][0, 0] + GAP


def test_jobs_of_either_kind_share_a_forward_and_answer_as_alone(tiny_engine_fp32: Engine) -> None:
    engine = tiny_engine_fp32
    settings = [{**NEVER_STABLE, "max_steps": 5, "seed": seed, "suffix_refresh": refresh}
                for seed, refresh in ((1, 1), (2, 2), (3, 3))]  # fmt: skip
    alone = [engine.infill(p, s, o) for p, s, o in zip(PREFIXES, SUFFIXES, settings, strict=True)]
    together = engine.infill_batch(
        [InfillRequest(p, s, o) for p, s, o in zip(PREFIXES, SUFFIXES, settings, strict=True)]
    )
    for single, batched in zip(alone, together, strict=True):
        assert batched.tokens == single.tokens
        assert batched.confidence == pytest.approx(single.confidence, abs=1e-4)


def test_a_fill_of_several_holes_computes_every_slot_every_step(tiny_engine_fp32: Engine) -> None:
    widths: list[int] = []
    with decoder_forwards(lambda inputs, logits: widths.append(inputs["decoder_input_ids"].shape[1]) or logits):
        tiny_engine_fp32.fill("def f(a, b):\n    x = ", [Hole(), "\n    y = ", Hole()], "\n    return x + y\n",
                              {"max_steps": 4, "stability_threshold": 100, "suffix_refresh": 2})  # fmt: skip
    # each forward the whole canvas: wider only where a gap that filled without an EOS grew and the canvas re-ran
    assert len(widths) >= 4 and widths == sorted(widths) and widths.count(widths[0]) == 4


@pytest.mark.parametrize("value", [0, -1, 1.5, "2"])
def test_suffix_refresh_is_a_positive_integer(value: Any) -> None:
    with pytest.raises(SettingsError, match="suffix_refresh"):
        InfillSettings().merged({"suffix_refresh": value})


def test_sparse_self_conditioning_feeds_the_gap_alone(tiny_model_dir: Any) -> None:
    """A CPU's int8 model conditions on soft embeddings kept per canvas slot: a gap-only step's block is handed its
    gap slots' (the buffer keeps the clamped slots' for the next full step), a full step's every slot's."""
    from canvas_ls.engine.conditioning import SoftInput

    engine = Engine.load(str(tiny_model_dir), "cpu", quantize="int8-dynamic")
    block = engine.loaded.model.model.decoder.self_conditioning
    SoftInput.of(engine.loaded.model)  # the engine's hook first, then the test's
    fed: list[tuple[int, bool]] = []  # the signal the block reads (after the engine's own hook): slots, any set
    handle = block.register_forward_pre_hook(lambda module, args: fed.append((args[1].shape[1], bool(args[1].any()))))
    try:
        seen, result = forwards(engine, {**NEVER_STABLE, "max_steps": 4, "suffix_refresh": 2})
    finally:
        handle.remove()
    assert [inputs["decoder_input_ids"].shape[1] for inputs, _ in seen] == [20, 8, 20, 8]
    assert fed == [(20, False), (8, True), (20, True), (8, True)]
    assert result.steps == 4
