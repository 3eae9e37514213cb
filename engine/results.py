"""What the engine answers, as data: `InfillResult` and its `GapResult`s. No torch: the language server reads them
(`server/backend.py`) and decodes the resident engine's JSON into them (`from_dict`), where it crosses a process.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class GapResult:
    """One gap's answer, in document order."""

    text: str  # what goes in the gap (the healed prefix text aside)
    tokens: list[int]
    token_texts: list[str]  # each token's text, and its confidence (the last step's probability of it)
    confidence: list[float]
    score: float | None  # the engine's score of it (None: not asked for)
    healed: str  # the prefix text its first token re-writes (token healing); not in `text`
    stop_reason: str  # "eos", or "truncated": it filled its budget without one


@dataclass
class InfillResult:
    text: str
    tokens: list[int]
    token_texts: list[str]
    confidence: list[float]  # per token, probability of the chosen token at the last step
    steps: int  # denoising steps, all canvases
    forward_passes: int  # decoder forward passes
    tokens_per_forward: float  # answer tokens (plus the closing EOS) per decoder forward
    canvases: int
    canvas_stops: list[str]  # per canvas: "converged" (adaptive stop) or "step_cap"
    stop_reason: str  # "eos" (the model closed the gap) or "max_tokens"
    encode_ms: float
    denoise_ms: float
    prefix_tokens: int
    prefix_reused_tokens: int  # of those, how many came from the prefix KV cache (not re-encoded)
    suffix_head_tokens: int
    layout: str
    model: str
    dtype: str  # what the model computed in ("bfloat16", "float32")
    # Token healing: prefix text cut back to a token boundary and re-written by the first token; not in `text`
    # (`text` is what goes at the cursor; `tokens` are what the model wrote, healed text included).
    healed: str = ""
    settings: dict[str, Any] = field(default_factory=dict)
    # Per gap, in document order. One for `infill`, whose `text` is that gap's; `fill` fills several.
    gaps: list[GapResult] = field(default_factory=list)
    # How much the model stands behind `text` (`engine.confidence`): the score, which score it is, and the
    # threshold calibrated for this model (`canvas-ls bench calibrate`; 0: uncalibrated, show everything).
    score: float | None = 1.0  # None: not asked for (`InfillRequest.score`)
    score_kind: str = "geometric"
    min_confidence: float = 0.0
    adapter: str | None = None  # the LoRA adapter that answered (`InfillRequest.adapter`)

    def to_dict(self) -> dict[str, Any]:
        """As JSON carries it (`/v1/infill`, `/v1/fill`, `canvas-ls complete --json`)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> InfillResult:
        """From `to_dict`'s JSON (the resident engine's answer, in the language server): strict, as the dataclasses'
        own constructors are (a missing or unknown field is a `TypeError` naming it)."""
        return cls(**{**data, "gaps": [GapResult(**gap) for gap in data.get("gaps", [])]})
