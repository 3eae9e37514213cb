"""Server configuration: one tree of dataclasses with defaults, from `initializationOptions` and
`workspace/didChangeConfiguration`. Bad options never stop the server: they produce a message and the defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

import cattrs
from cattrs.v import format_exception

from ..engine.commits import RECENT_EDITS
from ..engine.paths import IDLE_EXIT_S
from .backend import Settings

_converter = cattrs.Converter(forbid_extra_keys=True)


# The largest token counts and windows taken (a bad value must not make a request run or wait without end).
TOKENS = 8192
CONTEXT = 1 << 20


def _within(options: object, section: str, **ranges: tuple[float, float]) -> None:
    """Each named option is null (where its default is) or a number in its [low, high] range; ValueError if not."""
    for name, (low, high) in ranges.items():
        value = getattr(options, name)
        if value is not None and not low <= value <= high:
            label = f"{section}.{name}" if section else name
            raise ValueError(f"{label} must be in [{low:g}, {high:g}], got {value!r}")


@dataclass
class EngineOptions:
    # Model folder or hub id; None means the default model shipped inside the package.
    model: str | None = None
    # "auto" takes CUDA when there is a GPU, else the CPU.
    device: str = "auto"
    # A LoRA adapter folder (`canvas-ls train --lora`) applied to the model (with backend "remote": sent to the
    # deployment once and named in every request, `RemoteBackend._adapter_name`); None: the model as it is.
    adapter: str | None = None
    # The layers' weights: "auto" (on a GPU, the first of none / int8 / int4 that leaves room in its free memory, so
    # that DiffusionGemma 26B-A4B runs on a 24 or 48 GB card; on a CPU none), "none", "int8" (CPU or GPU) or "int4"
    # (NVIDIA GPUs of compute capability 8.0+). Needs torchao (`pip install 'canvas-ls[quantize]'`).
    quantize: Literal["auto", "none", "int8", "int4", "int8-dynamic"] = "auto"
    # The compiled denoising step (`canvas-ls engine --compile`): "auto" on (on the CPU its graphs are compiled once
    # by a background process at the lowest priority, 1-2 minutes on 2 cores, then loaded in ~3 s at every start; a
    # machine that cannot compile stays eager); "on" also compiles in the engine itself where that process cannot;
    # "off" eager. A resident engine already running keeps the mode it was started with.
    compile: Literal["auto", "on", "off"] = "auto"
    # "resident": the model runs in `canvas-ls engine`, one process per model shared by every editor of this user
    # (started when none runs, restarted if it dies, gone after `idle_exit_s` without requests). "local": inside
    # this server (one copy of the model per editor). "remote": canvas-ls's own engine at `url` (a team deployment,
    # `canvas-ls team serve`, or `canvas-ls engine --tcp`), the whole canvas API, its token in `api_key` or
    # $CANVAS_LS_TOKEN. "openai": any OpenAI-compatible completions server at `url` (vLLM, SGLang: the suffix goes
    # through a FIM prompt, no holes).
    backend: Literal["local", "resident", "remote", "openai"] = "resident"
    # The resident engine's unix socket (None: the user's runtime folder, one socket per model and device) and its
    # idle timeout.
    socket: str | None = None
    idle_exit_s: float = IDLE_EXIT_S
    # "remote" and "openai" backends: the server's base URL, key (None: $CANVAS_LS_TOKEN for "remote",
    # $CANVAS_LS_API_KEY for "openai"), and ("openai") the model name.
    url: str | None = None
    api_key: str | None = None
    remote_model: str | None = None
    # How the suffix reaches that server: "field" (its `suffix` parameter) or "prompt" (through `fim_template`),
    # since vLLM and SGLang have not accepted `suffix`.
    suffix_mode: Literal["field", "prompt"] = "prompt"
    fim_template: str = "<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>"
    # Documents of a repository that has a model tuned on it from `model` (`canvas-ls train --workspace`, or the
    # editors' "Learn this workspace") are answered by that model ("local" and "resident" backends).
    workspace_models: bool = True
    # "Learn this workspace": training minutes (None: the workspace recipe's).
    learn_minutes: float | None = None

    def __post_init__(self) -> None:
        _within(self, "engine", idle_exit_s=(0, 1e7), learn_minutes=(0.01, 1e5))


@dataclass
class CompletionOptions:
    # Gap slots for a completion that ends the current line / that writes a block. A model trained for in-place
    # infill fills the slots it does not need with EOS, so these bound the answer, they do not guess its length.
    gap_tokens_single_line: int = 16
    gap_tokens_multi_line: int = 32
    max_new_tokens_single_line: int = 48
    max_new_tokens_multi_line: int = 128
    # Denoising step cap and entropy bound; None keeps the model's own settings.
    max_steps: int | None = None
    entropy_bound: float | None = None
    # Compute the clamped suffix head every N denoising steps, the gap alone between (faster, answers may differ:
    # the engine's `suffix_refresh`); None keeps the model's own setting (1: every step).
    suffix_refresh: int | None = None
    # Context windows around the cursor, in model tokens (estimated from characters; the engine trims exactly).
    prefix_tokens: int = 1024
    suffix_tokens: int = 256
    # A multi-line completion keeps at most this many lines.
    max_lines: int = 30
    # Wait this long after a keystroke before calling the model; a newer request in the meantime wins.
    debounce_ms: int = 0
    # Completions asked for while typing are shown only when the model stands behind them: the answer's confidence
    # score (`engine.confidence`) must reach this. None: the model's calibrated policy (`canvas-ls bench calibrate`
    # writes it into the model folder: a score and threshold for a begun line, and for a blank line; 0 when it has
    # none); 0: show everything. Invoked completions (a key, a command) are always shown.
    min_confidence: float | None = None
    # Below the threshold, show the answer's confident head (whole tokens from the start, cut where the score would
    # fall under it) instead of nothing. Off by default: on held-out lines few heads were a right start of the line
    # (`bench calibrate`'s "head ok": README).
    show_head: bool = False
    # After a suggestion is shown, compute the one that follows it (once accepted) in the background, so that
    # accepting answers at once. Never delays a real request: those cancel it.
    speculate: bool = True
    # Context from the other open (and recently closed) files of the same language: snippets chosen by identifier
    # overlap and the definitions of names used near the cursor, placed before the prefix, within this many tokens.
    # 0 turns it off.
    context_tokens: int = 512
    # Weight of the token cache of the user's code (the n-grams of the document as the editor holds it, and of its git
    # repository, mixed into each slot whose context is known: `engine.token_cache`); None: the model's own setting
    # (1.0 unless its folder says); 0: off.
    workspace_cache: float | None = None
    # Learn the display threshold from your own accepts and dismissals (`server/personal.py`): per language and
    # model, from the model's calibrated one, so that this share of the suggestions shown while typing is accepted
    # while showing as many as that allows. Needs `statistics`; `min_confidence`, where set, overrides it.
    personal_threshold: bool = True
    acceptance_target: float = 0.3

    def __post_init__(self) -> None:
        _within(self, "completion", min_confidence=(0, 1), workspace_cache=(0, 1), entropy_bound=(0, 1e3),
                acceptance_target=(0.01, 0.99),
                gap_tokens_single_line=(1, TOKENS), gap_tokens_multi_line=(1, TOKENS),
                max_new_tokens_single_line=(1, TOKENS), max_new_tokens_multi_line=(1, TOKENS), max_steps=(1, TOKENS),
                suffix_refresh=(1, TOKENS), prefix_tokens=(0, CONTEXT), suffix_tokens=(0, CONTEXT),
                context_tokens=(0, CONTEXT), max_lines=(1, 10_000), debounce_ms=(0, 10_000))  # fmt: skip


@dataclass
class FillOptions:
    # The "Fill holes" and "Rewrite selection" actions (several regions in one canvas). Each hole starts with this
    # many gap slots and may grow to max_new_tokens when it fills without an end; at most max_holes per request.
    gap_tokens: int = 32
    max_new_tokens: int = 128
    max_holes: int = 8
    # Share of a selection's tokens renoised before the rewrite (1: write it anew, as a hole).
    rewrite_strength: float = 0.5
    # Denoising step cap; None keeps the model's own.
    max_steps: int | None = None

    def __post_init__(self) -> None:
        _within(self, "fill", gap_tokens=(1, TOKENS), max_new_tokens=(1, TOKENS), max_holes=(1, 64),
                rewrite_strength=(0, 1), max_steps=(1, TOKENS))  # fmt: skip

    def settings(self, workspace_cache: float | None = None) -> Settings:
        """The engine settings of a fill. The user asked for these regions: each answer has at least one token. The
        token cache's weight is `completion.workspace_cache` (one setting for completions and fills)."""
        return Settings(gap_tokens=self.gap_tokens, max_new_tokens=self.max_new_tokens, max_holes=self.max_holes,
                        max_steps=self.max_steps, min_new_tokens=1, workspace_cache=workspace_cache)  # fmt: skip


