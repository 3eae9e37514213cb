"""Training examples and their losses: the objective is the engine's "canvas" layout.

One training example, cut from a corpus file at text offsets a <= b (so tokenization matches inference, where the
prefix and the suffix are tokenized apart):

    encoder: [BOS] + last P-1 tokens of text[:a]                  (left-padded; causal; also an AR loss)
    canvas : G gap slots = middle tokens, EOS, EOS fill...        (noised: each slot -> uniform token w.p. t)
             + S suffix-head tokens of text[b:]                   (clamped: never noised, no loss)

t ~ U(0, 1) per example. Cross-entropy on the gap, weighted so that the middle and its first EOS dominate (the
rest of the EOS fill counts `EOS_FILL_WEIGHT` as much): a first trial that weighted every slot alike learned to
fill gaps with EOS. Half the steps use self-conditioning: a no-grad decoder pass feeds its logits to the real one.
The encoder's hidden states also get a next-token loss (DiffusionGemma's own recipe started from a causal model;
the shared stack gets that cheapest-per-FLOP signal here on every step, for the price of one LM-head matmul).

Middles: single line (whole line, or the rest of a line), multi-line, random span, empty. A cut the engine would
heal (a prefix ending in the space before a word, or inside a word's token) moves back to the token boundary, as
the engine's token healing does, so that the model learns the boundaries it will be shown.

What only a canvas can hold, at configurable shares of the examples:
    several gaps  2-4 lines (or line tails) cut out of a run of code, the code between them clamped in the canvas:
                  [gap 1 | clamped | gap 2 | ... | suffix head], every gap noised, each with its own EOS fill
                  (`Engine.fill`'s layout); each gap weighs 1/k of the example
    rewrites      the gap's un-noised slots show a corrupted middle (some tokens replaced by tokens of the same
                  file) instead of the true one: the model learns to correct what it is shown, as a span rewrite
                  (`Hole(text, strength)`) asks of it
"""

from __future__ import annotations

import itertools
import os
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache

from .corpus import CorpusFile
from .loss import softcapped_cross_entropy
from .tokenizer import TokenHealing

if TYPE_CHECKING:
    from .commits import EditText
    from .train_config import TrainConfig

EOS_FILL_WEIGHT = 0.05


@dataclass
class Example:
    prefix: list[int]  # encoder ids, BOS first, at most P
    gap: list[int]  # G ids: middle + EOS fill (or the first G middle tokens when it does not fit)
    middle_len: int  # real middle tokens in the gap (EOS excluded)
    head: list[int]  # the rest of the canvas: up to S suffix-head ids, or (several gaps) clamped code and gaps
    # Several gaps: per `head` slot, whether it belongs to a later gap (noised, with a loss), and its loss weight.
    head_gap: list[bool] = field(default_factory=list)
    head_weight: list[float] = field(default_factory=list)
    # A rewrite: what the gap's un-noised slots show (a corrupted middle); None shows the middle itself.
    start: list[int] | None = None
    gaps: int = 1


