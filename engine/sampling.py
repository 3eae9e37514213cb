"""One denoising step's statistics over the canvas logits: sample, argmax, entropy, in one pass on the GPU.

Per canvas position, from logits [N, V] and the step's temperature T:
    sample  : a draw from softmax(logits / T) (kernel: Gumbel-max, one pass; torch: inverse CDF, one uniform per
              position, where Gumbel noise would cost two logarithms per vocabulary entry)
    argmax  : argmax(logits)
    entropy : H(softmax(logits / T))          (what entropy-bound acceptance and adaptive stopping read)
    lse     : logsumexp(logits / T)

With DiffusionGemma's 262,144-token vocabulary the logits of a 256-slot canvas are 256 MiB in fp32; the torch
path reads them five or six times per step (scale, softmax, sample, argmax, entropy twice). The Triton kernel reads
them once: one program per position, an online (rescaled) pass over the vocabulary in blocks. The torch function
is the reference, and the CPU path.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributions import Categorical
from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
    EntropyBoundSampler,
    EntropyBoundSamplerConfig,
    StableAndConfidentStoppingCriteria,
)

try:  # triton is a Linux x86_64 dependency; elsewhere the torch path serves
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


@dataclass
class StepStats:
    sample: torch.Tensor  # [N] int64
    argmax: torch.Tensor  # [N] int64
    entropy: torch.Tensor  # [N] float32
    lse: torch.Tensor  # [N] float32

    def map(self, f: Callable[[torch.Tensor], torch.Tensor]) -> StepStats:
        """The same statistics with `f` applied to each field (a reshape, a row slice)."""
        return StepStats(f(self.sample), f(self.argmax), f(self.entropy), f(self.lse))


def step_stats_torch(logits: torch.Tensor, temperature: float, generator: torch.Generator,
                     columns: int | None = None) -> StepStats:  # fmt: skip
    """Reference: logits [N, V] -> StepStats, with torch ops (over the vocabulary in slices of `columns`)."""
    uniform = torch.rand((*logits.shape[:-1], 1), generator=generator, device=logits.device)
    inverse = torch.full((1,), 1.0 / temperature, device=logits.device)  # [1]: promotes bf16 logits to fp32
    return _torch_stats(logits, inverse, uniform, columns or COLUMNS)


# The CPU path's columns per pass: a vocabulary wider than this is read in slices of it, so that what a step
# allocates beyond its logits does not grow with the vocabulary (at DiffusionGemma's 262,144 tokens the whole-row
# passes allocated 64 MB a canvas row a step) and each slice's passes run in cache. The shipped model's 8,192 tokens
# are one slice: its answers are those of the whole-row passes, bit for bit.
COLUMNS = 16384


def _torch_stats(logits: torch.Tensor, inverse: torch.Tensor, uniform: torch.Tensor,
                 columns: int = COLUMNS) -> StepStats:  # fmt: skip
    """logits [..., V] (any float dtype), inverse = 1 / T (broadcast to [..., 1]), one uniform draw per position
    [..., 1] -> StepStats [...]. Over the vocabulary in slices of `columns`: per slice its max, sum of weights and
    weighted sum, combined exactly (each rescaled to the global max); the sample's slice is found from the slices'
    sums, then the token within it by its cumulative weights."""
    vocab = logits.shape[-1]
    if vocab <= columns:
        return _slice_stats(logits * inverse, uniform)
    tops, argmaxes, totals, weighted = [], [], [], []
    # two slice-sized buffers, written in place slice after slice: what this allocates does not grow with V
    scratch = torch.empty((2, *logits.shape[:-1], columns), dtype=torch.float32, device=logits.device)
    for start in range(0, vocab, columns):
        part = logits[..., start : start + columns]
        scaled, weights = scratch[0, ..., : part.shape[-1]], scratch[1, ..., : part.shape[-1]]
        torch.mul(part, inverse, out=scaled)
        top, argmax = scaled.max(dim=-1, keepdim=True)
        torch.sub(scaled, top, out=weights).exp_()
        tops.append(top[..., 0])
        argmaxes.append(argmax[..., 0] + start)
        totals.append(weights.sum(dim=-1))
        weighted.append(scaled.mul_(weights).sum(dim=-1))  # sum(weight x scaled): the slice's part of Z E_p[x]
    top, best, rescale = _rescaling(tops)
    mass = torch.stack(totals, dim=-1) * rescale  # [..., K] each slice's sum of exp(x - top)
    total = mass.sum(dim=-1)
    lse = top[..., 0] + total.log()
    entropy = lse - (torch.stack(weighted, dim=-1) * rescale).sum(dim=-1) / total
    argmax = torch.stack(argmaxes, dim=-1).gather(-1, best)[..., 0]
    # The sample: the first slice whose cumulative mass passes u * Z, then the token within it (never one of
    # probability zero: the remainder is kept below the slice's own cumulative total).
    cumulative = mass.cumsum(dim=-1)
    target = uniform * cumulative[..., -1:]
    chosen = torch.searchsorted(cumulative, target, right=True).clamp_(max=mass.shape[-1] - 1)  # [..., 1]
    remainder = (target - (cumulative.gather(-1, chosen) - mass.gather(-1, chosen))).clamp_(min=0.0)
    index = chosen * columns + torch.arange(columns, device=logits.device)  # [..., columns]
    inside = index < vocab
    picked = logits.gather(-1, index.clamp(max=vocab - 1)) * inverse
    cdf = (picked - top).exp_().masked_fill_(~inside, 0.0).cumsum(dim=-1)
    remainder = torch.minimum(remainder, torch.nextafter(cdf[..., -1:], torch.zeros_like(remainder)))
    within = torch.searchsorted(cdf, remainder, right=True)
    sample = (chosen * columns + within)[..., 0].clamp_(max=vocab - 1)
    return StepStats(sample, argmax, entropy, lse)


def logsumexp_sliced(logits: torch.Tensor, inverse: float = 1.0, rows: torch.Tensor | None = None,
                     columns: int = COLUMNS) -> torch.Tensor:  # fmt: skip
    """logsumexp(logits * inverse) over the last dimension in fp32, [...] (of `logits[rows]` when given), read in
    slices of `columns`: what it allocates does not grow with the vocabulary."""
    tops, totals = [], []
    leading = logits.shape[:-1] if rows is None else (len(rows),)
    scratch = torch.empty((*leading, columns), dtype=torch.float32, device=logits.device)  # one, slice after slice
    for start in range(0, logits.shape[-1], columns):
        part = logits[..., start : start + columns] if rows is None else logits[rows, start : start + columns]
        scaled = scratch[..., : part.shape[-1]].copy_(part).mul_(inverse)  # in fp32 (bf16 * a float stays bf16)
        top = scaled.amax(dim=-1, keepdim=True)
        tops.append(top[..., 0])
        totals.append(scaled.sub_(top).exp_().sum(dim=-1))
    top, _, rescale = _rescaling(tops)
    return top[..., 0] + (torch.stack(totals, dim=-1) * rescale).sum(dim=-1).log()


def _rescaling(tops: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The slices' maxima [...] each -> the global max [..., 1], the first slice holding it [..., 1] (torch's
    first-index argmax) and each slice's factor exp(max_k - max) [..., K], which puts its sums on the global max."""
    top_k = torch.stack(tops, dim=-1)
    top, best = top_k.max(dim=-1, keepdim=True)
    return top, best, (top_k - top).exp_()