@dataclass
class NextEditOptions:
    # `canvas/nextEdit`: after an edit, the edits that should follow it, at the cursor or elsewhere.
    # Which predictors run: "repeat" (the last edit's substitution at analogous sites, no model) and "canvas" (the
    # window around the cursor rewritten by the model, conditioned on the recent edits).
    predictors: list[str] = field(default_factory=lambda: ["repeat", "canvas"])
    # The canvas predictor's window: this many lines before and after the cursor's line. The canvas's cost grows
    # with it: on a 2-core CPU with the shipped model, 3 (7 lines) answers in ~0.2 s, 20 (41 lines) in ~1.3 s
    # (docs/pages/next-edit.md); a GPU model takes 20.
    window_lines: int = 3
    # Share of the window's tokens renoised (low: the model keeps most of the text, rewriting what it doubts).
    strength: float = 0.3
    # Shown only at or above these confidences (per predictor). The canvas's is not calibrated yet: high.
    min_confidence: dict[str, float] = field(default_factory=lambda: {"repeat": 0.5, "canvas": 0.9})
    # Sites suggested at most, and the other open documents a rename is repeated in (nearest first).
    max_sites: int = 8
    max_documents: int = 8
    # Windows the canvas rewrites together: the cursor's, and when the last edit changed a function's parameters,
    # the calls of that function (nearest first), the code between them in the canvas. 1 (the cursor's window only)
    # on the CPU: with the shipped model a call 70 lines away took the canvas from ~0.2 s to ~2.2 s (2-core EPYC,
    # docs/pages/next-edit.md); a GPU model takes 4.
    canvas_sites: int = 1
    # Recent edits shown to the model before the window, newest last.
    history_edits: int = RECENT_EDITS  # what training shows (engine/commits.py)
    # Denoising step cap (a rewrite starts from the window's text and needs fewer than a fill); None: the model's.
    max_steps: int | None = 4

    def __post_init__(self) -> None:
        _within(self, "next_edit", window_lines=(0, 500), strength=(0.01, 1), max_sites=(1, 100),
                max_documents=(0, 100), canvas_sites=(1, 16), history_edits=(0, 16), max_steps=(1, TOKENS))  # fmt: skip
        if unknown := [name for name in self.predictors if name not in PREDICTORS]:
            raise ValueError(f"next_edit.predictors: unknown {unknown}; known: {list(PREDICTORS)}")
        for name, value in self.min_confidence.items():
            if name not in PREDICTORS or not 0 <= value <= 1:
                raise ValueError(f"next_edit.min_confidence: want {{predictor: 0..1}} for {list(PREDICTORS)}, "
                                 f"got {name!r}: {value!r}")  # fmt: skip


