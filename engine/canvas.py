"""The denoising loop: fill a gap in place, between an encoded prefix and a clamped suffix head.

Token ids in, token ids out: this file knows nothing about text, files or editors.

    encode prefix once -> KV cache
    for each canvas (block) until EOS or max_new_tokens:
        canvas = [G gap slots: uniform noise] + [S suffix-head tokens: clamped]
        for step N..1:
            1. decoder forward (canvas, KV cache, self-conditioning logits)
            2. temperature schedule on the gap logits
            3. sample a denoiser canvas; take the argmax canvas
            4. entropy-bound acceptance; renoise the rest of the gap
            5. write the suffix head back (it is never renoised, never changes)
            6. stop when stable and confident
        answer += argmax gap up to the first EOS/pad
        no EOS in the gap: encode the gap into the KV cache and open the next canvas

Jobs always denoise in a `DenoisingBatch` (a request alone is a batch of one): one decoder forward per step for all
of them, each job's `advance` taking its row of the logits.

Several gaps (`Engine.fill`'s holes, span rewrites) share one canvas: [gap 1 | clamped 1 | gap 2 | ... | suffix
head]. Every clamped segment is written back every step; acceptance, renoising and stopping read only gap slots (all
gaps together, one entropy budget); each gap's answer ends at its own first EOS. A gap that fills without an EOS is
grown and the canvas re-run from the drafts so far (it cannot be encoded: clamped text follows it), up to its token
budget, or reported truncated. A rewrite gap starts from the span's current tokens with a share `strength` renoised.

The sampler, the temperature schedule and the stopping rule are transformers' DiffusionGemma classes (seeded per
request in `sampling.py`); the prefixes are encoded by `encoding.py`.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers import DynamicCache
from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
    EntropyBoundSamplerConfig,
    LinearTemperatureScheduleLogitsProcessor,
)

from .compiled import CompiledDecoder
from .conditioning import SelfConditioning, SparseSelfConditioning
from .encoding import EncodedPrefix, KVLayer, encode, encode_prefixes, left_pad
from .prefix_cache import PrefixCache
from .quantize import is_cpu_int8
from .sampling import (
    EntropyStableAndConfident,
    LeftToRightSampler,
    SeededEntropyBoundSampler,
    StepStats,
    logsumexp_sliced,
    make_generator,
    step_stats_rows,
)
from .settings import InfillSettings
from .suffix_kv import ExtendedCache, clamped_slots, recording_kv
from .token_cache import ORDERS, Caches, Found, lookups, mix_cache


class CancelToken(Protocol):
    """Anything with `is_set()`, e.g. a threading.Event; checked before every denoising step."""

    def is_set(self) -> bool: ...


class InfillCancelled(Exception):
    """The request was cancelled between denoising steps; `steps` says how many had run."""

    def __init__(self, steps: int):
        super().__init__(f"cancelled after {steps} denoising steps")
        self.steps = steps


@dataclass(frozen=True)
class DenoiseParams:
    """One request's denoising loop: its settings (the model's, with the request's overrides: steps, entropy bound,
    temperatures, stopping, seed, order, self-conditioning...) and what the engine derived from its text."""

    settings: InfillSettings
    # Bound on the answer (one gap), or on all the gaps of a fill together.
    max_new_tokens: int
    # Token ids that hold a line break. When set, the answer ends at the canvas that writes one (the caller
    # keeps only the first line), instead of continuing canvas after canvas.
    line_end_ids: frozenset[int] = frozenset()
    # Token healing: the text cut from the end of the prefix, which the answer's first token re-writes, and the
    # tokens allowed in the first canvas's first gap slot ([V] bool: those starting with it, and the stop ids).
    healed: str = ""
    first_slot_allowed: torch.Tensor | None = None
    # The n-gram cache of the document and its workspace, mixed into the gap logits (`token_cache`)
    token_cache: Caches | None = None

    @property
    def min_new_tokens(self) -> int:
        """EOS/pad are barred from the first canvas's first this-many gap slots: the answer is at least that long."""
        return min(self.settings.min_new_tokens, self.settings.max_new_tokens)


