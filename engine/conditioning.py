"""Self-conditioning for a batch of canvases: each row's last-step logits, kept in one buffer the decoder reads.

DiffusionGemma's decoder takes the previous step's (tempered) logits of every canvas slot, `[rows, width, V]`, and a
per-row mask (a row in its first step has none). At DiffusionGemma's vocabulary (V = 262,144) a row of 256 slots is
134 MB in bf16, so the batch keeps one buffer for its rows and writes into it in place: a row's logits when its job
steps (`write`), its mask off when a job joins or opens a new canvas (`clear`), rows moved up when jobs leave
(`keep`). Nothing per step allocates or concatenates `[rows, width, V]`; the buffer is reallocated only when the
batch outgrows it or its canvas width changes (a job joins or leaves), never during a run of steps.

The decoder reads `inputs(rows, width)`: contiguous views of the buffer, so a compiled graph sees the same layout
as before. Slots past a row's canvas and rows whose mask is off hold stale but finite values (the buffer starts at
zero): the model multiplies masked rows' soft embeddings by zero and masks padded slots out of attention, so the
answers are those of freshly zeroed inputs. The buffer is an inference tensor, as the step's inputs are (a compiled
graph's guards read that); the methods that write it run in inference mode.

`SparseSelfConditioning` (a CPU's int8 weights, `quantize.cpu_int8`) keeps the soft embeddings themselves, `[rows,
width, hidden]`: what the decoder would compute from the logits (softmax, then times the embedding matrix: on a 0.5B
model with 151,936 tokens, 8.7 GFLOP a step, 109 of a 393 ms int8 step on 2 Zen 2 cores), from each slot's `TOP_K`
most likely tokens exactly and the rest of the probability spread evenly over the other tokens' embeddings. On the
shipped model's own steps (186 canvases' logits) that soft embedding pointed where the exact one does within a
cosine of 0.973 at worst, 0.9986 on average (the top 64 alone: 0.728 / 0.993); the block that reads it normalises
its length. The decoder is then passed no logits, and a hook on its self-conditioning block (`SoftInput`) hands the
block these embeddings in place of the zeros the decoder made.
"""

from __future__ import annotations

from typing import Any

import torch

from .sampling import logsumexp_sliced

TOP_K = 64  # the tokens per slot `SparseSelfConditioning` weighs exactly