class ExampleSampler:
    """Cuts infill examples out of corpus files, in text space, the way the engine will see them."""

    def __init__(self, files: list[CorpusFile], tokenizer: Any, seed: int, prefix_tokens: int, head_tokens: int,
                 healing: TokenHealing | None = None, multi_share: float = 0.0,
                 rewrite_share: float = 0.0, editor_share: float = 0.0,
                 edits: Sequence[EditText] = (), edit_share: float = 0.0):  # fmt: skip
        self.files = [f for f in files if f.text.count("\n") >= 3]
        self.edits, self.edit_share = list(edits), edit_share
        self.multi_share, self.rewrite_share, self.editor_share = multi_share, rewrite_share, editor_share
        self.tokenizer = tokenizer
        self.healing = healing
        self.rng = random.Random(seed)
        self.prefix_tokens = prefix_tokens
        self.head_tokens = head_tokens
        self.bos, self.eos = tokenizer.bos_token_id, tokenizer.eos_token_id

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def _cut(self, text: str) -> tuple[int, int]:
        """Pick [a, b): the middle's text span."""
        rng = self.rng
        starts = [0] + [i + 1 for i, ch in enumerate(text) if ch == "\n" and i + 1 < len(text)]
        if self.editor_share and rng.random() < self.editor_share:
            cut = self._editor_cut(text, starts)
            if cut is not None:
                return cut
        kind = rng.random()
        line = rng.randrange(len(starts))
        a = starts[line]
        end_of_line = text.find("\n", a)
        end_of_line = len(text) if end_of_line < 0 else end_of_line + 1
        if kind < 0.35:  # a whole line, with its indentation and newline (HumanEval single-line)
            return a, end_of_line
        if kind < 0.55:  # the rest of a line from inside it (typing), newline left in the suffix
            stop = max(a, end_of_line - 1)
            a = rng.randint(a, stop)
            return a, stop
        if kind < 0.75:  # several whole lines
            last = min(len(starts) - 1, line + rng.randint(2, 6))
            b = starts[last] if last > line else end_of_line
            return a, b
        if kind < 0.92:  # a random span
            a = rng.randrange(len(text))
            return a, min(len(text), a + rng.randint(1, 120))
        return a, a  # empty middle: the gap is all EOS

    def _editor_cut(self, text: str, starts: list[int]) -> tuple[int, int] | None:
        """Where an editor asks: the cursor after a line's indentation (after Enter, or on a line's first
        keystroke), the middle its code through the end of that line, or of 1-3 more lines (a multi-line hole); the
        last newline stays in the suffix. None when 16 lines drawn held no code."""
        for _ in range(16):
            line = self.rng.randrange(len(starts))
            a = starts[line]
            body = text[a:].split("\n", 1)[0]
            code = a + len(body) - len(body.lstrip(" \t"))
            if code < a + len(body):
                last = min(len(starts) - 1, line + (self.rng.randint(1, 3) if self.rng.random() < 0.3 else 0))
                end = text.find("\n", starts[last])
                return code, len(text[: len(text) if end < 0 else end].rstrip("\r\n"))  # not past blank lines
        return None

    def example(self, gap_tokens: int) -> Example:
        if self.edits and self.rng.random() < self.edit_share:
            edit = self._edit(self.rng.choice(self.edits), gap_tokens)
            if edit is not None:
                return edit
        file = self.rng.choice(self.files)
        text = file.text
        draw = self.rng.random()
        if draw < self.multi_share:
            several = self._several(text, gap_tokens)
            if several is not None:
                return several
        elif draw < self.multi_share + self.rewrite_share:
            return self._rewrite(self._single(text, gap_tokens))
        return self._single(text, gap_tokens)

    def _heal(self, text: str, a: int, floor: int = 0) -> int:
        """Where the engine would cut a prefix ending at `a` (token healing), never before `floor`."""
        if self.healing is None:
            return a
        return max(floor, a - len(self.healing.cut(text[max(floor, a - 200) : a])))

    def _prefix(self, text: str, a: int) -> list[int]:
        return [self.bos, *self._encode(text[max(0, a - 6 * self.prefix_tokens) : a])[-(self.prefix_tokens - 1) :]]

    def _gap(self, middle: list[int], gap_tokens: int) -> tuple[list[int], int]:
        if len(middle) >= gap_tokens:
            return middle[:gap_tokens], gap_tokens
        return middle + [self.eos] * (gap_tokens - len(middle)), len(middle)

    def _several(self, text: str, gap_tokens: int) -> Example | None:
        """2-4 gaps, each a line's code (after its indentation) or a line's tail, in a run of lines; the code
        between them clamped. None when the file has no such run that fits."""
        rng = self.rng
        starts = [0] + [i + 1 for i, ch in enumerate(text) if ch == "\n" and i + 1 < len(text)]
        count = rng.randint(2, 4)
        first = rng.randrange(len(starts))
        lines = sorted({first, *(first + rng.randint(1, 8) * (i + 1) for i in range(count - 1))})
        lines = [line for line in lines if line < len(starts)]
        spans: list[tuple[int, int]] = []
        for line in lines:
            a = starts[line]
            end = text.find("\n", a)
            end = len(text) if end < 0 else end
            code = a + len(text[a:end]) - len(text[a:end].lstrip(" \t"))
            if code >= end:
                continue  # a blank line holds no code
            a = code if rng.random() < 0.7 else rng.randint(code, end - 1)  # the line's code, or its tail
            if spans and a <= spans[-1][1]:
                continue
            spans.append((self._heal(text, a, spans[-1][1] if spans else 0), end))
        if len(spans) < 2:
            return None
        gaps = [self._encode(text[a:b]) for a, b in spans]
        clamps = [self._encode(text[b:a]) for (_, b), (a, _) in itertools.pairwise(spans)]
        if any(len(g) >= gap_tokens for g in gaps) or sum(map(len, clamps)) > 4 * self.head_tokens:
            return None
        first_gap, middle_len = self._gap(gaps[0], gap_tokens)
        head: list[int] = []
        head_gap: list[bool] = []
        head_weight: list[float] = []
        for clamp, middle in zip(clamps, gaps[1:], strict=True):
            slots, filled = self._gap(middle, gap_tokens)
            head += clamp + slots
            head_gap += [False] * len(clamp) + [True] * len(slots)
            head_weight += [0.0] * len(clamp) + _gap_weights(filled, gap_tokens, len(spans))
        tail = self._encode(text[spans[-1][1] : spans[-1][1] + 8 * self.head_tokens])[: self.head_tokens]
        head += tail
        head_gap += [False] * len(tail)
        head_weight += [0.0] * len(tail)
        return Example(self._prefix(text, spans[0][0]), first_gap, middle_len, head, head_gap, head_weight,
                       gaps=len(spans))  # fmt: skip

    def _rewrite(self, example: Example) -> Example:
        """The gap's un-noised slots show the middle with some tokens replaced by tokens of the same prefix."""
        if example.middle_len == 0 or len(example.prefix) < 2:
            return example
        start = list(example.gap)
        share = self.rng.uniform(0.05, 0.35)
        for slot in range(example.middle_len):
            if self.rng.random() < share:
                start[slot] = self.rng.choice(example.prefix[1:])
        return replace(example, start=start)

    def _edit(self, edit: EditText, gap_tokens: int) -> Example | None:
        """A next edit as a rewrite: after the recent edits (comment lines, as the server writes them), the gap's
        un-noised slots show the lines as they stand and the targets are the lines as the commit left them (the
        same lines for a no-op). None when either does not fit the gap."""
        old, new = self._encode(edit.old), self._encode(edit.new)
        if len(old) > gap_tokens or len(new) >= gap_tokens:
            return None
        prompt = edit.prompt
        gap, middle_len = self._gap(new, gap_tokens)
        start = old + [self.eos] * (gap_tokens - len(old))
        head = self._encode(edit.tail[: 8 * self.head_tokens])[: self.head_tokens]
        return Example(self._prefix(prompt, len(prompt)), gap, middle_len, head, start=start)

    def _single(self, text: str, gap_tokens: int) -> Example:
        a, b = self._cut(text)
        if a < b:  # the prefix ends where the engine would cut it (token healing)
            a = self._heal(text, a)
        head = self._encode(text[b : b + 8 * self.head_tokens])[: self.head_tokens]
        gap, middle_len = self._gap(self._encode(text[a:b]), gap_tokens)
        return Example(self._prefix(text, a), gap, middle_len, head)