PREDICTORS = ("repeat", "canvas")


@dataclass
class ServerConfig:
    engine: EngineOptions = field(default_factory=EngineOptions)
    completion: CompletionOptions = field(default_factory=CompletionOptions)
    fill: FillOptions = field(default_factory=FillOptions)
    next_edit: NextEditOptions = field(default_factory=NextEditOptions)
    # Per-language switch, by LSP languageId or canonical name ("python": false); a language not listed is on.
    languages: dict[str, bool] = field(default_factory=dict)
    # Completions remembered by context (LRU), answered without a model call.
    cache_size: int = 256
    # Record what was shown, accepted (whole or partly) and dismissed, in a local database (`canvas-ls stats`): counts,
    # lengths and latency per language, workspace, model and kind; never code, never sent anywhere.
    statistics: bool = True

    def __post_init__(self) -> None:
        _within(self, "", cache_size=(0, 100_000))

    def enabled(self, language: str) -> bool:
        return self.languages.get(language, True)


def layered(initialization: Any, settings: Any) -> Any:
    """The options after a `workspace/didChangeConfiguration`: its settings over the `initializationOptions`.

    Clients differ in what they send: VS Code its whole "canvas-ls" section, eglot an empty object when the user set
    no workspace configuration, Neovim the `settings` of every server's config. Keys the settings name win (objects
    merge key by key); everything else stays as the editor started the server, so an empty or foreign settings
    object changes nothing (it used to reset the model to the default)."""
    base = initialization.get("canvas-ls", initialization) if isinstance(initialization, dict) else {}
    if isinstance(settings, dict):
        if "canvas-ls" in settings:
            settings = settings["canvas-ls"]
        elif not settings.keys() & {f.name for f in fields(ServerConfig)}:
            return base  # other servers' settings, or none
    if not isinstance(settings, dict) or not isinstance(base, dict):
        return settings  # parse_config says what is wrong with it
    return _merged(base, settings)


def _merged(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in top.items():
        below = merged.get(key)
        merged[key] = _merged(below, value) if isinstance(below, dict) and isinstance(value, dict) else value
    return merged


def parse_config(options: Any, current: ServerConfig | None = None) -> tuple[ServerConfig, str | None]:
    """The configuration from a client's options, and an error message when they were invalid: then `current` is
    kept (a settings change the server cannot read changes nothing), or the defaults when there is none yet."""
    if options is None:
        return current or ServerConfig(), None
    if isinstance(options, dict) and "canvas-ls" in options:  # didChangeConfiguration sends the whole section
        options = options["canvas-ls"]
    fallback = "keeping the current ones" if current is not None else "using defaults"
    if not isinstance(options, dict):
        return current or ServerConfig(), f"Invalid canvas-ls options, {fallback}: expected an object, got {options!r}"
    try:
        return _converter.structure(options, ServerConfig), None
    except (cattrs.BaseValidationError, TypeError, ValueError, AttributeError) as exc:
        details = (cattrs.transform_error(exc, format_exception=_reason) if isinstance(exc, cattrs.BaseValidationError)
                   else [str(exc)])  # fmt: skip
        return current or ServerConfig(), f"Invalid canvas-ls options, {fallback}: " + "; ".join(details)


def _reason(exc: BaseException, wanted: Any) -> str:
    """An option's error as the user should read it: our own range checks say which option and range."""
    return str(exc) if type(exc) is ValueError else format_exception(exc, wanted)