@dataclass
class StepView:
    """What an observer (tests, streaming drafts) sees after each denoising step."""

    canvas_index: int
    step: int  # 1-based step within this canvas
    canvas: torch.Tensor  # [G + S] the canvas the next step will read (gap noise/accepted + clamped suffix head)
    argmax: torch.Tensor  # [G] the current best guess for the gap
    accepted: torch.Tensor  # [G] bool, tokens accepted this step
    healed: str = ""  # text the gap's first token re-writes from the prefix (token healing): not part of the answer


@dataclass(frozen=True)
class GapSpec:
    """One gap of the canvas: `length` slots to fill. A rewrite starts from `init` (the span's current tokens, EOS
    after them) with a share `strength` of the slots renoised; strength 1 is a plain hole (all noise).
    `allowed_first` ([V] bool): token healing's mask for the gap's first slot; `healed`: the text it re-writes."""

    length: int
    init: tuple[int, ...] = ()
    strength: float = 1.0
    allowed_first: torch.Tensor | None = None
    healed: str = ""
    max_length: int = 0  # how far the gap may grow when it fills without an EOS (0: its length)


@dataclass(frozen=True)
class Clamp:
    """Text between gaps (or the suffix head after the last one): written back after every step."""

    ids: tuple[int, ...]


Segment = GapSpec | Clamp


@dataclass
class GapOutput:
    tokens: list[int]  # this gap's answer, its first EOS and everything after it excluded
    confidence: list[float]
    ended_with_eos: bool  # False: the gap filled up within its budget without an EOS (truncated)


@dataclass
class CanvasOutput:
    tokens: list[int]  # the answer, first EOS and everything after it excluded
    confidence: list[float]  # per answer token: its probability under the last step's (untempered) logits
    ended_with_eos: bool
    steps: int  # denoising steps, all canvases
    forward_passes: int  # decoder forwards, all canvases (== steps; kept apart for batched engines)
    canvases: int
    canvas_stops: list[str] = field(default_factory=list)  # per canvas: "converged" or "step_cap"
    encode_seconds: float = 0.0
    denoise_seconds: float = 0.0
    prefix_reused: int = 0  # prefix tokens whose encoder KV came from the prefix cache
    gaps: list[GapOutput] = field(default_factory=list)  # per gap, in canvas order (one: the fields above)


_SERIALS = itertools.count()
BARRED_LOGIT = -1e4  # far below any softcapped logit (|x| <= 30), still finite once divided by a temperature