def _gap_weights(middle_len: int, gap_len: int, gaps: int) -> list[float]:
    """A gap's loss weights: the middle and its first EOS dominate, the EOS fill after it counts EOS_FILL_WEIGHT as
    much; the gap sums to 1/gaps of its example."""
    counted = min(middle_len + 1, gap_len)
    return [(1.0 if slot < counted else EOS_FILL_WEIGHT) / counted / gaps for slot in range(gap_len)]


class BatchStream(torch.utils.data.IterableDataset):
    """Endless training batches (the gap size drawn per batch). In DataLoader workers each worker cuts its own
    examples under its own seed: on a GPU, cutting and tokenizing 128 examples (~0.15 s on one core) would
    otherwise leave the device idle most of each step."""

    def __init__(self, files: list[CorpusFile], tokenizer: Any, seed: int, cfg: TrainConfig,
                 healing: TokenHealing | None, edits: Sequence[EditText] = ()):  # fmt: skip
        self.files, self.tokenizer, self.seed, self.cfg, self.healing = files, tokenizer, seed, cfg, healing
        self.edits = edits

    def __iter__(self) -> Iterator[Batch]:
        worker = torch.utils.data.get_worker_info()
        seed = self.seed + (1_000_003 * (worker.id + 1) if worker is not None else 0)
        cfg = self.cfg
        sampler = ExampleSampler(self.files, self.tokenizer, seed, cfg.prefix_tokens, cfg.head_tokens, self.healing,
                                 cfg.multi_gap_share, cfg.rewrite_share, cfg.editor_share, self.edits,
                                 cfg.edit_share)  # fmt: skip
        rng = random.Random(seed)
        while True:
            gap = rng.choice(cfg.gap_choices)
            yield collate([sampler.example(gap) for _ in range(cfg.batch_size)], self.tokenizer.pad_token_id)

    def batches(self, workers: int, pin_memory: bool) -> Iterator[Batch]:
        if workers == 0:
            return iter(self)
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the workers are forked from a tokenizer user
        loader = torch.utils.data.DataLoader(self, batch_size=None, num_workers=workers, prefetch_factor=4,
                                             pin_memory=pin_memory, persistent_workers=True)  # fmt: skip
        return iter(loader)


