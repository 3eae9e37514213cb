"""Infill settings: one frozen dataclass, resolved in layers.

Resolution order, later wins:
  1. the defaults below;
  2. the model's own `generation_config.json` (diffusion knobs a checkpoint was tuned with);
  3. the model folder's `canvas_ls.json` (what we measured for this model: layout, gap size...);
  4. the caller's overrides (CLI flags, LSP configuration).

`InfillSettings.merged` is strict: an unknown key or a value of the wrong type is an error whose message names it,
so a typo in a config file never silently does nothing.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Layout = Literal["canvas", "prompt"]
LAYOUTS: tuple[str, ...] = ("canvas", "prompt")

# The file, inside a model folder, that holds the settings measured for that model.
MODEL_SETTINGS_FILE = "canvas_ls.json"
# Its sections: the infill settings, the display policy (`bench calibrate`), what training recorded
MODEL_SETTINGS_SECTIONS = frozenset({"infill", "display", "trained", "trained_before"})
# How a model's layers' weights load (`engine.quantize`; `--quantize`): here, without torch, for the command line.
QUANTIZE_CHOICES = ("auto", "none", "int8", "int4", "int8-dynamic")


class SettingsError(ValueError):
    """A setting has an unknown name or a bad value."""


@dataclass(frozen=True)
class InfillSettings:
    # "canvas": the suffix head sits inside the canvas, right after the gap, clamped (what our own models learn).
    # "prompt": the suffix goes into the encoder prompt and the canvas holds only the middle; instruct checkpoints
    # were trained on EOS-filled canvases, not on suffixes inside them, so this is the safe default for a model that
    # says nothing (a model's canvas_ls.json says which layout measured better).
    layout: Layout = "prompt"
    # Gap slots per canvas. A model trained for in-place infill writes EOS into the slots it does not need, so this
    # is an upper bound per canvas, not a guess of the answer's length.
    gap_tokens: int = 32
    # How many tokens of the suffix are clamped into the canvas after the gap ("canvas" layout only).
    suffix_head_tokens: int = 16
    # How often a step recomputes the clamped suffix head ("canvas" layout, one gap): every step (1, exact), or every
    # N steps, the steps between computing the gap alone against the suffix head's keys and values of the last full
    # step (`engine/suffix_kv.py`: half the arithmetic of a 16 + 16 canvas's step, answers may differ).
    suffix_refresh: int = 1
    # Bound on the whole answer; past one canvas, the gap continues block by block up to this many tokens.
    max_new_tokens: int = 128
    # The prefix keeps its last this-many tokens (the server picks smarter windows; this is the engine's guard).
    max_prefix_tokens: int = 2048
    # The suffix in the "prompt" layout keeps its first this-many tokens.
    max_suffix_tokens: int = 512
    # Denoising step cap per canvas; adaptive stopping usually ends far earlier.
    max_steps: int = 16
    # EntropyBoundSampler: accept the lowest-entropy tokens while their summed entropy minus the max stays under it.
    entropy_bound: float = 0.1
    # LinearTemperatureScheduleLogitsProcessor: temperature goes from t_max (first step) to t_min (last).
    t_min: float = 0.4
    t_max: float = 0.8
    # StableAndConfidentStoppingCriteria: the argmax canvas unchanged for this many steps...
    stability_threshold: int = 1
    # ...and the mean entropy of the (temperature-scaled) gap logits below this.
    confidence_threshold: float = 0.005
    # Adaptive stopping waits for "answer": the slots up to and including the first EOS (the EOS fill after it may
    # still flicker), or "gap": every gap slot stable and confident (transformers' rule). Measured on 200 HumanEval
    # single-line tasks with the default model: the same 200 answers in 10% fewer steps.
    stop_scope: Literal["gap", "answer"] = "answer"
    # Seed of the canvas noise and the samples; the same seed gives the same output. None: fresh noise each time.
    seed: int | None = 0
    # "diffusion": parallel entropy-bound decoding. "left_to_right": one token per forward, the autoregressive-
    # equivalent baseline that `canvas-ls bench infill` measures the parallel decode against.
    order: Literal["diffusion", "left_to_right"] = "diffusion"
    # The answer has at least this many tokens: EOS and pad are barred from the first canvas's first slots. Where
    # the user asked for a completion (an empty line, a finished statement), an empty answer shows nothing.
    min_new_tokens: int = 0
    # What the next step's self-conditioning reads: "processed" logits (temperature-scaled, as transformers'
    # DiffusionGemma sampler feeds them), the "raw" logits (what `canvas-ls train` feeds its no-grad pass), or
    # nothing ("off": every step as the first, which half of `canvas-ls train`'s steps are; no softmax and
    # probabilities @ embeddings over the canvas: an 8-row step 5-10% cheaper on the 2-core CPU, but more steps
    # per answer and lower edit similarity with the default model, so not the default).
    self_condition: Literal["processed", "raw", "off"] = "processed"
    # Token healing ("canvas" layout): a prefix that ends inside what would be one token (typically the space or
    # indentation before the next word: "x = " tokenizes as ' =' ' ' where the model saw ' =' ' y') is cut back to
    # the token boundary, and the first gap slot may only hold tokens that re-write the cut text (or EOS).
    token_healing: bool = True
    # Reuse (and keep) the encoder KV of earlier prefixes this one extends. Off: the whole prefix is encoded afresh
    # (what `bench engine` measures a keystroke's reuse against, on the very same request).
    reuse_prefix: bool = True
    # Weight of the token n-gram cache of the user's code in a gap slot's distribution where the slot's context is
    # known (`engine.token_cache`: the request's own document, and its workspace's files where the request names a
    # workspace). 0 turns it off.
    workspace_cache: float = 1.0
    # The caller keeps only the first line (an LSP single-line completion): stop once the answer has a line break.
    single_line: bool = False
    # Several holes in one canvas (`Engine.fill`): at most this many holes per request...
    max_holes: int = 8
    # ...at most this many gap slots over all of them (a gap that fills without an EOS grows up to max_new_tokens,
    # within this budget)...
    fill_tokens: int = 256
    # ...and at most this many canvas positions in all (gaps plus the clamped code between them and the suffix head).
    max_canvas_tokens: int = 1024
    # "prompt" layout template, with {prefix} and {suffix}. "auto": the tokenizer's FIM tokens if it has them,
    # else its chat template with an instruction, else a plain instruction.
    prompt_template: str = "auto"

    def merged(self, overrides: dict[str, Any] | None) -> InfillSettings:
        """A copy with `overrides` applied; None values are ignored, unknown keys or bad types raise."""
        if not overrides:
            return self
        fields = {f.name: f for f in dataclasses.fields(self)}
        changes: dict[str, Any] = {}
        for key, value in overrides.items():
            if value is None:
                continue
            if key not in fields:
                raise SettingsError(f"unknown infill setting '{key}' (known: {', '.join(sorted(fields))})")
            changes[key] = _coerce(key, value, getattr(self, key))
        result = dataclasses.replace(self, **changes)
        result.validate()
        return result

    def validate(self) -> None:
        if self.stop_scope not in ("gap", "answer"):
            raise SettingsError(f"stop_scope must be 'gap' or 'answer', got '{self.stop_scope}'")
        if self.order not in ("diffusion", "left_to_right"):
            raise SettingsError(f"order must be 'diffusion' or 'left_to_right', got '{self.order}'")
        if self.self_condition not in ("processed", "raw", "off"):
            raise SettingsError(f"self_condition must be 'processed', 'raw' or 'off', got '{self.self_condition}'")
        if self.layout not in LAYOUTS:
            raise SettingsError(f"layout must be one of {LAYOUTS}, got '{self.layout}'")
        for name in (
            "gap_tokens",
            "max_new_tokens",
            "max_prefix_tokens",
            "max_steps",
            "max_holes",
            "fill_tokens",
            "max_canvas_tokens",
            "suffix_refresh",
        ):
            if getattr(self, name) < 1:
                raise SettingsError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("suffix_head_tokens", "max_suffix_tokens", "stability_threshold", "min_new_tokens"):
            if getattr(self, name) < 0:
                raise SettingsError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.entropy_bound <= 0 or self.confidence_threshold <= 0:
            raise SettingsError("entropy_bound and confidence_threshold must be > 0")
        if not 0 <= self.workspace_cache <= 1:
            raise SettingsError(f"workspace_cache must be in [0, 1], got {self.workspace_cache}")
        if not 0 <= self.t_min < self.t_max:  # the last step runs at t_min + (t_max - t_min) / max_steps > 0
            raise SettingsError(f"need 0 <= t_min < t_max, got t_min={self.t_min}, t_max={self.t_max}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _coerce(key: str, value: Any, current: Any) -> Any:
    """Accept ints for floats (JSON has one number type); refuse anything else of the wrong type."""
    if key == "seed":
        if isinstance(value, bool) or not isinstance(value, int):
            raise SettingsError(f"seed must be an integer or null, got {value!r}")
        return value
    expected = type(current)
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, bool) != (expected is bool) or not isinstance(value, expected):
        raise SettingsError(f"{key} must be {expected.__name__}, got {value!r}")
    return value


# generation_config.json name -> our name, for the diffusion knobs a checkpoint ships with.
_GENERATION_KEYS = {
    "max_denoising_steps": "max_steps",
    "t_min": "t_min",
    "t_max": "t_max",
    "stability_threshold": "stability_threshold",
    "confidence_threshold": "confidence_threshold",
}


def model_settings(model_dir: Path | None, generation_config: Any) -> dict[str, Any]:
    """The settings a model folder asks for: its generation config's diffusion knobs, then its canvas_ls.json."""
    found: dict[str, Any] = {}
    for theirs, ours in _GENERATION_KEYS.items():
        value = getattr(generation_config, theirs, None)
        if value is not None:
            found[ours] = value
    sampler = getattr(generation_config, "sampler_config", None)
    if sampler is not None and getattr(sampler, "entropy_bound", None) is not None:
        found["entropy_bound"] = sampler.entropy_bound
    if model_dir is not None and (model_dir / MODEL_SETTINGS_FILE).is_file():
        try:
            data = json.loads((model_dir / MODEL_SETTINGS_FILE).read_text())
        except json.JSONDecodeError as exc:
            raise SettingsError(f"{model_dir / MODEL_SETTINGS_FILE} is not valid JSON: {exc}") from exc
        unknown = sorted(set(data) - MODEL_SETTINGS_SECTIONS) if isinstance(data, dict) else ["(not an object)"]
        if unknown:  # a misspelt section would be ignored, and the model run with settings it did not ask for
            raise SettingsError(f"{model_dir / MODEL_SETTINGS_FILE}: unknown section {', '.join(unknown)} (known: "
                                f"{', '.join(sorted(MODEL_SETTINGS_SECTIONS))})")  # fmt: skip
        found.update(data.get("infill", {}))
    return found