class CanvasJob:
    """One request's denoising state: its KV cache, its current canvas, its sampler and its answer so far.

    `DenoisingBatch` drives jobs through shared decoder forwards (a request alone is a batch of one): each step is
    `inputs()` -> forward -> `advance(logits)`, so a request takes the same steps alone or with others.

    The canvas after the prefix is `segments` (default: one gap of `gap_tokens`, then the suffix head). One gap
    first: the answer continues canvas after canvas (the gap is encoded into the cache). Otherwise each gap that
    fills without an EOS is grown and the canvas re-run, within its budget.
    """

    def __init__(
        self,
        model: Any,
        prefix_ids: Sequence[int],
        suffix_head_ids: Sequence[int],
        params: DenoiseParams,
        stop_ids: Sequence[int],
        cancel: CancelToken | None = None,
        on_step: Callable[[StepView], None] | None = None,
        prefix_cache: PrefixCache | None = None,
        encoded: EncodedPrefix | None = None,
        segments: Sequence[Segment] | None = None,
    ):
        self.model, self.params, self.cancel, self.on_step = model, params, cancel, on_step
        self.serial = next(_SERIALS)  # identifies the job in a batch (an id() can be reused once a job is freed)
        self.device = device = model.device
        self.vocab_size = model.config.text_config.vocab_size
        self.generator = make_generator(params.settings.seed, device)
        self.stop_tensor = torch.tensor(sorted(set(stop_ids)), device=device)
        self.fill_id = next(iter(stop_ids))  # what a gap holds after its answer (EOS)
        self.left_to_right = params.settings.order == "left_to_right"
        if segments is None:
            first = GapSpec(params.settings.gap_tokens, allowed_first=params.first_slot_allowed, healed=params.healed)
            segments = [first, Clamp(tuple(suffix_head_ids))]
        self.segments = list(segments)
        gaps = [s for s in self.segments if isinstance(s, GapSpec)]
        if not gaps:
            raise ValueError("a canvas needs at least one gap")
        # One gap at the start of the canvas: today's single infill, continued block by block.
        self.continues = len(gaps) == 1 and isinstance(self.segments[0], GapSpec)
        if self.left_to_right and not self.continues:
            raise ValueError("left_to_right order fills one gap only")

        # 1. The prefix goes through the causal encoder once, into the KV cache (reusing a snapshot when one fits),
        # unless the caller encoded it already, together with other requests' prefixes.
        if encoded is None:
            encoded = encode_prefixes(model, [prefix_ids], prefix_cache)[0]
        self.cache = encoded.cache
        self.cursor = len(prefix_ids)  # position of the first canvas slot
        # The tokens before the canvas that the token cache reads as context (the document's, then earlier canvases')
        self.history = list(params.token_cache.before) if params.token_cache is not None else []
        self.out = CanvasOutput(tokens=[], confidence=[], ended_with_eos=False, steps=0, forward_passes=0,
                                canvases=0, encode_seconds=encoded.seconds, prefix_reused=encoded.reused)  # fmt: skip
        self.started = time.perf_counter()
        self.done = False
        self.error: InfillCancelled | None = None  # set by DenoisingBatch.step when this job was cancelled
        # A rewrite's kept slots and their span's ids ([1, G] bool, [1, G] long), set by `_first_gap_canvas`
        self.anchor: tuple[torch.Tensor, torch.Tensor] | None = None
        self._lay_out()
        self._open_canvas(self._first_gap_canvas())

    def _lay_out(self) -> None:
        """The canvas template ([1, L]: clamped ids, 0 in gap slots) and where the gap slots are."""
        template: list[int] = []
        slots: list[int] = []
        self.gap_bounds: list[tuple[int, int]] = []  # per gap, [start, end) in gap-slot coordinates
        for segment in self.segments:
            if isinstance(segment, Clamp):
                template += segment.ids
                continue
            self.gap_bounds.append((len(slots), len(slots) + segment.length))
            slots += range(len(template), len(template) + segment.length)
            template += [0] * segment.length
        self.gap = len(slots)  # G: gap slots in all
        self.template = torch.tensor([template], dtype=torch.long, device=self.device)  # [1, L]
        self.length = len(template)
        # The single infill's gap is the canvas's first G slots: plain slices, as before several gaps existed.
        self.gap_index = None if self.continues else torch.tensor(slots, device=self.device)  # [G]
        starts = [start for start, end in self.gap_bounds for _ in range(end - start)]
        self.gap_starts = None if self.continues else torch.tensor(starts, device=self.device)  # [G]
        # Logit bars per canvas (gap-slot index, allowed [V] or None for "no stop token here"): token healing's
        # first slot, and min_new_tokens' first slots of each gap.
        self.bars: list[tuple[int, torch.Tensor | None]] = []
        gaps = [s for s in self.segments if isinstance(s, GapSpec)]
        for (start, end), spec in zip(self.gap_bounds, gaps, strict=True):
            if spec.allowed_first is not None:
                self.bars.append((start, spec.allowed_first))
            self.bars += [(start + i, None) for i in range(min(self.params.min_new_tokens, end - start))]

    def _first_gap_canvas(self) -> torch.Tensor:
        """The first canvas's gap slots [1, G]: uniform noise; a rewrite gap keeps its span's tokens outside the
        renoised share (SDEdit for text). Those kept slots are anchored (`self.anchor`): a step that does not accept
        a token there puts the span's token back instead of noise, so the span's text stays in the canvas until the
        model is sure of a replacement, rather than shaping the first forward only."""
        noise = torch.randint(0, self.vocab_size, (1, self.gap), device=self.device, generator=self.generator)
        kept_all = torch.zeros((1, self.gap), dtype=torch.bool, device=self.device)
        gaps = [s for s in self.segments if isinstance(s, GapSpec)]
        for (start, end), spec in zip(self.gap_bounds, gaps, strict=True):
            if spec.strength >= 1.0:
                continue
            length = end - start
            init = torch.tensor([*spec.init[:length], *[self.fill_id] * (length - len(spec.init))], device=self.device)
            renoised = round(spec.strength * length)
            order = torch.randperm(length, generator=self.generator, device=self.device)
            keep = torch.ones(length, dtype=torch.bool, device=self.device)
            keep[order[:renoised]] = False
            noise[0, start:end] = torch.where(keep, init, noise[0, start:end])
            kept_all[0, start:end] = keep
        if bool(kept_all.any()):
            self.anchor = (kept_all, noise.clone())
        return noise

    def _open_canvas(self, gap_canvas: torch.Tensor) -> None:
        """2. A fresh canvas: the gap slots (noise, or a rewrite's or a re-run's start) among the clamped segments."""
        settings = self.params.settings
        self.steps_cap = self.gap if self.left_to_right else settings.max_steps
        sampler_class = LeftToRightSampler if self.left_to_right else SeededEntropyBoundSampler
        config = EntropyBoundSamplerConfig(entropy_bound=settings.entropy_bound)
        self.sampler = sampler_class(config, self.gap, self.vocab_size, self.steps_cap, self.generator)
        self.temperature = LinearTemperatureScheduleLogitsProcessor(settings.t_min, settings.t_max, self.steps_cap)
        self.stopping = EntropyStableAndConfident(settings.stability_threshold, settings.confidence_threshold)
        self.positions = torch.arange(self.cursor, self.cursor + self.length, device=self.device)[None]  # [1, L]
        self.gap_canvas = gap_canvas  # [1, G]
        self.argmax = self.gap_canvas
        # The temperature the next step's self-conditioning divides this step's logits by (the batch keeps them:
        # `conditioning.py`); None: the next step has none (a canvas's first step, or self_condition "off")
        self.conditioning: float | None = None
        self.step = 0
        # The clamped slots' keys and values of this canvas's last full step (`suffix_kv.py`), as the cache the
        # gap-only steps read; None: the next step computes the whole canvas
        self.extended: ExtendedCache | None = None

    def canvas(self) -> torch.Tensor:
        """[1, L]: the gap slots written into the clamped template."""
        if self.gap_index is None:
            return torch.cat([self.gap_canvas, self.template[:, self.gap :]], dim=1)
        canvas = self.template.clone()
        canvas[:, self.gap_index] = self.gap_canvas
        return canvas

    def gap_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[1, L, V] canvas logits -> [1, G, V] the gap slots' (a view for the single infill)."""
        return logits[:, : self.gap] if self.gap_index is None else logits[:, self.gap_index]

    def barred(self) -> list[tuple[int, torch.Tensor | None]]:
        """The logit bars of this step: a continued canvas carries on an answer, so only the first one has them."""
        return self.bars if not (self.continues and self.out.canvases > 0) else []

    def cancelled(self) -> InfillCancelled | None:
        """Why this job stops before its next step, when its request was cancelled."""
        return InfillCancelled(self.out.steps) if self.cancel is not None and self.cancel.is_set() else None

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The canvas to denoise next ([1, L]; clamped segments written back every step) and its positions; on a
        gap-only step ([1, G]) the gap slots and theirs."""
        if self.gap_only():
            return self.gap_canvas, self.positions[:, : self.gap]
        return self.canvas(), self.positions

    def width(self) -> int:
        """The slots the next step's forward computes: the canvas's, or the gap's on a gap-only step."""
        return self.gap if self.gap_only() else self.length

    def gap_only(self) -> bool:
        """Whether the next step runs the gap slots alone, against the suffix head's recorded keys and values."""
        return self.extended is not None and self.step % self.params.settings.suffix_refresh != 0

    def records(self) -> bool:
        """Whether the next step records its clamped slots' keys and values for the gap-only steps after it (a full
        step of a single gap followed by clamped text, with `suffix_refresh` above 1)."""
        refresh = self.params.settings.suffix_refresh
        return refresh > 1 and self.continues and self.length > self.gap and not self.gap_only()

    def keep_clamped(self, recording: dict[int, tuple[torch.Tensor, torch.Tensor]], row: int) -> None:
        """The clamped slots' keys and values of the step just run (row `row` of its recording)."""
        self.extended = ExtendedCache(self.cache, clamped_slots(recording, row, self.gap, self.length))

    def decoder_cache(self) -> Any:
        """What the next step's decoder forward attends to before the canvas: the encoder cache, extended by the
        clamped slots' recorded keys and values on a gap-only step."""
        return self.extended if self.gap_only() else self.cache

    def cache_lookups(self, cache: Caches, weight: float) -> list[Found]:
        """The token cache's `lookups` for this canvas: known are the prefix and earlier canvases, the clamped code
        of a fill, and the slots the sampler accepted at the last step."""
        canvas = self.canvas()[0].tolist()
        known = [True] * len(canvas)
        slots = list(range(self.gap)) if self.gap_index is None else self.gap_index.tolist()
        accepted = getattr(self.sampler, "accepted_token_mask", None)
        accepted = accepted[0].tolist() if accepted is not None else [False] * self.gap
        for slot, position in enumerate(slots):
            known[position] = accepted[slot]
        offset = len(self.history)
        return lookups(cache, self.history + canvas, [True] * offset + known, [offset + p for p in slots], weight,
                       unchained=frozenset(slot for slot, _ in self.barred()))  # fmt: skip

    def temperature_now(self) -> float:
        """The temperature of the step about to run (transformers counts steps down, N..1)."""
        return float(self.temperature(None, torch.ones(()), cur_step=self.steps_cap - self.step)) ** -1

    def advance(self, logits: torch.Tensor, stats: StepStats) -> None:
        """3-6. One denoising step from this canvas's logits [1, L, V] and its gap slots' stats at
        `temperature_now()` (sample, argmax and entropy in one pass over the gap logits, batched across jobs)."""
        self.step += 1
        remaining = self.steps_cap - self.step + 1
        self.out.steps += 1
        self.out.forward_passes += 1
        gap_logits = self.gap_logits(logits)
        self.argmax = stats.argmax
        proposal = stats.argmax if self.left_to_right else stats.sample
        accepted = self.sampler.accept_entropy(self.gap_canvas, proposal, stats.entropy)
        self.gap_canvas = self.sampler.renoise_canvas(accepted, remaining)
        if self.anchor is not None:  # a rewrite's kept slots: the span's token where nothing was accepted
            kept, ids = self.anchor
            self.gap_canvas = torch.where(kept & ~self.sampler.accepted_token_mask, ids, self.gap_canvas)
        mode = self.params.settings.self_condition
        self.conditioning = None if mode == "off" else self._temperature_at(remaining) if mode == "processed" else 1.0
        if self.left_to_right:
            self.argmax = accepted  # the committed tokens are the answer
            converged = self.sampler.finished(accepted, self.stop_tensor)
        else:
            scoped = self.stop_tensor if self.params.settings.stop_scope == "answer" else None
            converged = bool(self.stopping(self.argmax, token_entropy=stats.entropy, stop_ids=scoped,
                                           gap_starts=self.gap_starts)[0])  # fmt: skip
        if self.on_step is not None:
            self.on_step(StepView(self.out.canvases, self.step, self.canvas()[0], self.argmax[0],
                                  self.sampler.accepted_token_mask[0], self.params.healed))  # fmt: skip
        if converged or self.step >= self.steps_cap:
            stop = "converged" if converged else "step_cap"
            (self._close_canvas if self.continues else self._close_gaps)(stop, gap_logits)

    def _temperature_at(self, remaining: int) -> float:
        """The schedule's temperature with `remaining` steps to go (transformers' processor on a float64 one)."""
        return float(self.temperature(None, torch.ones((), dtype=torch.float64), cur_step=remaining)) ** -1

    def _close_canvas(self, stop: str, gap_logits: torch.Tensor) -> None:
        """The answer is the gap's argmax up to the first EOS/pad; with no EOS, the next canvas continues it."""
        out = self.out
        out.canvases += 1
        out.canvas_stops.append(stop)
        (answer,) = self._answers(gap_logits)
        out.tokens.extend(answer.tokens)
        out.confidence.extend(answer.confidence)
        out.ended_with_eos = answer.ended_with_eos
        line_ended = any(token in self.params.line_end_ids for token in out.tokens)
        if answer.ended_with_eos or line_ended or len(out.tokens) >= self.params.max_new_tokens:
            del out.tokens[self.params.max_new_tokens :]
            del out.confidence[self.params.max_new_tokens :]
            out.gaps = [GapOutput(out.tokens, out.confidence, out.ended_with_eos)]
            self._finish()
            return
        # No EOS: the gap is all answer and the answer goes on. Encode it and open the next canvas after it.
        encode(self.model, self.argmax, self.cache, start=self.cursor)
        if self.params.token_cache is not None:
            self.history = (self.history + self.argmax[0].tolist())[-ORDERS[0] :]
        self.cursor += self.gap
        self.anchor = None
        self._open_canvas(self.sampler.initialize_canvas(1, self.device))

    def _close_gaps(self, stop: str, gap_logits: torch.Tensor) -> None:
        """Several gaps: each answer is its gap's argmax up to its first EOS. Gaps that filled without one grow (to
        twice their length, within their budget and the canvas's) and the canvas is re-run from the drafts so far;
        what cannot grow is truncated."""
        out = self.out
        out.canvases += 1
        out.canvas_stops.append(stop)
        answers = self._answers(gap_logits)
        room = self.params.max_new_tokens - self.gap  # slots the canvas may still add over all gaps
        grown: list[Segment] = []
        starts: list[list[int]] = []
        index = 0
        for segment in self.segments:
            if isinstance(segment, Clamp):
                grown.append(segment)
                continue
            answer = answers[index]
            index += 1
            extra = 0
            if not answer.ended_with_eos:
                extra = min(segment.length, max(segment.max_length - segment.length, 0), max(room, 0))
                room -= extra
            grown.append(dataclasses.replace(segment, length=segment.length + extra))
            # The re-run starts from the answer so far, EOS after a finished one, noise in the new slots.
            fill = [self.fill_id] * (segment.length - len(answer.tokens)) if answer.ended_with_eos else []
            starts.append([*answer.tokens, *fill, *[-1] * extra])
        if sum(len(start) for start in starts) == self.gap:  # nothing grew: these are the answers
            out.gaps = answers
            out.tokens = [t for answer in answers for t in answer.tokens]
            out.confidence = [c for answer in answers for c in answer.confidence]
            out.ended_with_eos = all(answer.ended_with_eos for answer in answers)
            self._finish()
            return
        self.segments = grown
        self._lay_out()
        self.anchor = None  # the re-run starts from the drafts; the slots moved
        flat = torch.tensor([t for start in starts for t in start], device=self.device)
        noise = torch.randint(0, self.vocab_size, (self.gap,), device=self.device, generator=self.generator)
        self._open_canvas(torch.where(flat >= 0, flat, noise)[None])

    def _answers(self, gap_logits: torch.Tensor) -> list[GapOutput]:
        """Per gap, its argmax up to its first EOS/pad, with each token's probability under the last step's
        (untempered) gap logits [1, G, V]."""
        block = self.argmax[0]
        is_stop = torch.isin(block, self.stop_tensor)
        probs = (gap_logits[0].gather(-1, block[:, None])[:, 0].float() - logsumexp_sliced(gap_logits[0])).exp()
        answers = []
        for start, end in self.gap_bounds:
            stops = is_stop[start:end].nonzero()
            cut = start + (int(stops[0]) if len(stops) else end - start)
            answers.append(GapOutput(block[start:cut].tolist(), probs[start:cut].tolist(), bool(len(stops))))
        return answers

    def _finish(self) -> None:
        self.out.denoise_seconds = time.perf_counter() - self.started
        self.done = True