@dataclass
class Batch:
    prefix: torch.Tensor  # [B, P] left-padded with pad
    prefix_mask: torch.Tensor  # [B, P] bool
    prefix_positions: torch.Tensor  # [B, P] 0 at BOS
    gap: torch.Tensor  # [B, G] targets
    gap_weight: torch.Tensor  # [B, G] loss weights; with the later gaps' weights each example sums to 1
    head: torch.Tensor  # [B, S] right-padded with pad: clamped ids, and the targets of later gaps
    head_mask: torch.Tensor  # [B, S] bool
    gap_start: torch.Tensor  # [B, G] what the un-noised gap slots show: the targets, or a rewrite's corrupted middle
    head_gap: torch.Tensor  # [B, S] bool: slots of later gaps (noised, with a loss)
    head_weight: torch.Tensor  # [B, S] their loss weights

    def to(self, device: torch.device) -> Batch:
        return Batch(*(getattr(self, f.name).to(device, non_blocking=True) for f in fields(self)))

    def pin_memory(self) -> Batch:  # DataLoader(pin_memory=True) calls this
        return Batch(*(getattr(self, f.name).pin_memory() for f in fields(self)))


def collate(examples: list[Example], pad: int) -> Batch:
    width = max(len(e.prefix) for e in examples)
    gap_len = len(examples[0].gap)
    head_len = max(1, max(len(e.head) for e in examples))
    prefix = torch.full((len(examples), width), pad, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.bool)
    positions = torch.zeros((len(examples), width), dtype=torch.long)
    head = torch.full((len(examples), head_len), pad, dtype=torch.long)
    head_mask = torch.zeros((len(examples), head_len), dtype=torch.bool)
    weight = torch.zeros((len(examples), gap_len))
    head_gap = torch.zeros((len(examples), head_len), dtype=torch.bool)
    head_weight = torch.zeros((len(examples), head_len))
    for row, e in enumerate(examples):
        n = len(e.prefix)
        prefix[row, width - n :] = torch.tensor(e.prefix)
        mask[row, width - n :] = True
        positions[row, width - n :] = torch.arange(n)
        if e.head:
            head[row, : len(e.head)] = torch.tensor(e.head)
            head_mask[row, : len(e.head)] = True
        if e.head_gap:
            head_gap[row, : len(e.head_gap)] = torch.tensor(e.head_gap)
            head_weight[row, : len(e.head_weight)] = torch.tensor(e.head_weight)
        weight[row] = torch.tensor(_gap_weights(e.middle_len, gap_len, e.gaps))
    gap = torch.tensor([e.gap for e in examples], dtype=torch.long)
    start = torch.tensor([e.start if e.start is not None else e.gap for e in examples], dtype=torch.long)
    return Batch(prefix, mask, positions, gap, weight, head, head_mask, start, head_gap, head_weight)


