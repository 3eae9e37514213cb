"""The token n-gram cache of the user's code, mixed into the denoising step: adaptation without training.

Code repeats itself: a file's and a repository's own names, imports, call shapes and idioms recur, and a small model
has seen none of them. A cache language model (Kuhn & De Mori's cache, and for code Tu et al. 2014 and Hellendoorn &
Devanbu 2017, where an n-gram cache of the file and the project beat neural models on project-specific tokens)
counts what followed each context in the code's own token stream. Here the counts come from the request's document
as the editor holds it (`TokenCache.of_document`: the code on both sides of the gap, unsaved edits included) and
from its workspace's files (`from_texts`, built in the background: `WorkspaceCaches`), in the model's tokens: the
longest context either holds, the document's where both hold one that long (`Caches`). At each denoising step a
gap slot whose preceding tokens are known (the prefix, the clamped code of a fill, or slots the sampler has
accepted) gets its distribution mixed with the cache's:

    p(stop)  = p_model(stop)     the answer's end (EOS, pad) is the model's to say: code holds no answers' ends
    p(token) = (1 - lam) p_model(token) + lam (1 - p(stop)) p_cache(token | the longest context of ORDERS held)
    lam      = weight * n / (n + PRIOR)        n: how often that context occurs, weighted (a rare one counts less)

The mixture replaces the slot's logits (log p) before the step's statistics, so sampling, acceptance, stopping and the
shown confidence all see it; tokens the step bars (token healing) stay barred. Where the cache alone makes a slot
near certain (CHAIN), that token is taken as the next slot's context within the same step (`lookups`), so a run the
repository always writes (an identifier of several tokens, a call it always makes) fills at once rather than one
token a step. The stream is indexed per context
length by sorted 64-bit rolling hashes (numpy: a few bytes a token per length, no Python dict per n-gram), so a
lookup is two binary searches and a count of the tokens that followed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np
import torch

from .sampling import COLUMNS, logsumexp_sliced

log = logging.getLogger(__name__)

ORDERS = (8, 6, 5, 4, 3, 2)  # context lengths tried, longest first
PRIOR = 1.0  # a context seen n times weighs n / (n + PRIOR) of the cache's weight
DOCUMENT_TOKENS = 8192  # of a request's own document, nearest its gap (`TokenCache.of_document`: 2-6 ms to build)
DOCUMENT_WEIGHT = 4.0  # a context's count in the request's own document, times this (mixes in more strongly: `Caches`)
CHAIN = 0.8  # a slot the cache alone puts this much on one token is the context of the next slot (`lookups`)
Found = tuple[int, np.ndarray, np.ndarray]  # (gap slot, token ids, counts) of what followed its context
_BASE = np.uint64(1_000_003)
_SEPARATOR = -1  # between files: no context crosses it


class TokenCache:
    def __init__(self, stream: np.ndarray, orders: Sequence[int] = ORDERS):
        """`stream`: token ids of the files one after the other, `_SEPARATOR` between them; `orders`: of ORDERS."""
        self.tokens = int((stream != _SEPARATOR).sum())
        self.orders = tuple(sorted(orders, reverse=True))
        self._tables: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        separator = np.concatenate([[0], np.cumsum(stream == _SEPARATOR)])  # separators in stream[:i]
        for order in self.orders:
            if len(stream) <= order:
                continue
            targets = np.arange(order, len(stream))
            clean = (separator[targets + 1] - separator[targets - order]) == 0  # no separator in context or target
            hashes = _window_hashes(stream, order)[:-1][clean]  # the window before each target
            following = stream[targets][clean].astype(np.int32)
            sort = np.argsort(hashes, kind="stable")
            self._tables[order] = (hashes[sort], following[sort])

    @classmethod
    def from_texts(cls, texts: Iterable[str], encode: Callable[[str], list[int]]) -> TokenCache:
        return cls.from_ids(encode(text) for text in texts)

    @classmethod
    def from_ids(cls, parts: Iterable[Sequence[int]]) -> TokenCache:
        """The cache of token id sequences (files, or the parts of one document between its gaps)."""
        stream: list[np.ndarray] = []
        for ids in parts:
            stream += [np.asarray(ids, dtype=np.int64), np.asarray([_SEPARATOR], dtype=np.int64)]
        return cls(np.concatenate(stream) if stream else np.zeros(0, dtype=np.int64))

    @classmethod
    def of_document(cls, before: Sequence[int], after: Sequence[Sequence[int]],
                    budget: int = DOCUMENT_TOKENS) -> TokenCache:  # fmt: skip
        """The cache of the document a request completes, as the editor holds it now (unsaved, and with the
        snippets of other files the prefix carries): the end of the text `before` its first gap and the start of
        the parts `after` it, `budget` tokens in all, at most a quarter of them after."""
        room, kept = budget // 4, []
        for ids in after:
            kept.append(ids[:room])
            room -= len(kept[-1])
        head = budget - sum(len(ids) for ids in kept)
        return cls.from_ids([before[max(len(before) - head, 0) :], *kept])

    def following(self, context: Sequence[int]) -> tuple[np.ndarray, np.ndarray] | None:
        """(token ids, counts) of what followed the longest of `context`'s endings this cache holds, or None."""
        return Caches([(self, 1.0)]).following(context)

    def at(self, order: int, context: Sequence[int]) -> np.ndarray | None:
        """Every token that followed `context`'s last `order` tokens (with repeats), or None where none did."""
        if len(context) < order or order not in self._tables:
            return None
        hashes, following = self._tables[order]
        key = np.uint64(_hash(context[-order:]))
        low, high = hashes.searchsorted(key, "left"), hashes.searchsorted(key, "right")
        return following[low:high] if high > low else None