def step_jobs(jobs: list[CanvasJob], logits: torch.Tensor, widths: list[int]) -> None:
    """One step for each job from its row of a (shared) decoder forward's logits [B, Lc, V], of which its first
    `widths[row]` slots are its own (`CanvasJob.width`, taken before the step)."""
    gathered = []  # [G, V] per job: a view for the single infill; a copy (written back) for several gaps
    for row, job in enumerate(jobs):
        rows = job.gap_logits(logits[row : row + 1])[0]
        for slot, allowed in job.barred():
            if allowed is not None:  # token healing: the first token re-writes the text cut before the gap
                rows[slot, ~allowed] = BARRED_LOGIT
            else:  # min_new_tokens; a finite floor: -inf would turn the entropies into NaN (0 * -inf)
                rows[slot, job.stop_tensor] = BARRED_LOGIT
        if job.params.token_cache is not None:  # the user's own code, where the slot's context is known
            weight = job.params.settings.workspace_cache
            found = job.cache_lookups(job.params.token_cache, weight)
            mix_cache(rows, found, weight, BARRED_LOGIT / 2, job.stop_tensor)
        if job.gap_index is not None:
            logits[row, job.gap_index] = rows
        gathered.append(rows)
    if all(job.gap_index is None for job in jobs):
        gap_logits = logits  # each row's gap is its first G slots
    else:
        width = max(job.gap for job in jobs)
        gap_logits = torch.stack([torch.nn.functional.pad(rows, (0, 0, 0, width - rows.shape[0])) for rows in gathered])
    stats = step_stats_rows(gap_logits, [job.temperature_now() for job in jobs], [job.generator for job in jobs],
                            [job.gap for job in jobs])  # fmt: skip
    for row, job in enumerate(jobs):
        job.advance(logits[row : row + 1, : widths[row]], stats[row])


