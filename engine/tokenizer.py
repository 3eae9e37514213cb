"""Byte-level BPE tokenizers for our own models, trained with `tokenizers` and saved for `AutoTokenizer`.

Special tokens sit at fixed ids, in DiffusionGemma's order: pad 0, eos 1, bos 2, then spares (reserved for later
use such as FIM markers, so a grown tokenizer never shifts an id the model has learned).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

PAD, EOS, BOS = "<pad>", "<eos>", "<bos>"
SPARES = tuple(f"<spare_{i}>" for i in range(5))
SPECIAL_TOKENS = (PAD, EOS, BOS, *SPARES)


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: Path | None = None) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on `texts`; save it to `out_dir` (tokenizer.json + config) when given."""
    tokenizer = Tokenizer(models.BPE())
    # No prefix space, and every byte is in the alphabet: any source file round-trips exactly.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=PAD,
        eos_token=EOS,
        bos_token=BOS,
        additional_special_tokens=list(SPARES),
        clean_up_tokenization_spaces=False,
    )
    if out_dir is not None:
        fast.save_pretrained(str(out_dir))
    return fast


# Words appended to a prefix's end to find where a following word's first token would start (token healing): BPE
# glues a space before a word to it, and a small vocabulary may lack some of these merges.
HEALING_PROBES = ("x", "a", "self", "return")


class TokenHealing:
    """Where a prefix stops being a token boundary, for a tokenizer: the engine cuts the prefix back there (and the
    answer's first token re-writes the cut), and training cuts its examples the same way, so that the model learns
    the boundaries it will be shown.

    Byte-level BPE glues a space to the word after it, so "x = " alone ends in a lone ' ' token the model rarely
    saw, where "x = y" gives ' =' ' y' (and the indentation an editor leaves after Enter, "\\n    ", is one token
    where "\\n    y" gives '\\n   ' ' y'). Tokenizing the prefix's end with a word after it shows the boundary."""

    def __init__(self, tokenizer: Any, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._texts: list[str] | None = None
        self._first: dict[str, list[int]] = {}  # cut text -> the ids that may re-write it

    @property
    def texts(self) -> list[str]:
        """The text of every id the model can write (computed once)."""
        if self._texts is None:
            self._texts = [self.tokenizer.decode([i]) for i in range(self.vocab_size)]
        return self._texts

    def first_tokens(self, cut: str) -> list[int]:
        """The ids that may start an answer re-writing `cut`: those whose text starts with it (and goes on past it
        when it is blank: the same lone space again is what healing avoids)."""
        ids = self._first.get(cut)
        if ids is None:
            blank = cut.isspace()
            ids = [i for i, text in enumerate(self.texts) if text.startswith(cut) and not (blank and text == cut)]
            if len(self._first) < 4096:
                self._first[cut] = ids
        return ids

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def cut(self, prefix: str) -> str:
        """The end of `prefix` that a following word would take into its first token: "" at a boundary, or when
        no token could re-write it."""
        window = prefix[max(0, len(prefix.rstrip()) - 32) :]  # the last pretokens: enough to place the boundary
        cut = ""
        for probe in HEALING_PROBES:
            tokens = self._encode(window + probe)
            kept = ""
            for end in range(len(tokens), 0, -1):  # the longest run of whole tokens inside the window
                text = self.tokenizer.decode(tokens[:end])
                if len(text) <= len(window) and window.startswith(text):
                    kept = text
                    break
            if len(window) - len(kept) > len(cut):
                cut = window[len(kept) :]
        if not cut and window[-1:].isalnum():  # a word being typed ("os.pa"): its token may be one of a longer word
            last = self.tokenizer.decode(self._encode(window)[-1:])
            texts = self.texts
            if window.endswith(last) and any(len(texts[i]) > len(last) for i in self.first_tokens(last)):
                cut = last
        return cut if cut and "\n" not in cut and self.first_tokens(cut) else ""