class Caches:
    """Several token caches read as one, in order of preference (the document's own code, then its workspace's):
    what followed the longest context any of them holds, from the first that holds one that long, its counts times
    that cache's weight (a count in the document weighs DOCUMENT_WEIGHT: its contexts mix in more strongly)."""

    def __init__(self, caches: Sequence[tuple[TokenCache, float]], before: Sequence[int] = ()):
        self.caches = list(caches)
        # The document's last tokens before the first gap: the context of its first slots (in the "prompt" layout
        # the encoder's own last tokens are the prompt's template, no part of the document)
        self.before = list(before[-ORDERS[0] :])

    def following(self, context: Sequence[int]) -> tuple[np.ndarray, np.ndarray] | None:
        for order in ORDERS:
            for cache, weight in self.caches:
                hit = cache.at(order, context)
                if hit is not None:
                    ids, counts = np.unique(hit, return_counts=True)
                    return ids, counts * weight
        return None


def _hash(ids: Sequence[int]) -> int:
    """`_window_hashes` of one window, in Python integers (a lookup's few tokens: faster than numpy's arrays)."""
    value = 0
    for token in ids:
        value = (value * int(_BASE) + int(token) + 2) & 0xFFFFFFFFFFFFFFFF
    return value


def _window_hashes(ids: np.ndarray, order: int) -> np.ndarray:
    """Hash of each window ids[i : i + order] (uint64 arithmetic wraps around, as the hash wants)."""
    count = len(ids) - order + 1
    hashes = np.zeros(count, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(order):
            hashes = hashes * _BASE + (ids[j : j + count] + 2).astype(np.uint64)
    return hashes


def lookups(cache: TokenCache | Caches, sequence: list[int], known: list[bool], positions: Sequence[int], weight: float,
            chain: float = CHAIN, unchained: frozenset[int] = frozenset()) -> list[Found]:  # fmt: skip
    """What the cache says for each gap slot (`positions`: the slots' indices in `sequence`, left to right) whose
    last ORDERS[-1] tokens are `known`: (slot, token ids, counts) of what followed its longest known context. A slot
    the cache alone puts at least `chain` on one token (weight x n / (n + PRIOR) x that token's share) counts as
    known, holding that token, for the slots after it in this step (`unchained`: slots whose logits are barred, which
    might refuse it), so that a run the repository always writes fills in one step instead of one token a step."""
    sequence, known = list(sequence), list(known)
    found: list[Found] = []
    for slot, end in enumerate(positions):
        start = end
        while start > 0 and end - start < ORDERS[0] and known[start - 1]:
            start -= 1
        if end - start < ORDERS[-1]:
            continue
        hit = cache.following(sequence[start:end])
        if hit is None:
            continue
        ids, counts = hit
        found.append((slot, ids, counts))
        total = float(counts.sum())
        top = int(counts.argmax())
        if not known[end] and slot not in unchained and weight * counts[top] / (total + PRIOR) >= chain:
            sequence[end], known[end] = int(ids[top]), True
    return found


def mix_cache(rows: torch.Tensor, found: Sequence[Found], weight: float, barred_below: float,
              stop_ids: torch.Tensor) -> int:  # fmt: skip
    """Mix `lookups` into gap logits `rows` [G, V] in place, per slot: the model's probability of `stop_ids` (the
    answer ends here: code holds no answers' ends, so that is the model's to say) stays, and the rest of the mass is
    (1 - lam) p_model + lam (1 - p_stop) p_cache, lam = weight x n / (n + PRIOR); logits at or below `barred_below`
    stay barred (probability 0). Returns how many slots it changed.

    A mixed slot's logits become its log-probabilities, computed sparsely and in place: over the whole vocabulary
    one log-sum-exp (read in slices) and one shift (log(1 - lam) - lse: the tokens the cache does not hold,
    (1 - lam) p_model), then the few cached and stop tokens set exactly; nothing of the vocabulary's size is
    allocated. Dense over [slots, V] this was ten passes, 7 ms of a 0.5B model's 300 ms step on 2 cores; the answers
    are the same (softmax does not see a row's shift; a barred logit, shifted, is still far below `barred_below`)."""
    if not found:
        return 0
    device = rows.device
    index = torch.tensor([slot for slot, _, _ in found], device=device)
    at_row = torch.from_numpy(np.concatenate([np.full(len(ids), row) for row, (_, ids, _) in enumerate(found)]))
    at_id = torch.from_numpy(np.concatenate([ids for _, ids, _ in found]).astype(np.int64))
    at_row, at_id = at_row.to(device), at_id.to(device)
    count = torch.from_numpy(np.concatenate([counts for _, _, counts in found]).astype(np.float32)).to(device)
    lam = torch.tensor([_strength(counts, weight) for _, _, counts in found], device=device)  # [n]
    lse = logsumexp_sliced(rows, rows=index)  # [n]
    raw, raw_stop = rows[index[at_row], at_id].float(), rows[index[:, None], stop_ids].float()  # the few set below
    cached = count.masked_fill((raw <= barred_below) | torch.isin(at_id, stop_ids), 0.0)
    mass = torch.zeros(len(found), device=device).index_add_(0, at_row, cached)  # [n]
    stop = (raw_stop - lse[:, None]).exp().sum(dim=-1)  # [n] the model's probability of ending here
    shift = (1 - lam).clamp_min(1e-30).log() - lse  # every token: log((1 - lam) p_model) = logit + shift
    share = lam[at_row] * (1 - stop[at_row]) * cached / mass[at_row].clamp_min(1e-9)
    value = ((raw - lse[at_row]).exp() * (1 - lam[at_row]) + share).clamp_min(1e-30).log()
    ends = torch.where(raw_stop <= barred_below, raw_stop + shift[:, None], raw_stop - lse[:, None])
    hit = mass > 0  # a slot whose every cached token is barred (or an end) keeps its logits
    for row in hit.nonzero()[:, 0].tolist():
        _shift_(rows[found[row][0]], float(shift[row]))
    mixed = (cached > 0) & hit[at_row]
    rows[index[at_row[mixed]], at_id[mixed]] = value[mixed].to(rows.dtype)
    rows[index[hit][:, None], stop_ids] = ends[hit].to(rows.dtype)
    return int(hit.sum())


def _shift_(row: torch.Tensor, shift: float) -> None:
    """row += shift in place, rounded once to the row's dtype (bf16's own add rounds the shift first), in slices."""
    if row.dtype == torch.float32:
        row.add_(shift)
        return
    for start in range(0, row.shape[-1], COLUMNS):
        part = row[start : start + COLUMNS]
        part.copy_(part.float().add_(shift))


def _strength(counts: np.ndarray, weight: float) -> float:
    """lam: how much of a slot's mass the cache moves, for a context seen counts.sum() times."""
    total = float(counts.sum())
    return weight * total / (total + PRIOR)


class WorkspaceCaches:
    """The token caches of the workspaces requests name, each built once in a background thread (a repository's
    files as `corpus.collect_repository` takes them: .gitignore respected, vendored, generated, minified, binary and
    secret files left out; at most MAX_CHARS of them), and rebuilt in the background once STALE_SECONDS old. A
    request before its workspace's cache is built runs without one, never waiting. The MAX_WORKSPACES most recently
    used stay: a cache holds ~12 bytes per token and context length (~70 MB for MAX_CHARS of code)."""

    MAX_CHARS = 4_000_000
    MAX_WORKSPACES = 3
    STALE_SECONDS = 600.0

    def __init__(self, encode: Callable[[str], list[int]]):
        self.encode = encode
        self._ready: OrderedDict[str, tuple[float, TokenCache]] = OrderedDict()
        self._building: set[str] = set()
        self._lock = threading.Lock()
        self.errors: dict[str, str] = {}  # folder -> why its cache could not be built

    def get(self, folder: str) -> TokenCache | None:
        with self._lock:
            ready = self._ready.get(folder)
            if ready is not None:
                self._ready.move_to_end(folder)
            stale = ready is None or time.monotonic() - ready[0] > self.STALE_SECONDS
            if stale and folder not in self._building and folder not in self.errors:
                self._building.add(folder)
                threading.Thread(target=self._build, args=(folder,), name="canvas-token-cache", daemon=True).start()
        return ready[1] if ready is not None else None

    def add(self, folder: str, texts: Iterable[str]) -> TokenCache:
        """The cache of `texts` (in this engine's tokens) as `folder`'s, from now on; returned."""
        cache = TokenCache.from_texts(texts, self.encode)
        self.put(folder, cache)
        return cache

    def put(self, folder: str, cache: TokenCache) -> None:
        with self._lock:
            self._ready[folder] = (time.monotonic(), cache)
            self._ready.move_to_end(folder)
            while len(self._ready) > self.MAX_WORKSPACES:
                self._ready.popitem(last=False)  # the least recently used: built again if asked for

    def _build(self, folder: str) -> None:
        from . import corpus

        with contextlib.suppress(AttributeError, OSError):  # this thread only: requests come first
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        try:
            files, _ = corpus.collect_repository(Path(folder))
            files.sort(key=lambda f: len(f.text))  # small files first: the most of them within the budget
            texts, used = [], 0
            for file in files:
                if used + len(file.text) > self.MAX_CHARS:
                    break
                texts.append(file.text)
                used += len(file.text)
            cache = self.add(folder, texts)
            log.info("token cache of %s: %d files, %d tokens", folder, len(texts), cache.tokens)
        except Exception as exc:  # a folder that cannot be read: no cache for it, said once
            self.errors[folder] = f"{type(exc).__name__}: {exc}"
            log.warning("no token cache for %s: %s", folder, self.errors[folder])
        finally:
            with self._lock:
                self._building.discard(folder)