class BatchedKV:
    """Several jobs' encoder caches, left-padded to one length per layer, read by one batched decoder forward.

    The decoder only reads `layers[i].keys/values` (it appends the canvas without writing back), so padded copies
    serve; the masks below hide the padding. Layers of one type (full or sliding) hold the same lengths.
    """

    is_compileable = False

    def __init__(self, caches: list[DynamicCache], layer_types: list[str]):
        self.layers = []
        self.lengths: dict[str, torch.Tensor] = {}  # layer type -> [B] cached tokens per row
        for index, kind in enumerate(layer_types):
            keys = [c.layers[index].keys for c in caches]  # each [1, H, L_b, D]
            values = [c.layers[index].values for c in caches]
            width = max(k.shape[2] for k in keys)
            self.layers.append(KVLayer(left_pad(keys, width), left_pad(values, width)))
            self.lengths.setdefault(kind, torch.tensor([k.shape[2] for k in keys], device=keys[0].device))

    def masks(self, canvas_lengths: list[int], width: int) -> dict[str, torch.Tensor]:
        """Boolean [B, 1, Lc, L + Lc] masks per layer type: real cache entries and real canvas slots only."""
        canvas = torch.tensor(canvas_lengths, device=next(iter(self.lengths.values())).device)
        columns = torch.arange(width, device=canvas.device)
        masks = {}
        for kind, lengths in self.lengths.items():
            cached = int(lengths.max())
            keys = torch.arange(cached, device=canvas.device)
            cache_ok = keys[None, :] >= (cached - lengths)[:, None]  # [B, L] left padding off
            canvas_ok = columns[None, :] < canvas[:, None]  # [B, Lc]
            row = torch.cat([cache_ok, canvas_ok], dim=1)  # [B, L + Lc]
            masks[kind] = row[:, None, None, :].expand(-1, 1, width, -1)
        return masks


