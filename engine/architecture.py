"""Small DiffusionGemma configurations: the tiny test model and the sizes we train ourselves.

Our own models use the same class as Google's checkpoints (DiffusionGemmaForBlockDiffusion), so the engine has one
code path. A DiffusionGemma config always carries a vision tower; ours is the smallest Gemma4VisionConfig that
builds, and no text path ever calls it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import (
    DiffusionGemmaConfig,
    DiffusionGemmaForBlockDiffusion,
    DiffusionGemmaTextConfig,
    Gemma4VisionConfig,
)

from .loading import quiet_libraries
from .settings import MODEL_SETTINGS_FILE
from .tokenizer import SPARES, train_tokenizer


def small_config(
    vocab_size: int,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    head_dim: int = 32,
    num_experts: int = 4,
    top_k_experts: int = 2,
    moe_intermediate_size: int = 64,
    intermediate_size: int = 128,
    sliding_window: int = 256,
    canvas_length: int = 32,
    max_positions: int = 4096,
) -> DiffusionGemmaConfig:
    """A DiffusionGemma config at toy-to-small scale; the last layer is full attention, the rest sliding."""
    layer_types = ["sliding_attention"] * (num_layers - 1) + ["full_attention"]
    text = DiffusionGemmaTextConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=1,
        head_dim=head_dim,
        global_head_dim=head_dim,
        sliding_window=sliding_window,
        layer_types=layer_types,
        num_experts=num_experts,
        top_k_experts=top_k_experts,
        moe_intermediate_size=moe_intermediate_size,
        max_position_embeddings=max_positions,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    vision = small_vision_config()
    # Image marker ids point at spare special tokens so that they stay inside the small vocabulary.
    return DiffusionGemmaConfig(
        text_config=text,
        vision_config=vision,
        canvas_length=canvas_length,
        boi_token_id=3,
        eoi_token_id=4,
        image_token_id=5,
    )


def small_vision_config() -> Gemma4VisionConfig:
    """The smallest vision tower that builds (a DiffusionGemma config always carries one; text never calls it)."""
    return Gemma4VisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
        position_embedding_size=64,
    )


def build_tiny_model(
    out_dir: Path,
    texts: list[str],
    seed: int = 0,
    vocab_size: int = 384,
    infill: dict[str, Any] | None = None,
    writes: tuple[str, ...] = (),
    layers: int = 2,
) -> Path:
    """Write a randomly initialised tiny model (with a tokenizer trained on `texts`) to `out_dir`, for tests: `layers`
    deep, the last of full attention, the others sliding-window.

    `writes`: texts that are one token each; the model then writes the first into every slot it fills, whatever
    the context, with confidence > 0.99, and the next where that one is barred (token healing's first slot after a
    cut space allows only tokens that start with one); see `write_tokens`. End-to-end editor tests know its answers.
    """
    quiet_libraries()
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(texts, vocab_size, out_dir)
    assert tokenizer.convert_tokens_to_ids(SPARES[0]) == 3
    torch.manual_seed(seed)
    config = small_config(len(tokenizer), num_layers=layers)
    if writes:
        config.tie_word_embeddings = False
    model = DiffusionGemmaForBlockDiffusion(config)
    if writes:
        ids = [tokenizer.encode(text, add_special_tokens=False) for text in writes]
        if wrong := [text for text, tokens in zip(writes, ids, strict=True) if len(tokens) != 1]:
            raise ValueError(f"not one token each in the tiny tokenizer: {wrong}")
        write_tokens(model, [tokens[0] for tokens in ids])
    model.save_pretrained(str(out_dir))
    if infill is not None:
        (out_dir / MODEL_SETTINGS_FILE).write_text(json.dumps({"infill": infill}, indent=2) + "\n")
    return out_dir


@torch.no_grad()
def write_tokens(model: DiffusionGemmaForBlockDiffusion, tokens: list[int]) -> None:
    """Make `model` predict `tokens[0]` at every position, `tokens[1]` where that is barred, and so on: every layer's
    and the self-conditioning's output projections are zeroed, so the last hidden state is the (normalised) input
    embedding; every embedding gets the same large first component, so that state points the same way for every
    input; and the untied LM head reads only that component, for `tokens` alone, in decreasing weights (their logits
    ~20, ~15 after the softcap: each one's probability where it wins is > 0.99; every other logit is 0)."""
    assert not model.config.tie_word_embeddings
    for name, parameter in model.named_parameters():
        if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
            parameter.zero_()
        elif name.endswith("embed_tokens.weight"):  # the encoder's and the decoder's
            parameter[:, 0] = 1.0
    head = model.get_output_embeddings().weight
    head.zero_()
    for rank, token in enumerate(tokens):
        head[token, 0] = 3.0 - rank  # the state's first component is ~sqrt(hidden_size) = 8: logits 24, 16...


# DiffusionGemma 26B-A4B's text geometry as its published config.json gives it (google/diffusiongemma-26B-A4B-it):
# 30 layers (5 sliding : 1 full), hidden 2816, 128 experts of 704 (top 8) beside a dense MLP of 2112, 262k vocabulary.
FULL_WIDTH = dict(
    vocab_size=262144,
    hidden_size=2816,
    intermediate_size=2112,
    num_hidden_layers=30,
    num_attention_heads=16,
    num_key_value_heads=8,
    num_global_key_value_heads=2,
    head_dim=256,
    global_head_dim=512,
    num_experts=128,
    top_k_experts=8,
    moe_intermediate_size=704,
    sliding_window=1024,
    final_logit_softcapping=30.0,
    max_position_embeddings=131072,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)


def full_width_config(layers: int = 30) -> DiffusionGemmaConfig:
    """DiffusionGemma 26B-A4B's geometry (its first `layers` layers keep the 5:1 sliding/full pattern)."""
    layer_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
    text = DiffusionGemmaTextConfig(**{**FULL_WIDTH, "num_hidden_layers": layers, "layer_types": layer_types})
    return DiffusionGemmaConfig(text_config=text, vision_config=small_vision_config(), canvas_length=256,
                                boi_token_id=3, eoi_token_id=4, image_token_id=5)  # fmt: skip


def random_model(config: DiffusionGemmaConfig, device: torch.device, dtype: torch.dtype) -> Any:
    """A model of `config` with random weights, built directly on `device` in `dtype` (26B parameters in bf16 fit an
    H200; on the CPU only a few layers do)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = DiffusionGemmaForBlockDiffusion(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()
