"""`canvas-ls train --plan`: what a training run holds in memory, counted before it starts (no weights loaded).

The model is built on the meta device from its config, so the counts are exact for any size (DiffusionGemma
26B-A4B included) at no memory cost. Bytes, as `canvas-ls train` runs:

    weights      full training: fp32 master weights (4 bytes each; bf16 autocast computes in bf16). LoRA with bf16
                 on: the frozen base in bf16 (2 bytes) and the adapter in fp32; with --fp32: the base in fp32.
    gradients    fp32, for the trainable parameters only.
    optimizer    AdamW's two moments, fp32, for the trainable parameters.
    average      with a moving average of the weights (a recipe's `ema`): one more fp32 copy of the trainable ones.
    activations  an estimate: per layer and token, the stored tensors of a transformer layer under bf16 autocast
                 without recomputation (Korthikanti et al. 2022: 34 bytes x hidden, the MLP's 19 of them scaled to
                 this model's experts and dense MLP), attention scores (5 bytes x heads x key length), over the
                 encoder's prefix and the decoder's canvas (twice that with --fp32); plus the LM head's logits in
                 fp32 for one loss chunk. Measured against a real run on the CPU (README): a floor, not a bound.

`check` refuses, before anything is loaded, a run whose total exceeds what the device has free.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

GIB = 1 << 30
LOSS_CHUNK_ROWS = 2048  # rows of logits the fused head loss holds at once (engine/loss.py)


def model_config(start_from: str | None, preset: str, vocab_size: int) -> Any:
    """The config of the model a run trains: a model folder's, a hub id's (from the local cache), "full-width"
    (DiffusionGemma 26B-A4B's published geometry), or the preset's."""
    from transformers import AutoConfig

    from .architecture import small_config
    from .train_config import PRESETS

    if start_from == "full-width":
        from .architecture import full_width_config

        return full_width_config()
    if start_from:
        return AutoConfig.from_pretrained(start_from)
    return small_config(vocab_size, sliding_window=512, **PRESETS[preset]["model"])


def training_plan(config: Any, batch_size: int, prefix_tokens: int, canvas_tokens: int, lora_rank: int = 0,
                  lora_experts: bool = False, bf16: bool = True, ema: bool = False,
                  quantize: str = "none") -> dict[str, Any]:  # fmt: skip
    """Parameters and bytes of one run (see the module's docstring for what each line counts); `quantize`: the
    frozen base's layers in int8 or int4 under a LoRA run (`engine.quantize`'s bytes per weight)."""
    from transformers import DiffusionGemmaForBlockDiffusion

    from .adapters import add_lora, trainable_parameters
    from .quantize import WEIGHT_BYTES, model_weight_counts

    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # peft asks transformers about gradient checkpointing
        model = DiffusionGemmaForBlockDiffusion(config)
        total = sum(p.numel() for p in model.parameters())
        covered = model_weight_counts(model)["quantized"] if lora_rank and quantize != "none" else 0
        trainable = trainable_parameters(add_lora(model, lora_rank, lora_experts)) if lora_rank else total
    base_bytes = 2 if (lora_rank and bf16) else 4
    frozen = (total - trainable - covered) * base_bytes + covered * WEIGHT_BYTES[quantize]
    weights = frozen + trainable * 4 if lora_rank else total * 4
    text = config.get_text_config()
    tokens = batch_size * (prefix_tokens + canvas_tokens)
    mlp_width = text.intermediate_size + getattr(text, "top_k_experts", 0) * getattr(text, "moe_intermediate_size", 0)
    per_token = text.hidden_size * (15 + 19 * mlp_width / (4 * text.hidden_size))
    # attention scores: the encoder's prefix over itself (sliding layers see at most the window), the canvas over both
    keys = min(prefix_tokens, getattr(text, "sliding_window", None) or prefix_tokens)
    scores = 5 * text.num_attention_heads * batch_size * (prefix_tokens * keys + canvas_tokens * (keys + canvas_tokens))
    width = 1 if bf16 else 2  # the factors count bf16 (2-byte) tensors; without autocast they are fp32
    activations = width * text.num_hidden_layers * (2 * tokens * per_token + scores)
    logits = min(batch_size * (prefix_tokens + canvas_tokens), LOSS_CHUNK_ROWS) * text.vocab_size * 4 * 2
    rows = {
        "weights": weights,
        "gradients": trainable * 4,
        "optimizer": trainable * 8,
        **({"average": trainable * 4} if ema else {}),
        "activations": activations + logits,
    }
    mode = f"LoRA rank {lora_rank}" + (" + experts" if lora_experts else "") + (f", {quantize} base" if covered else "")
    return {
        "mode": mode if lora_rank else "full",
        "parameters": total,
        "trainable": trainable,
        "batch_size": batch_size,
        "tokens_per_example": prefix_tokens + canvas_tokens,
        "bytes": rows,
        "total_bytes": sum(rows.values()),
    }


def available_bytes(device: torch.device) -> tuple[int, str]:
    """Memory free for a run on `device`, and where the figure comes from."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return free, f"{torch.cuda.get_device_name(device)}: {free / GIB:.1f} of {total / GIB:.1f} GiB free"
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            free = int(line.split()[1]) * 1024
            return free, f"this machine's memory: {free / GIB:.1f} GiB available"
    return 1 << 62, "memory not known"


def format_plan(plans: list[dict[str, Any]], where: str, name: str) -> str:
    lines = [f"{name}; {where}", "", f"{'':<24}" + "".join(f"{p['mode']:>28}" for p in plans)]
    lines.append(f"{'parameters':<24}" + "".join(f"{p['parameters'] / 1e6:>26.1f} M" for p in plans))
    lines.append(f"{'trainable':<24}" + "".join(f"{p['trainable'] / 1e6:>26.2f} M" for p in plans))
    keys = ("weights", "gradients", "optimizer", "average", "activations")
    for key in [k for k in keys if any(k in p["bytes"] for p in plans)]:
        label = key + (" (estimate)" if key == "activations" else "")
        lines.append(f"{label:<24}" + "".join(f"{p['bytes'].get(key, 0) / GIB:>24.2f} GiB" for p in plans))
    lines.append(f"{'total':<24}" + "".join(f"{p['total_bytes'] / GIB:>24.2f} GiB" for p in plans))
    return "\n".join(lines)


def check(plan: dict[str, Any], device: torch.device) -> str | None:
    """Why the run cannot fit on `device` (None: it can)."""
    free, where = available_bytes(device)
    if plan["total_bytes"] <= free:
        return None
    hint = "" if plan["trainable"] < plan["parameters"] else "; LoRA (--lora 16) trains a small share of the weights"
    return (f"{plan['mode']} training needs about {plan['total_bytes'] / GIB:.1f} GiB ({where}): "
            f"a smaller --batch-size or a smaller model{hint}; `canvas-ls train --plan` shows the sums")  # fmt: skip