def _slice_stats(scaled: torch.Tensor, uniform: torch.Tensor) -> StepStats:
    """scaled = logits / T [..., V] in fp32, one uniform draw per position [..., 1] -> StepStats [...].

    Five passes over the vocabulary (max with its index, subtract and exp, sum, dot, cumsum): the argmax of the
    scaled logits is the raw logits' (T > 0 keeps their order; bf16 -> fp32 is exact). A separate argmax and
    logsumexp made it 1.2-1.4 ms instead of 0.54 for a 32-slot gap of fp32 logits (2-core AMD EPYC)."""
    top, argmax = scaled.max(dim=-1, keepdim=True)
    weights = (scaled - top).exp_()  # probabilities times Z = sum(weights)
    total = weights.sum(dim=-1, keepdim=True)
    lse = top + total.log()
    entropy = lse[..., 0] - torch.linalg.vecdot(weights, scaled) / total[..., 0]  # H = lse - E_p[x]
    # Inverse CDF: the first token whose cumulative weight passes u * Z (right=True: never a zero-probability
    # token). An order of magnitude cheaper on the CPU than torch.multinomial or Gumbel noise over the vocabulary.
    cdf = weights.cumsum(dim=-1)
    sample = torch.searchsorted(cdf, uniform * cdf[..., -1:], right=True).squeeze(-1).clamp_(max=cdf.shape[-1] - 1)
    return StepStats(sample, argmax[..., 0], entropy, lse[..., 0])