class DenoisingBatch:
    """Jobs denoising together: one shared decoder forward per step. Jobs join and leave between steps
    (iteration-level scheduling), so a new request does not wait for the longest one in flight, and a finished one
    does not wait for the others."""

    def __init__(self, model: Any, pad_id: int = 0, decoder: CompiledDecoder | None = None):
        self.model, self.pad_id = model, pad_id
        self.decoder = decoder or CompiledDecoder(model, "off")  # the forward: eager, or compiled once warm
        self.layer_types = list(model.config.text_config.layer_types)
        self.jobs: list[CanvasJob] = []  # in the order of the forward's rows (and of `conditioning`'s)
        embed = model.model.decoder.embed_tokens.weight
        # A CPU's int8 model conditions on soft embeddings computed sparsely (`conditioning.py`)
        vocab = model.config.text_config.vocab_size
        self.conditioning = (SparseSelfConditioning(model) if is_cpu_int8(model)
                             else SelfConditioning(vocab, embed.dtype, embed.device))  # fmt: skip
        self._kv: tuple[tuple[tuple[int, int, Any], ...], BatchedKV] | None = None

    def __len__(self) -> int:
        return len(self.jobs)

    def add(self, job: CanvasJob) -> None:
        self.jobs.append(job)
        self.conditioning.clear(len(self.jobs) - 1)

    @torch.inference_mode()
    def step(self) -> list[CanvasJob]:
        """One denoising step for every job; returns (and drops) the jobs that ended: done, or cancelled with
        `job.error` set."""
        ended = []
        for job in self.jobs:
            job.error = job.cancelled()
            if job.error is not None:
                ended.append(job)
        self._drop(ended)
        if not self.jobs:
            return ended
        jobs = list(self.jobs)
        widths = [job.width() for job in jobs]
        inputs = self.decoder_inputs()
        recording = [row for row, job in enumerate(jobs) if job.records()]
        if recording:  # the clamped slots' keys and values, for the gap-only steps after this one (`suffix_kv.py`)
            with recording_kv(self.model) as kept:
                logits = self.decoder(**inputs, eager=True)  # [B, Lc, V]
            for row in recording:
                jobs[row].keep_clamped(kept, row)
        else:
            logits = self.decoder(**inputs)
        step_jobs(jobs, logits, widths)
        if any(job.conditioning is not None for job in jobs):
            self.conditioning.fit(len(jobs), max(job.length for job in jobs))
        for row, job in enumerate(jobs):  # the next step's self-conditioning, written in place
            if job.conditioning is None or job.done:
                self.conditioning.clear(row)
            else:  # a gap-only step leaves the clamped slots' logits of the last full step
                self.conditioning.write(row, logits[row, : widths[row]], job.conditioning)
        done = [job for job in jobs if job.done]
        self._drop(done)
        return ended + done

    def _drop(self, ended: list[CanvasJob]) -> None:
        if ended:
            self.conditioning.keep([row for row, job in enumerate(self.jobs) if job not in ended])
            self.jobs = [job for job in self.jobs if job not in ended]

    def decoder_inputs(self) -> dict[str, Any]:
        """The shared decoder forward's inputs for the batch's jobs: canvases right-padded to one width, their caches
        left-padded to one length (masks hide both), the rows' self-conditioning logits."""
        ready = [(job, *job.inputs()) for job in self.jobs]
        width = max(canvas.shape[1] for _, canvas, _ in ready)  # this forward's slots
        canvas_width = max(job.length for job, _, _ in ready)  # the canvases' (wider where a step runs the gap alone)
        canvases = torch.cat([_right_pad(canvas, width, self.pad_id) for _, canvas, _ in ready])  # [B, Lc]
        positions = torch.cat([_right_pad_positions(p, width) for _, _, p in ready])  # [B, Lc]
        # The batched cache is rebuilt only when a job joins, leaves, extends its cache (a next canvas) or reads the
        # clamped slots' keys and values of another full step (or none: its next full step).
        # (the cache objects themselves: an ExtendedCache is new at each full step that records)
        key = tuple((job.serial, job.cursor, job.decoder_cache()) for job, _, _ in ready)
        if self._kv is None or self._kv[0] != key:
            self._kv = (key, BatchedKV([job.decoder_cache() for job, _, _ in ready], self.layer_types))
        kv = self._kv[1]
        self_cond = mask = None
        if isinstance(self.conditioning, SparseSelfConditioning):  # eager; the block's hook takes them
            self.conditioning.feed(len(ready), width, canvas_width)
        # A compiled decoder always takes them (one graph); eager, they are left out while no row has any
        elif self.conditioning.any(len(ready)) or self.decoder.static_inputs:
            self_cond, mask = self.conditioning.inputs(len(ready), width, canvas_width)
        return dict(
            decoder_input_ids=canvases,
            cache=kv,
            self_conditioning_logits=self_cond,
            self_conditioning_mask=mask,
            decoder_attention_mask=kv.masks([canvas.shape[1] for _, canvas, _ in ready], width),
            decoder_position_ids=positions,
        )


def _right_pad(ids: torch.Tensor, width: int, pad_id: int) -> torch.Tensor:
    return torch.nn.functional.pad(ids, (0, width - ids.shape[1]), value=pad_id)


def _right_pad_positions(positions: torch.Tensor, width: int) -> torch.Tensor:
    extra = width - positions.shape[1]
    if extra == 0:
        return positions
    tail = positions[:, -1:] + torch.arange(1, extra + 1, device=positions.device)[None, :]
    return torch.cat([positions, tail], dim=1)
