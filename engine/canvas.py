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

The sampler, the temperature schedule and the stopping rule are transformers' own DiffusionGemma classes; the
only subclass adds a torch.Generator so that one request's noise is reproducible and independent of any other.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.distributions import Categorical
from transformers import DynamicCache
from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
    EntropyBoundSampler,
    EntropyBoundSamplerConfig,
    LinearTemperatureScheduleLogitsProcessor,
    StableAndConfidentStoppingCriteria,
)

from engine.prefix_cache import PrefixCache
from engine.sampling import step_stats


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
    gap_tokens: int
    max_new_tokens: int
    max_steps: int
    entropy_bound: float
    t_min: float
    t_max: float
    stability_threshold: int
    confidence_threshold: float
    seed: int | None
    # "diffusion": entropy-bound parallel acceptance. "left_to_right": the autoregressive-equivalent baseline on the
    # same model and canvas: each step commits the leftmost open slot's argmax, one token per forward.
    order: str = "diffusion"


@dataclass
class StepView:
    """What an observer (tests, streaming drafts) sees after each denoising step."""

    canvas_index: int
    step: int  # 1-based step within this canvas
    canvas: torch.Tensor  # [G + S] the canvas the next step will read (gap noise/accepted + clamped suffix head)
    argmax: torch.Tensor  # [G] the current best guess for the gap
    accepted: torch.Tensor  # [G] bool, tokens accepted this step


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