if triton is not None:

    @triton.jit
    def _step_stats_kernel(
        logits_ptr,
        row_stride,
        vocab,
        inv_temperature,
        seed,
        sample_ptr,
        argmax_ptr,
        entropy_ptr,
        lse_ptr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        base = logits_ptr + row.to(tl.int64) * row_stride
        running_max = -float("inf")  # max of logits / T so far
        total = 0.0  # sum of exp(x - running_max)
        weighted = 0.0  # sum of exp(x - running_max) * x, for the entropy
        best = -float("inf")  # argmax of the raw logits
        best_index = 0
        drawn = -float("inf")  # Gumbel-max: argmax of x + g
        drawn_index = 0
        for start in range(0, vocab, BLOCK):
            columns = start + tl.arange(0, BLOCK)
            inside = columns < vocab
            raw = tl.load(base + columns, mask=inside, other=-float("inf")).to(tl.float32)
            x = raw * inv_temperature
            # argmax (first index on ties, like torch)
            block_best = tl.max(raw, axis=0)
            block_index = start + tl.argmax(raw, axis=0)
            take = block_best > best
            best_index = tl.where(take, block_index, best_index)
            best = tl.where(take, block_best, best)
            # online logsumexp and sum(p * x)
            new_max = tl.maximum(running_max, tl.max(x, axis=0))
            rescale = tl.exp(running_max - new_max)
            e = tl.where(inside, tl.exp(x - new_max), 0.0)
            total = total * rescale + tl.sum(e, axis=0)
            weighted = weighted * rescale + tl.sum(e * tl.where(inside, x, 0.0), axis=0)
            running_max = new_max
            # Gumbel-max sample: argmax(x + g), g = -log(-log(u))
            u = tl.rand(seed, (row * vocab + columns).to(tl.int32))
            u = tl.minimum(tl.maximum(u, 1e-20), 1.0 - 1e-7)
            gumbel = -tl.log(-tl.log(u))
            noisy = tl.where(inside, x + gumbel, -float("inf"))
            block_drawn = tl.max(noisy, axis=0)
            block_drawn_index = start + tl.argmax(noisy, axis=0)
            take = block_drawn > drawn
            drawn_index = tl.where(take, block_drawn_index, drawn_index)
            drawn = tl.where(take, block_drawn, drawn)
        lse = running_max + tl.log(total)
        tl.store(lse_ptr + row, lse)
        tl.store(entropy_ptr + row, lse - weighted / total)
        tl.store(argmax_ptr + row, best_index.to(tl.int64))
        tl.store(sample_ptr + row, drawn_index.to(tl.int64))


def step_stats_fused(logits: torch.Tensor, temperature: float, generator: torch.Generator,
                     block: int = 2048) -> StepStats:  # fmt: skip
    """The Triton kernel: logits [N, V] (any float dtype, last dim contiguous) -> StepStats, one read."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    rows, vocab = logits.shape
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator, device=generator.device).item())
    sample = torch.empty(rows, dtype=torch.int64, device=logits.device)
    argmax = torch.empty_like(sample)
    entropy = torch.empty(rows, dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(entropy)
    _step_stats_kernel[(rows,)](
        logits, logits.stride(0), vocab, 1.0 / temperature, seed, sample, argmax, entropy, lse, BLOCK=block
    )
    return StepStats(sample, argmax, entropy, lse)


def fused_available(device: torch.device) -> bool:
    """The kernel runs on CUDA with triton (or anywhere under TRITON_INTERPRET=1, for tests)."""
    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def step_stats_rows(logits: torch.Tensor, temperatures: Sequence[float], generators: Sequence[torch.Generator],
                    lengths: Sequence[int]) -> list[StepStats]:  # fmt: skip
    """One step's stats for several canvases at once: row r reads logits[r, :lengths[r]] ([B, G, V] in all) at
    temperatures[r], drawing its noise from generators[r] exactly as it would alone. Returns per-row StepStats with
    [1, lengths[r]] fields. The fused kernel per row on CUDA; on the CPU one set of batched torch ops."""
    if logits.device.type == "cuda" and fused_available(logits.device):
        return [
            step_stats_fused(logits[row, :n], temperature, generator).map(lambda t: t[None, :])
            for row, (temperature, generator, n) in enumerate(zip(temperatures, generators, lengths, strict=True))
        ]  # fmt: skip
    width = max(lengths)
    logits = logits[:, :width]
    inverse = torch.tensor([1.0 / t for t in temperatures], device=logits.device)[:, None, None]
    uniform = torch.full((*logits.shape[:-1], 1), 0.5, device=logits.device)
    for row, (generator, n) in enumerate(zip(generators, lengths, strict=True)):
        uniform[row, :n] = torch.rand((n, 1), generator=generator, device=logits.device)
    stats = _torch_stats(logits, inverse, uniform)
    return [stats.map(lambda t, row=row, n=n: t[row : row + 1, :n]) for row, n in enumerate(lengths)]


# -- the samplers a canvas's steps use: transformers' entropy-bound sampler, seeded, and a left-to-right baseline --


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
    """transformers' stopping rule, reading per-token entropies computed once per step instead of the logits.

    With `stop_ids`, the rule looks only at the answer: the slots up to and including the first stop token of the
    argmax canvas (what `_close_canvas` keeps). The EOS fill after it can still flicker without holding the answer
    back, as an autoregressive decoder stops at its EOS without settling what would come after."""

    def __call__(self, argmax_canvas, logits=None, token_entropy=None, stop_ids=None, gap_starts=None, **kwargs):  # type: ignore[override]
        """`gap_starts` ([G] long, several gaps): each slot's gap's first slot; the answer scope is then per gap."""
        if token_entropy is None:
            return super().__call__(argmax_canvas, logits)
        scope = torch.ones_like(argmax_canvas, dtype=torch.bool)
        if stop_ids is not None:
            is_stop = torch.isin(argmax_canvas, stop_ids)
            before = is_stop.cumsum(dim=-1) - is_stop.long()  # stop tokens before this slot
            if gap_starts is not None:
                before = before - before[:, gap_starts]  # ...within its own gap
            scope = before == 0
            argmax_canvas = argmax_canvas.masked_fill(~scope, -2)  # past the answer: a constant, always stable
        # The parent's stability bookkeeping, fed a one-class stand-in (entropy 0, so "confident" always holds)...
        stand_in = torch.zeros((*argmax_canvas.shape, 1), device=argmax_canvas.device)
        stable = super().__call__(argmax_canvas, stand_in)
        # ...and the confidence test on the real entropies, over the scope.
        mean_entropy = (token_entropy * scope).sum(dim=-1) / scope.sum(dim=-1)
        return stable & (mean_entropy < self.confidence_threshold)


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
