"""LoRA adapters through the `peft` library: what `canvas-ls train --lora` trains and the engine loads (`--adapter`).

Targets, on the text layers only (encoder and decoder; never the vision tower or the self-conditioning block):
the attention projections (q, k, v, o) and the dense MLP (gate, up, down) as LoRA on `nn.Linear`, and, with
`experts=True`, DiffusionGemma's fused MoE expert weights (`experts.gate_up_proj`, `experts.down_proj`, 3-D
parameters) through peft's `target_parameters` (LoRA on an `nn.Parameter`; peft 0.17+). The router stays as it is.

An adapter folder is peft's own (`adapter_config.json`, `adapter_model.safetensors`); the engine injects it into the
base model and merges it into the weights for inference (`merge=False` keeps the LoRA layers apart: same answers,
slower steps).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from canvas_ls.engine.errors import ModelLoadError

TEXT_LAYERS = r".*(language_model|decoder)\.layers\.\d+\."
LINEAR_TARGETS = TEXT_LAYERS + r"(self_attn\.(q_proj|k_proj|v_proj|o_proj)|mlp\.(gate_proj|up_proj|down_proj))"
EXPERT_PARAMETERS = ["experts.gate_up_proj", "experts.down_proj"]


def lora_config(rank: int = 16, experts: bool = False, alpha: int | None = None, dropout: float = 0.0) -> Any:
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, lora_dropout=dropout, target_modules=LINEAR_TARGETS,
                      target_parameters=EXPERT_PARAMETERS if experts else None)  # fmt: skip


def add_lora(model: Any, rank: int = 16, experts: bool = False) -> Any:
    """`model` (a DiffusionGemmaForBlockDiffusion) with trainable LoRA weights and everything else frozen; returns
    the peft wrapper (`get_base_model()` is `model` itself, its layers now LoRA layers)."""
    from peft import get_peft_model

    return tie_shared_adapters(get_peft_model(model, lora_config(rank, experts)))


def _adapted_tensor(layer: Any) -> torch.Tensor:
    """The weight a LoRA layer adapts: a Linear's, or the parameter a ParamWrapper names."""
    name = getattr(layer, "parameter_name", None)
    return getattr(layer.get_base_layer(), name) if name else layer.get_base_layer().weight


def tie_shared_adapters(peft_model: Any) -> Any:
    """DiffusionGemma's encoder and decoder layers share their weights (one tensor, two modules). peft gives each
    module its own LoRA: unmerged, the encoder and decoder would then differ, and merging would add both deltas to
    the one tensor. Here the modules that adapt one tensor share one LoRA (its A, B and dropout), so that the
    adapter is one delta per weight, as a merge has it."""
    from peft.tuners.lora import LoraLayer

    owner: dict[int, Any] = {}
    for _, layer in peft_model.named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        first = owner.setdefault(id(_adapted_tensor(layer)), layer)
        if first is not layer:
            layer.lora_A, layer.lora_B, layer.lora_dropout = first.lora_A, first.lora_B, first.lora_dropout
    return peft_model


def trainable_parameters(model: Any) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def save_adapter(peft_model: Any, out: Path) -> Path:
    """peft's adapter folder (weights in the model's dtype)."""
    peft_model.save_pretrained(str(out))
    return out


def merged(peft_model: Any) -> Any:
    """The base model with the adapter folded into its weights (no LoRA layers left): each shared LoRA is merged
    into its shared weight once (`tie_shared_adapters`)."""
    from peft.tuners.lora import LoraLayer

    done: set[int] = set()
    for _, layer in peft_model.named_modules():
        if isinstance(layer, LoraLayer) and id(layer.lora_A) not in done:
            done.add(id(layer.lora_A))
            layer.merge()
    return peft_model.unload()


def apply_adapter(model: Any, adapter: str | Path, merge: bool = True) -> Any:
    """Load the adapter folder into `model`; returns the model to run: merged (the default) or with LoRA layers."""
    from peft import PeftModel

    folder = Path(adapter).expanduser()
    if not (folder / "adapter_config.json").is_file():
        raise ModelLoadError(f"adapter '{adapter}' is not a peft adapter folder (no adapter_config.json in it)")
    try:
        wrapped = tie_shared_adapters(PeftModel.from_pretrained(model, str(folder)))
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        first = (str(exc).strip() or type(exc).__name__).splitlines()[0]
        raise ModelLoadError(f"adapter '{adapter}' does not fit this model: {first}") from exc
    return (merged(wrapped) if merge else wrapped.get_base_model()).eval()


def adapter_size(config: Any, rank: int = 16, experts: bool = False) -> dict[str, Any]:
    """The adapter's parameters and bytes (bf16) for a model of `config`, counted on the meta device (no memory)."""
    from transformers import DiffusionGemmaForBlockDiffusion

    with torch.device("meta"):
        model = DiffusionGemmaForBlockDiffusion(config)
        total = sum(p.numel() for p in model.parameters())
        adapted = add_lora(model, rank, experts)
    lora = trainable_parameters(adapted)
    return {"rank": rank, "experts": experts, "model_parameters": total, "adapter_parameters": lora,
            "adapter_bytes_bf16": lora * 2, "share": lora / total}  # fmt: skip