class SelfConditioning:
    def __init__(self, vocab_size: int, dtype: torch.dtype, device: torch.device):
        self.vocab_size, self.dtype, self.device = vocab_size, dtype, device
        self.columns = vocab_size  # what the buffer keeps per slot
        self.buffer: torch.Tensor | None = None  # [capacity, width, columns]
        self.mask: torch.Tensor | None = None  # [capacity] bool, on the device
        self.flags: list[bool] = []  # the mask as the host knows it (no device read to decide anything)
        self.reallocations = 0

    def any(self, rows: int) -> bool:
        """Whether any of the first `rows` rows carries last step's logits."""
        return any(self.flags[:rows])

    def inputs(self, rows: int, width: int, canvas: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder's `self_conditioning_logits` [rows, width, V] and `self_conditioning_mask` [rows], from a
        buffer of the batch's `canvas` width (the forward's `width` unless a gap-only step computes fewer slots,
        `suffix_kv.py`: the buffer keeps the clamped slots' logits for the next full step)."""
        self.fit(rows, canvas or width)
        assert self.buffer is not None and self.mask is not None
        return self.buffer[:rows, :width], self.mask[:rows]

    @torch.inference_mode()
    def write(self, row: int, logits: torch.Tensor, temperature: float) -> None:
        """Row `row` conditions the next step on `logits` [L, V] / `temperature` (in the buffer's dtype); the buffer
        `fit` the batch first."""
        assert self.buffer is not None and row < self.buffer.shape[0] and logits.shape[0] <= self.width
        torch.div(logits, temperature, out=self.buffer[row, : logits.shape[0]])
        self._flag(row, True)

    @torch.inference_mode()
    def clear(self, row: int) -> None:
        """Row `row` has no logits to condition on (a job's first step on a canvas)."""
        if row < len(self.flags) and self.flags[row]:
            self._flag(row, False)

    @torch.inference_mode()
    def keep(self, rows: list[int]) -> None:
        """Only these rows stay, in this order, moved up to 0..len(rows)-1 (the jobs left in the batch). A row past
        the buffer (a job that joined after it was laid out) has nothing to move: its place is cleared."""
        for target, source in enumerate(rows):
            if source == target:
                continue
            if self.buffer is not None and source < self.buffer.shape[0]:
                self.buffer[target].copy_(self.buffer[source])
                self._flag(target, self.flags[source])
            else:
                self.clear(target)
        for row in range(len(rows), len(self.flags)):
            self.clear(row)

    @property
    def width(self) -> int:
        return 0 if self.buffer is None else self.buffer.shape[1]

    def _flag(self, row: int, value: bool) -> None:
        assert self.mask is not None
        self.flags[row] = value
        self.mask[row] = value

    @torch.inference_mode()
    def fit(self, rows: int, width: int) -> None:
        """A buffer of at least `rows` rows and exactly `width` slots, the kept rows' logits carried over."""
        if self.buffer is not None and self.buffer.shape[0] >= rows and self.buffer.shape[1] == width:
            return
        capacity = max(rows, len(self.flags))
        buffer = torch.zeros((capacity, width, self.columns), dtype=self.dtype, device=self.device)
        mask = torch.zeros(capacity, dtype=torch.bool, device=self.device)
        if self.buffer is not None and self.mask is not None:
            kept, slots = self.buffer.shape[0], min(width, self.buffer.shape[1])
            buffer[:kept, :slots] = self.buffer[:, :slots]
            mask[:kept] = self.mask
        self.flags += [False] * (capacity - len(self.flags))
        self.buffer, self.mask = buffer, mask
        self.reallocations += 1


class SparseSelfConditioning(SelfConditioning):
    """The rows' soft embeddings `[rows, width, hidden]` (see the module's docstring), handed to the decoder's
    self-conditioning block by `SoftInput`; a row without last step's logits holds zeros, as the decoder's mask
    would make them."""

    def __init__(self, model: Any, top_k: int = TOP_K):
        embed = model.model.decoder.embed_tokens
        super().__init__(embed.weight.shape[0], embed.weight.dtype, embed.weight.device)
        self.embed, self.scale = embed.weight, embed.embed_scale.to(embed.weight.dtype)
        self.top_k = min(top_k, self.vocab_size)
        self.columns = embed.weight.shape[1]
        self.total = embedding_total(model)  # every token's embedding summed: the tail's spread
        self.input = SoftInput.of(model)

    @torch.inference_mode()
    def write(self, row: int, logits: torch.Tensor, temperature: float) -> None:
        assert self.buffer is not None and row < self.buffer.shape[0] and logits.shape[0] <= self.width
        # the top k probabilities without a softmax over the vocabulary: the top k logits (T > 0 keeps the order),
        # exp(x / T - logsumexp), the log-sum-exp read in slices (what a step allocates does not grow with V)
        values, tokens = logits.topk(self.top_k, dim=-1)  # [L, k]
        top = (values.float() / temperature - logsumexp_sliced(logits, 1.0 / temperature)[:, None]).exp_()
        picked = self.embed[tokens]  # [L, k, hidden]
        soft = torch.einsum("lk,lkh->lh", top.to(picked.dtype), picked)  # [L, hidden]
        rest = self.vocab_size - self.top_k
        if rest:  # the other tokens' share, spread evenly over their embeddings
            soft += (1 - top.sum(-1, keepdim=True)) * (self.total - picked.sum(dim=1)) / rest
        torch.mul(soft, self.scale, out=self.buffer[row, : logits.shape[0]])
        self._flag(row, True)

    @torch.inference_mode()
    def clear(self, row: int) -> None:
        if row < len(self.flags) and self.flags[row]:
            assert self.buffer is not None
            self.buffer[row].zero_()
            self._flag(row, False)

    def feed(self, rows: int, width: int, canvas: int | None = None) -> None:
        """The next decoder forward's self-conditioning: these rows' soft embeddings, or none while no row has any
        (the decoder's zeros)."""
        self.input.soft = self.inputs(rows, width, canvas)[0] if self.any(rows) else None


def embedding_total(model: Any) -> torch.Tensor:
    """Every token's embedding summed, once per model: a batch per request (the local backend's) paid it each time,
    67 ms of a 0.5B model's request (151,936 x 896)."""
    if not hasattr(model, "canvas_ls_embedding_total"):
        model.canvas_ls_embedding_total = model.model.decoder.embed_tokens.weight.detach().sum(dim=0)
    return model.canvas_ls_embedding_total


class SoftInput:
    """A forward pre-hook on a decoder's self-conditioning block: replaces the signal the decoder computed (zeros,
    when passed no logits) by `soft` where it is set. One per model (`of`), set before each forward by the batch
    that runs it, and used once: a forward nothing fed (another caller's, with logits of its own) computes its own."""

    def __init__(self, block: torch.nn.Module):
        self.soft: torch.Tensor | None = None
        block.register_forward_pre_hook(self._hook)

    @classmethod
    def of(cls, model: Any) -> SoftInput:
        if not hasattr(model, "canvas_ls_soft_input"):
            model.canvas_ls_soft_input = cls(model.model.decoder.self_conditioning)
        return model.canvas_ls_soft_input

    def _hook(self, module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        soft, self.soft = self.soft, None
        if soft is None:
            return None
        inputs_embeds, signal = args
        return inputs_embeds, soft.to(signal.dtype)
