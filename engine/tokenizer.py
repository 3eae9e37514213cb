"""Byte-level BPE tokenizers for our own models, trained with `tokenizers` and saved for `AutoTokenizer`.

Special tokens sit at fixed ids, in DiffusionGemma's order: pad 0, eos 1, bos 2, then spares (reserved for later
use such as FIM markers, so a grown tokenizer never shifts an id the model has learned).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

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
