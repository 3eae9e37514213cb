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

import contextlib
import functools
import warnings
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .errors import ModelLoadError
from .quantize import PackedLinear
from .workspaces import holds_beside_others

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


def _adapted(layer: Any) -> Any:
    """What a LoRA layer adapts, one object per weight: a Linear's weight, the parameter a ParamWrapper names, or an
    int8-dynamic layer itself (its weight is packed; the encoder and decoder share the layer)."""
    name = getattr(layer, "parameter_name", None)
    base = layer.get_base_layer()
    return getattr(base, name) if name else base if isinstance(base, PackedLinear) else base.weight


def tie_shared_adapters(peft_model: Any) -> Any:
    """DiffusionGemma's encoder and decoder layers share their weights (one tensor, two modules). peft gives each
    module its own LoRA: unmerged, the encoder and decoder would then differ, and merging would add both deltas to
    the one tensor. Here the modules that adapt one tensor share one LoRA (its A, B and dropout), so that the
    adapter is one delta per weight, as a merge has it. int8-dynamic's shared layers are one module in two places,
    which peft (visiting each module once) wraps in one place: the other gets the same LoRA layer."""
    from peft.tuners.lora import LoraLayer

    owner: dict[int, Any] = {}
    for _, layer in peft_model.named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        first = owner.setdefault(id(_adapted(layer)), layer)
        if first is not layer:
            layer.lora_A, layer.lora_B, layer.lora_dropout = first.lora_A, first.lora_B, first.lora_dropout
    for name, module in list(peft_model.named_modules(remove_duplicate=False)):
        if isinstance(module, PackedLinear) and id(module) in owner and not name.endswith(".base_layer"):
            parent, _, attribute = name.rpartition(".")
            setattr(peft_model.get_submodule(parent), attribute, owner[id(module)])
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

    folder = _adapter_folder(adapter)
    with _fits(adapter):
        wrapped = tie_shared_adapters(PeftModel.from_pretrained(model, str(folder)))
    return (merged(wrapped) if merge else wrapped.get_base_model()).eval()


def _adapter_folder(adapter: str | Path) -> Path:
    folder = Path(adapter).expanduser()
    if not (folder / "adapter_config.json").is_file():
        raise ModelLoadError(f"adapter '{adapter}' is not a peft adapter folder (no adapter_config.json in it)")
    return folder


@contextlib.contextmanager
def _fits(adapter: str | Path) -> Iterator[None]:
    """peft's errors for an adapter of another model, as one ModelLoadError line."""
    try:
        yield
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        first = (str(exc).strip() or type(exc).__name__).splitlines()[0]
        raise ModelLoadError(f"adapter '{adapter}' does not fit this model: {first}") from exc


class AdapterSet:
    """LoRA adapters held apart from the base weights, one active at a time: one engine answers for several
    workspaces tuned from its model (`train --workspace` on a base too big to tune fully) without a second copy
    of the base. Each request names its adapter (None: the base alone); the batch's step activates it
    (`activate`, a no-op when it is active already). At most `limit` stay loaded (the least recently used goes).

    peft holds several adapters on `nn.Linear` targets; an adapter on DiffusionGemma's fused expert parameters
    (`target_parameters`) cannot be loaded beside another ("Trying to target the same nn.Parameter twice"), so such
    an adapter is refused here and runs merged in an engine of its own (`canvas-ls engine --adapter`)."""

    def __init__(self, model: Any, limit: int = 4) -> None:
        self.model = model
        self.limit = limit
        self.peft: Any = None  # the PeftModel around `model`, from the first adapter on
        self.names: OrderedDict[str, str] = OrderedDict()  # folder -> peft's adapter name, least recent first
        self.active: str | None = None  # the folder whose LoRA the layers apply now; None: none (the base)
        self._serial = 0

    def activate(self, adapter: str | None) -> None:
        """Make the model compute with `adapter` (a folder; None: the base alone), loading it the first time.
        Raises ModelLoadError for a folder that is not an adapter of this model, or one that cannot be shared."""
        key = None if adapter is None else str(Path(adapter).expanduser().resolve())
        if key is not None and key not in self.names:
            self._load(key)
        if key is not None:
            self.names.move_to_end(key)
        if key == self.active or self.peft is None:
            return
        if key is None:
            self.peft.base_model.disable_adapter_layers()
        else:
            self.peft.base_model.enable_adapter_layers()
            self.peft.set_adapter(self.names[key])
        self.active = key

    def _load(self, key: str) -> None:
        from peft import PeftModel

        if not holds_beside_others(_adapter_folder(key)):
            raise ModelLoadError(f"adapter '{key}' adapts the MoE expert parameters, which peft cannot hold "
                                 "beside another adapter: run it merged (canvas-ls engine --adapter)")  # fmt: skip
        while len(self.names) >= self.limit:
            _, name = self.names.popitem(last=False)
            self.peft.delete_adapter(name)
        name = f"adapter{self._serial}"
        self._serial += 1
        with _fits(key):
            config = packed_lora_config(key)
            try:
                with warnings.catch_warnings():  # peft's "Unsupported layer type" for the packed layers it wraps
                    warnings.filterwarnings("ignore", "Unsupported layer type", UserWarning)
                    if self.peft is None:
                        self.peft = PeftModel.from_pretrained(self.model, key, adapter_name=name, config=config)
                    else:
                        self.peft.add_adapter(name, config)  # load_adapter then reads the weights only
                        self.peft.load_adapter(key, adapter_name=name)
            except Exception:
                if self.peft is not None:  # what peft injected before it failed
                    with contextlib.suppress(Exception):
                        self.peft.delete_adapter(name)
                raise
        tie_shared_adapters(self.peft)
        self.peft.eval()
        self.names[key] = name
        self.active = ""  # peft may have switched the active adapter: the next activate sets it


def packed_lora_config(folder: str) -> Any:
    """The adapter folder's LoRA config, with `PackedLoraLinear` registered for int8-dynamic layers (peft's custom
    layer API: its built-in layers take float or torchao/bitsandbytes/GPTQ weights, not torch's packed ones)."""
    from peft import LoraConfig

    config = LoraConfig.from_pretrained(folder)
    config.inference_mode = True
    config._register_custom_module({PackedLinear: packed_lora_class()})
    return config


@functools.cache
def packed_lora_class() -> type:
    """peft's LoRA `Linear` around an int8-dynamic layer (`quantize.PackedLinear`): the packed int8 base computes,
    the adapter's A and B (float32, on the CPU as the base is) add their product beside it. Never merged: a merge
    would write a float delta into int8 weights; such a model holds its adapters apart, one active at a time."""
    from peft.tuners.lora.layer import Linear

    class PackedLoraLinear(Linear):
        def _get_base_layer_device_and_dtype(self, base_layer: Any) -> tuple[torch.device, torch.dtype]:
            return base_layer.qweight.device, torch.float32

        def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
            raise ModelLoadError("an adapter cannot be merged into int8-dynamic weights (load it with the model: "
                                 "it merges into the float weights before they are packed)")  # fmt: skip

    return PackedLoraLinear


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