class SeededEntropyBoundSampler(EntropyBoundSampler):
    """transformers' EntropyBoundSampler, drawing its noise from a per-request generator."""

    def __init__(
        self,
        config: EntropyBoundSamplerConfig,
        canvas_length: int,
        vocab_size: int,
        max_denoising_steps: int,
        generator: torch.Generator,
    ):
        super().__init__(config, canvas_length, vocab_size, max_denoising_steps)
        self.generator = generator

    def initialize_canvas(self, batch_size: int, device: torch.device) -> torch.LongTensor:
        return torch.randint(
            0, self.vocab_size, (batch_size, self.canvas_length), device=device, generator=self.generator
        )

    def accept_canvas(self, current_canvas, denoiser_canvas, logits, cur_step):  # type: ignore[override]
        return self.accept_entropy(current_canvas, denoiser_canvas, Categorical(logits=logits).entropy())

    def accept_entropy(self, current: torch.Tensor, proposal: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
        """The parent's entropy-bound rule on per-token entropies [B, G] computed once per step (fused on GPU):
        accept the k lowest-entropy tokens with sum(entropy) - max(entropy) <= bound."""
        ordered, order = torch.sort(entropy, dim=-1)
        chosen = torch.cumsum(ordered, dim=-1) - ordered <= self.entropy_bound
        self.accepted_token_mask = torch.scatter(torch.zeros_like(chosen), -1, order, chosen)
        return torch.where(self.accepted_token_mask, proposal, current)


class EntropyStableAndConfident(StableAndConfidentStoppingCriteria):
    """transformers' stopping rule, reading per-token entropies computed once per step instead of the logits."""

    def __call__(self, argmax_canvas, logits=None, token_entropy=None, **kwargs):  # type: ignore[override]
        if token_entropy is None:
            return super().__call__(argmax_canvas, logits)
        # The parent's stability bookkeeping, fed a one-class stand-in (entropy 0, so "confident" always holds)...
        stand_in = torch.zeros((*argmax_canvas.shape, 1), device=argmax_canvas.device)
        stable = super().__call__(argmax_canvas, stand_in)
        # ...and the confidence test on the real entropies.
        return stable & (token_entropy.mean(dim=-1) < self.confidence_threshold)


class LeftToRightSampler(SeededEntropyBoundSampler):
    """One token per step, left to right, greedy: the baseline every parallel decode is measured against."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.committed = 0  # slots [0, committed) hold their final tokens

    def accept_entropy(self, current: torch.Tensor, proposal: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
        """Commit the next slot's proposal (the loop passes the argmax: greedy)."""
        mask = torch.zeros_like(current, dtype=torch.bool)
        mask[:, : self.committed + 1] = True
        self.accepted_token_mask = mask
        chosen = current.clone()
        chosen[:, self.committed] = proposal[:, self.committed]
        self.committed += 1
        return chosen

    def finished(self, canvas: torch.Tensor, stop: torch.Tensor) -> bool:
        """Done once the committed run ends with a stop token or fills the gap."""
        return self.committed >= self.canvas_length or bool(torch.isin(canvas[0, self.committed - 1], stop))


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


@torch.inference_mode()
def encode(model: Any, ids: torch.Tensor, cache: DynamicCache, start: int) -> None:
    """Run the causal encoder over `ids` ([1, n]) at positions start..start+n-1, appending to `cache`."""
    positions = torch.arange(start, start + ids.shape[1], device=ids.device).unsqueeze(0)
    model.model.encoder(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True)


@torch.inference_mode()
def fill(
    model: Any,
    prefix_ids: Sequence[int],
    suffix_head_ids: Sequence[int],
    params: DenoiseParams,
    stop_ids: Sequence[int],
    cancel: CancelToken | None = None,
    on_step: Callable[[StepView], None] | None = None,
    prefix_cache: PrefixCache | None = None,
) -> CanvasOutput:
    """Fill the gap after `prefix_ids` (non-empty) and before `suffix_head_ids` (may be empty).

    With a `prefix_cache`, the encoder KV of an earlier request's prefix is reused and only the new tail encoded."""
    device = model.device
    vocab_size = model.config.text_config.vocab_size
    gap, head_len = params.gap_tokens, len(suffix_head_ids)
    generator = make_generator(params.seed, device)
    stop_tensor = torch.tensor(sorted(set(stop_ids)), device=device)
    suffix_head = torch.tensor([list(suffix_head_ids)], dtype=torch.long, device=device)  # [1, S]
    embed_dtype = model.model.decoder.embed_tokens.weight.dtype

    # 1. The prefix goes through the causal encoder once, into the KV cache (reusing a snapshot when one fits).
    t0 = time.perf_counter()

    def new_cache() -> DynamicCache:
        return DynamicCache(config=model.config.get_text_config(decoder=True))

    def encode_ids(cache: DynamicCache, ids: Sequence[int], start: int) -> None:
        encode(model, torch.tensor([list(ids)], dtype=torch.long, device=device), cache, start)  # [1, n]

    if prefix_cache is not None:
        cache, reused = prefix_cache.encode(prefix_ids, new_cache, encode_ids)
    else:
        cache, reused = new_cache(), 0
        encode_ids(cache, prefix_ids, 0)
    cursor = len(prefix_ids)  # position of the first gap slot
    out = CanvasOutput(
        tokens=[],
        confidence=[],
        ended_with_eos=False,
        steps=0,
        forward_passes=0,
        canvases=0,
        encode_seconds=time.perf_counter() - t0,
        prefix_reused=reused,
    )
    t_denoise = time.perf_counter()
    while len(out.tokens) < params.max_new_tokens:
        left_to_right = params.order == "left_to_right"
        sampler_class = LeftToRightSampler if left_to_right else SeededEntropyBoundSampler
        steps_cap = gap if left_to_right else params.max_steps
        sampler = sampler_class(
            EntropyBoundSamplerConfig(entropy_bound=params.entropy_bound), gap, vocab_size, steps_cap, generator
        )
        temperature = LinearTemperatureScheduleLogitsProcessor(params.t_min, params.t_max, steps_cap)
        stopping = EntropyStableAndConfident(params.stability_threshold, params.confidence_threshold)
        positions = torch.arange(cursor, cursor + gap + head_len, device=device).unsqueeze(0)  # [1, G+S]

        gap_canvas = sampler.initialize_canvas(1, device)  # [1, G] uniform noise
        argmax = gap_canvas
        self_cond: torch.Tensor | None = None  # [1, G+S, V] last step's tempered logits
        raw_gap_logits: torch.Tensor | None = None
        stop = "step_cap"
        for step, remaining in enumerate(range(steps_cap, 0, -1), start=1):
            if cancel is not None and cancel.is_set():
                raise InfillCancelled(out.steps)
            canvas = torch.cat([gap_canvas, suffix_head], dim=1)  # [1, G+S]; the head is written back every step
            logits = model(
                decoder_input_ids=canvas,
                past_key_values=cache,
                self_conditioning_logits=self_cond,
                decoder_position_ids=positions,
            ).logits  # [1, G+S, V]
            out.steps += 1
            out.forward_passes += 1

            # One pass over the gap logits: sample, argmax and entropy at this step's temperature (fused on GPU).
            step_temperature = 1.0 / float(temperature(None, torch.ones(()), cur_step=remaining))
            raw_gap_logits = logits[:, :gap]
            stats = step_stats(raw_gap_logits, step_temperature, generator)  # fields [1, G]
            argmax = stats.argmax
            proposal = stats.argmax if left_to_right else stats.sample
            accepted = sampler.accept_entropy(gap_canvas, proposal, stats.entropy)
            gap_canvas = sampler.renoise_canvas(accepted, remaining)
            self_cond = temperature(None, logits, cur_step=remaining).to(embed_dtype)  # [1, G+S, V]
            if left_to_right:
                argmax = accepted  # the committed tokens are the answer
                done = sampler.finished(accepted, stop_tensor)
            else:
                done = bool(stopping(argmax, token_entropy=stats.entropy)[0])
            if on_step is not None:
                on_step(
                    StepView(
                        out.canvases,
                        step,
                        torch.cat([gap_canvas, suffix_head], dim=1)[0],
                        argmax[0],
                        sampler.accepted_token_mask[0],
                    )
                )
            if done:
                stop = "converged"
                break
        out.canvases += 1
        out.canvas_stops.append(stop)

        # The answer is the gap's argmax up to the first EOS/pad.
        block = argmax[0]
        is_stop = torch.isin(block, stop_tensor)
        probs = torch.softmax(raw_gap_logits[0].float(), dim=-1).gather(-1, block[:, None])[:, 0]  # [G]
        end = int(is_stop.float().argmax()) if bool(is_stop.any()) else gap
        out.tokens.extend(block[:end].tolist())
        out.confidence.extend(probs[:end].tolist())
        if end < gap:
            out.ended_with_eos = True
            break
        # No EOS: the gap is all answer and the answer goes on. Encode it and open the next canvas after it.
        encode(model, block[None, :], cache, start=cursor)
        cursor += gap

    del out.tokens[params.max_new_tokens :]
    del out.confidence[params.max_new_tokens :]
    out.denoise_seconds = time.perf_counter() - t_denoise
    return out