def losses(
    model: Any, batch: Batch, generator: torch.Generator, self_condition: bool, fused_head: bool = True
) -> dict[str, torch.Tensor]:
    """Diffusion loss on the gap and next-token loss on the prefix, for one batch."""
    vocab = model.config.text_config.vocab_size
    bsz, gap_len = batch.gap.shape

    # 1. Encoder: the prefix into a fresh cache; its hidden states also learn next-token prediction.
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    encoded = model.model.encoder(
        input_ids=batch.prefix,
        attention_mask=batch.prefix_mask.long(),
        position_ids=batch.prefix_positions,
        cache=cache,
        use_cache=True,
    )
    hidden = model.config.text_config.hidden_size
    ar_weights = (batch.prefix_mask[:, 1:] & batch.prefix_mask[:, :-1]).float()
    ar_loss = softcapped_cross_entropy(
        encoded.last_hidden_state[:, :-1].reshape(-1, hidden), model.lm_head.weight, batch.prefix[:, 1:].reshape(-1),
        (ar_weights / ar_weights.sum().clamp(min=1)).reshape(-1), model.final_logit_softcapping, fused_head,
    )  # fmt: skip

    # 2. Canvas: noise the gap at level t, clamp the suffix head.
    device = batch.gap.device
    t = torch.rand(bsz, 1, generator=generator, device=device)
    noised = torch.rand(bsz, gap_len, generator=generator, device=device) < t
    noise = torch.randint(0, vocab, (bsz, gap_len), generator=generator, device=device)
    head = batch.head
    several = bool(batch.head_gap.any())
    if several:  # later gaps in the canvas: noised at the same level
        head_noised = batch.head_gap & (torch.rand(head.shape, generator=generator, device=device) < t)
        head = torch.where(head_noised, torch.randint(0, vocab, head.shape, generator=generator, device=device), head)
    canvas = torch.cat([torch.where(noised, noise, batch.gap_start), head], dim=1)  # [B, G+S]
    start = batch.prefix_mask.sum(dim=1, keepdim=True)  # first canvas position per row
    positions = start + torch.arange(canvas.shape[1], device=device)[None, :]
    attention = torch.cat([batch.prefix_mask, torch.ones_like(noised), batch.head_mask], dim=1).long()
    decoder_kwargs = {"cache": cache, "decoder_attention_mask": attention, "decoder_position_ids": positions}

    # 3. Self-conditioning on half the steps: a no-grad pass's logits feed the real pass.
    self_cond = None
    if self_condition:
        with torch.no_grad():
            self_cond = model(decoder_input_ids=canvas, **decoder_kwargs).logits.detach()
    decoded = model.model(decoder_input_ids=canvas, self_conditioning_logits=self_cond, **decoder_kwargs)
    rows = decoded.last_hidden_state[:, :gap_len].reshape(-1, hidden)
    targets, weights = batch.gap.reshape(-1), (batch.gap_weight / bsz).reshape(-1)
    if several:  # the later gaps' slots too
        rows = torch.cat([rows, decoded.last_hidden_state[:, gap_len:][batch.head_gap]])
        targets = torch.cat([targets, batch.head[batch.head_gap]])
        weights = torch.cat([weights, batch.head_weight[batch.head_gap] / bsz])
    diffusion_loss = softcapped_cross_entropy(rows, model.lm_head.weight, targets, weights,
                                              model.final_logit_softcapping, fused_head)  # fmt: skip
    return {"diffusion": diffusion_loss, "ar": ar_loss}
