"""Weight-only quantisation (torchao, applied by transformers while the checkpoint loads), so that DiffusionGemma
26B-A4B fits the GPUs users have: its weights take 47 GiB in bf16, 24 in int8, 14 in int4 (`weight_counts`).

    none   the weights as the checkpoint has them (bf16 on a GPU)
    int8   int8 weights, a scale per output row (torchao's `Int8WeightOnlyConfig`); CPU and GPU
    int8-dynamic
           a CPU's fast int8 (`cpu_int8`, below): int8 weights and activations; CPU only
    int4   int4 weights, a bf16 scale and zero point per 128 inputs (torchao's tinygemm layout; the experts'
           fused weights in `int4_experts`' layout, which `experts_kernel` reads); NVIDIA GPUs of compute
           capability 8.0 or more
    auto   on a GPU, the first of none / int8 / int4 whose weights leave room (`HEADROOM`) in the memory it has
           free; on a CPU, int8-dynamic for a model of `CPU_INT8_MIN` quantisable weights or more (a 0.5B
           model's step ran 2.6x faster), none below (the shipped 7.9M model: its matmuls are too small to gain,
           and its answers stay those it was calibrated with)

int8-dynamic (`cpu_int8`): the checkpoint loads in float32, a LoRA adapter merges into it, then the projections
become torch's dynamically quantised linear layers (fbgemm / x86: int8 weights with a scale per output row, each
call's activations quantised to 8 bits, int32 accumulation). On 2 Zen 2 cores (AVX2, no VNNI) a [32 x 896] @
[896 x 4864] product took 1.5 ms against 4.6 in fp32, where torchao's int8 weight-only took 5.9 and its
dynamic-activation kernel 55 (2026-12-06): torchao's int8 saves memory on a CPU, not time. What it covers: the
layers' attention and dense MLP projections, the self-conditioning block's and the LM head (a packed int8 copy: the
embedding it is tied to stays float for the lookups); the experts, routers, norms and embeddings stay float. Such a
model also conditions each step on sparsely computed soft embeddings (`conditioning.SparseSelfConditioning`). It
computes eager where its decoder compiles whole (fewer than 8 layers: no whole graph takes packed weights as inputs);
a deeper one's layer graphs (`layer_graphs.py`) call each packed layer as one operator, `packed_linear`, the layer
found by a tensor it holds (`PackedLinear.handle`). An adapter given at load merges before packing; workspace
adapters held apart per request compute in float beside the packed layers (`adapters.packed_lora_class`).

What is quantised: the attention and dense MLP projections and the MoE experts' fused weights (97% of
DiffusionGemma's parameters). The embeddings (tied to the LM head), the routers and the
norms stay as they are. transformers' expert implementations multiply the fused 3D weights in one grouped or
batched matmul, which torchao's quantised tensors do not implement. A quantised model's experts therefore run one of
three implementations of our own:
  - on a GPU, `experts_kernel`: a Triton grouped matmul that reads the int8 or int4 experts once and dequantizes
    them in registers (no host synchronisation, so such a model compiles whole, CUDA graphs included: `compiles`);
  - on a GPU where triton is missing, `dequantized_experts`: each
    layer's experts dequantized to bf16 as the layer runs (one layer's at a time: 1.6 GiB for DiffusionGemma), then
    transformers' grouped matmul; a few kernels a layer, where a loop over 128 experts would make ~8,000 small
    quantised matmul calls a step (one took 43 us on this project's CPU against 28 for a plain one: ~0.3 s a step
    in calls alone);
  - on the CPU (int8 only), `quantized_experts`: one matmul per expert the tokens picked, on per-expert views of
    the quantised weights.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import re
import warnings
import weakref
from typing import Any

import torch
from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear
from torch.ao.nn.quantized.modules.linear import LinearPackedParams

from .errors import ModelLoadError
from .settings import QUANTIZE_CHOICES

log = logging.getLogger(__name__)
# Bytes per weight of each kind, scales included (int8: one bf16 scale per row; int4: a bf16 scale and zero point
# per 128 weights).
WEIGHT_BYTES = {"none": 2.0, "int8": 1.0, "int4": 0.5 + 4 / 128}
INT4_GROUP = 128
# `auto` keeps this share of the free memory for what is not weights: the prefix caches, the canvases' activations,
# CUDA's own workspace.
HEADROOM = 0.25
# `auto` quantises a CPU model with at least this many quantisable weights (`weight_counts`)
CPU_INT8_MIN = 100_000_000
# The float modules `cpu_int8` quantises (module names, matched whole)
CPU_INT8_MODULES = re.compile(
    r".*(language_model|decoder)\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)"
    r"|model\.decoder\.self_conditioning\.(gate|up|down)_proj|lm_head"
)
# The text layers' weights that are quantised (module or parameter names, matched whole; never the vision tower's).
QUANTIZED = (
    r"re:.*(language_model|decoder)\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)",
    r"re:.*(language_model|decoder)\.layers\.\d+\.experts\.(gate_up_proj|down_proj)",
)


def check_choice(kind: str | None) -> str:
    """`kind` as a valid choice (None: auto), or a ModelLoadError naming the choices."""
    kind = kind or "auto"
    if kind not in QUANTIZE_CHOICES:
        raise ModelLoadError(f"unknown quantisation '{kind}' (use {', '.join(QUANTIZE_CHOICES)})")
    return kind


def resolve(kind: str | None, config: Any, device: torch.device) -> str:
    """The quantisation a model of `config` gets on `device`: `kind` itself unless "auto" (see the module's
    docstring), with an error a user can act on for one this device cannot run."""
    kind = check_choice(kind)
    if kind != "auto":
        return check_runs_here(kind, device)
    if device.type != "cuda":
        return "int8-dynamic" if device.type == "cpu" and cpu_int8_gains(config) else "none"
    if importlib.util.find_spec("torchao") is None:  # without the extra, accelerate places what does not fit
        log.warning("torchao is not installed: the weights load unquantised (pip install 'canvas-ls[quantize]')")
        return "none"
    free, _ = torch.cuda.mem_get_info(device.index or 0)
    budget = free * (1 - HEADROOM)
    counts = weight_counts(config)
    for choice in ("none", "int8", "int4"):
        if choice == "int4" and not int4_capable(device):
            continue
        if weight_bytes(counts, choice) <= budget:
            return choice
    # Nothing fits: load int4 (or int8) anyway, accelerate places what does not fit in the CPU's memory.
    return "int4" if int4_capable(device) else "int8"


def check_runs_here(kind: str, device: torch.device) -> str:
    """`kind` ("none", "int8", "int4", "int8-dynamic"), or a ModelLoadError with the way out where this device cannot
    run it."""
    if kind == "int8-dynamic" and device.type != "cpu":
        raise ModelLoadError("int8-dynamic weights run on a CPU (torch's fbgemm kernels); use --quantize int8 here")
    if kind == "int4" and not int4_capable(device):
        raise ModelLoadError(
            "int4 weights run on NVIDIA GPUs of compute capability 8.0 or more (torchao's tinygemm kernel); "
            "use --quantize int8 here"
        )
    return kind


def cpu_int8_gains(config: Any) -> bool:
    """Whether `auto` quantises a model of `config` on this CPU: large enough (`CPU_INT8_MIN`) and a torch with the
    x86 quantised kernels (fbgemm), else float with the reason logged."""
    if weight_counts(config)["quantized"] < CPU_INT8_MIN:
        return False
    if not {"x86", "fbgemm"} & set(torch.backends.quantized.supported_engines):
        log.info("int8 on this CPU: torch has no x86 quantised kernels here; the weights stay float")
        return False
    return True


@torch.no_grad()
def cpu_int8(model: Any) -> int:
    """Swap the float projections `CPU_INT8_MODULES` names for torch's dynamically quantised linear layers (see the
    module's docstring), each shared weight packed once (the decoder's layers share theirs with the encoder's);
    returns how many weights were packed."""
    packed: dict[int, Any] = {}
    targets = [(name, module) for name, module in model.named_modules()
               if type(module) is torch.nn.Linear and CPU_INT8_MODULES.fullmatch(name)]  # fmt: skip
    for name, linear in targets:
        parent, _, attribute = name.rpartition(".")
        key = id(linear.weight)
        if key not in packed:
            packed[key] = pack_linear(linear)
        setattr(model.get_submodule(parent) if parent else model, attribute, packed[key])
    return len(packed)


def pack_linear(linear: torch.nn.Linear) -> PackedLinear:
    """`linear` as fbgemm's int8 layer (per-output-row weight scales, activations quantised per call)."""
    from torch.ao.quantization import per_channel_dynamic_qconfig

    linear.qconfig = per_channel_dynamic_qconfig
    with warnings.catch_warnings():  # torch marks its quantised dtypes for removal in a future release
        warnings.simplefilter("ignore")
        return PackedLinear.from_float(linear.float())


class PackedLinear(DynamicLinear):
    """torch's dynamically quantised linear layer (`cpu_int8`), as peft can put a LoRA adapter beside it
    (`adapters.PackedLoraLinear`): it has a `qweight` (peft's name for a quantised layer's weight, where this
    class's `weight` is a method), and loading a state dict without its keys (peft loading an adapter's
    weights with `strict=False`) leaves it as it is, where torch's layer raises a KeyError. Its weights are packed
    from the float checkpoint (`cpu_int8`), never loaded."""

    def __init__(self, in_features: int, out_features: int, bias_: bool = True, dtype: torch.dtype = torch.qint8):
        super().__init__(in_features, out_features, bias_, dtype=dtype)
        kept = _PackedParams(dtype)
        kept.set_weight_bias(*self._packed_params._weight_bias())
        self._packed_params = kept
        # What a compiled graph holds of the layer (`packed_linear`): fbgemm's packed weights are a TorchScript
        # object, which no graph can take as an input; this tensor, one byte per output, names the layer instead.
        self.register_buffer("handle", torch.empty(out_features, dtype=torch.int8), persistent=False)
        _PACKED[self.handle.data_ptr()] = self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # a layer graph (`layer_graphs.py`): the packed layer as one custom op
            return packed_linear(x, self.handle)
        return super().forward(x)

    @property
    def qweight(self) -> torch.Tensor:
        """What peft reads of it: the device (on every `hasattr`, thousands of times for one adapter). The packed
        weight lives on the CPU (fbgemm); an empty tensor there stands for it, where unpacking it took 7 ms a call
        (27 s to load an adapter onto a 0.5B model)."""
        return torch.empty(0, dtype=torch.int8)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        if prefix + "scale" in state_dict:
            super()._load_from_state_dict(state_dict, prefix, *args)


# The packed layers by their handle's address (`PackedLinear.handle`), for `packed_linear`
_PACKED: weakref.WeakValueDictionary[int, PackedLinear] = weakref.WeakValueDictionary()


@torch.library.custom_op("canvas_ls::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, handle: torch.Tensor) -> torch.Tensor:
    """A packed layer's forward (fbgemm's int8 dynamic linear) as an operator a compiled graph can call: the layer
    found by its `handle`, a graph input like a weight, so one graph serves every layer of a kind with its own."""
    return DynamicLinear.forward(_PACKED[handle.data_ptr()], x)


@packed_linear.register_fake
def _packed_linear_shape(x: torch.Tensor, handle: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], handle.shape[0]))


class _PackedParams(LinearPackedParams):
    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        if {prefix + "weight", prefix + "_packed_params"} & state_dict.keys():
            super()._load_from_state_dict(state_dict, prefix, *args)


def int4_capable(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device.index or 0)[0] >= 8


def weight_counts(config: Any) -> dict[str, int]:
    """Parameters of a model of `config` that quantisation would cover ("quantized") and the others ("kept"),
    counted on the meta device (no memory, any size). Tied weights count once, as the checkpoint holds them."""
    from transformers import DiffusionGemmaForBlockDiffusion

    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model_weight_counts(DiffusionGemmaForBlockDiffusion(config))


def model_weight_counts(model: Any) -> dict[str, int]:
    """`weight_counts` of a built model (on any device, the meta device included)."""
    import re

    patterns = [re.compile(pattern.removeprefix("re:")) for pattern in QUANTIZED]
    counts = {"quantized": 0, "kept": 0}
    for name, parameter in model.named_parameters():  # each shared parameter once
        module = name.rsplit(".", 1)[0]
        covered = any(p.fullmatch(name) or p.fullmatch(module) for p in patterns)
        counts["quantized" if covered else "kept"] += parameter.numel()
    return counts


def weight_bytes(counts: dict[str, int], kind: str) -> int:
    """Bytes of a model's weights (`weight_counts`) under quantisation `kind`; what is kept stays in bf16."""
    return int(counts["quantized"] * WEIGHT_BYTES[kind] + counts["kept"] * WEIGHT_BYTES["none"])


def torchao_config(kind: str) -> Any:
    """transformers' quantization_config for `kind` ("int8" or "int4")."""
    from .lazy_torchao import want_torchao

    want_torchao()
    try:
        from torchao.quantization import FqnToConfig, Int4WeightOnlyConfig, Int8WeightOnlyConfig
    except ImportError as exc:
        raise ModelLoadError(
            f"quantised weights ({kind}) need torchao: pip install 'canvas-ls[quantize]' (or torchao itself)"
        ) from exc
    from transformers import TorchAoConfig

    if kind == "int8":
        weights = experts = Int8WeightOnlyConfig(set_inductor_config=False)
    else:
        from torchao.quantization.quantize_.workflows.int4.int4_packing_format import Int4PackingFormat

        from .int4_experts import Int4ExpertsConfig

        weights = Int4WeightOnlyConfig(group_size=INT4_GROUP, set_inductor_config=False,
                                       int4_packing_format=Int4PackingFormat.TILE_PACKED_TO_4D)  # fmt: skip
        experts = Int4ExpertsConfig(group=INT4_GROUP)  # tinygemm's tiles cannot be read by expert: our layout
    # Named explicitly: transformers' default would skip every tied weight, and DiffusionGemma's decoder shares all
    # of its layers' weights with the encoder.
    layers, fused_experts = QUANTIZED
    return TorchAoConfig(quant_type=FqnToConfig({layers: weights, fused_experts: experts}),
                         modules_to_not_convert=["lm_head"])  # fmt: skip


def quantize_model(model: Any, kind: str) -> Any:
    """Quantise a model built in memory (`bench step`'s random full-width layers) as loading would (`torchao_config`),
    its experts then run by `quantized_experts`; returns it. torchao quantises each module's weight apart, so the
    weights the decoder shares with the encoder are shared again afterwards (else each would be held twice).
    int8-dynamic: `cpu_int8`, as loading does it (float32 first)."""
    if kind == "none":
        return model
    if kind == "int8-dynamic":
        cpu_int8(model.float())
        return model
    from torchao.quantization import quantize_

    holders: dict[int, list[tuple[Any, str]]] = {}
    for module in model.modules():
        for name, parameter in module.named_parameters(recurse=False):
            holders.setdefault(id(parameter), []).append((module, name))
    quantize_(model, torchao_config(kind).quant_type, filter_fn=None)
    for (first, name), *others in (group for group in holders.values() if len(group) > 1):
        for module, other in others:
            setattr(module, other, getattr(first, name))
    use_quantized_experts(model)
    return model


def held_bytes(model: Any) -> int:
    """Bytes the model's parameters hold, quantised ones by their parts (torchao's int data, scales, zero points;
    `cpu_int8`'s packed weights and their per-row scales); each shared parameter or packed layer once."""
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        if isinstance(module, DynamicLinear) and id(module) not in seen:
            seen.add(id(module))
            weight = module.weight()  # int8, a float scale per output row
            total += weight.numel() + weight.q_per_channel_scales().numel() * 4
    for parameter in model.parameters():
        if id(parameter) in seen:
            continue
        seen.add(id(parameter))
        if hasattr(parameter, "__tensor_flatten__"):
            names, _ = parameter.__tensor_flatten__()
            total += sum(getattr(parameter, name).nbytes for name in names if getattr(parameter, name) is not None)
        else:
            total += parameter.nbytes
    return total


def quantized_kind(model: Any) -> str:
    """The kind of weights the model's layers hold: "int8" or "int4" (torchao's tensors), "int8-dynamic"
    (`cpu_int8`'s layers), else "none"."""
    if is_cpu_int8(model):
        return "int8-dynamic"
    name = type(model.model.decoder.layers[0].experts.gate_up_proj).__name__
    return "int8" if name.startswith("Int8") else "int4" if name.startswith("Int4") else "none"


def compiles(model: Any) -> bool:
    """Whether the model's forward can be compiled whole (one graph, CUDA graphs on a GPU): float weights, or int8 /
    int4 ones whose experts run `experts_kernel` (a custom op with no host synchronisation); the other quantised
    experts loop in Python over the experts the tokens picked."""
    if not is_quantized(model):
        return True
    from .experts_kernel import kernel_experts

    return model.model.decoder.layers[0].experts.config._experts_implementation == kernel_experts()


def is_cpu_int8(model: Any) -> bool:
    """Whether `cpu_int8` quantised the model's projections (a LoRA layer around one counts: its base layer)."""
    projection = model.model.decoder.layers[0].self_attn.q_proj
    return isinstance(getattr(projection, "base_layer", projection), DynamicLinear)


def is_quantized(model: Any) -> bool:
    """Whether the model's layers carry torchao's quantised weights."""
    return quantized_kind(model) != "none"


@torch.inference_mode(False)
@torch.no_grad()
def use_quantized_experts(model: Any, grouped: bool | None = None, kernel: bool | None = None) -> None:
    """Run every MoE layer's experts through `experts_kernel` (`kernel`; None: on a GPU, with weights it reads),
    else `dequantized_experts` (`grouped`; None: on a GPU, where the weights can be dequantized), else
    `quantized_experts`, the latter on per-expert views of the quantised weights made here, once: outside inference
    mode, where torchao's quantised tensors can be indexed (they keep autograd's aliasing records, which inference
    tensors refuse)."""
    import copy

    from . import experts_kernel

    first = model.model.decoder.layers[0].experts
    on_gpu = first.gate_up_proj.device.type == "cuda"
    kernel = on_gpu and experts_kernel.use_kernel(first) if kernel is None else kernel
    grouped = on_gpu and hasattr(first.gate_up_proj, "dequantize") if grouped is None else grouped
    text = copy.copy(model.config.get_text_config())
    text._experts_implementation = (experts_kernel.kernel_experts() if kernel else dequantized_experts() if grouped
                                    else quantized_experts())  # fmt: skip
    looped = text._experts_implementation == quantized_experts()
    for layers in (model.model.decoder.layers, model.model.encoder.language_model.layers):
        for layer in layers:
            experts = layer.experts
            experts.config = text
            count = experts.num_experts if looped else 0
            experts.canvas_ls_views = [(experts.gate_up_proj[e], experts.down_proj[e]) for e in range(count)]


@functools.cache
def quantized_experts() -> str:
    """Register (on the first call) and name an MoE experts implementation for quantised weights: tokens sorted by
    the expert that picked them, then per expert with tokens, its gate/up and down projections (`F.linear` on the
    views `use_quantized_experts` made, which torchao's tensors implement), weighed by the router and summed in
    fp32 as transformers' grouped implementation sums them."""
    from transformers.integrations.moe import ExpertsInterface

    def experts(module: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:  # fmt: skip
        tokens, top_k = top_k_index.shape
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=module.num_experts).tolist()
        rows = order // top_k  # the token of each (token, pick) in expert order
        weights = top_k_weights.reshape(-1)[order]
        out = torch.zeros((tokens, hidden_states.shape[-1]), dtype=torch.float32, device=hidden_states.device)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            picked = rows[start : start + count]
            gate_up, down = module.canvas_ls_views[expert]
            hidden = module._apply_gate(torch.nn.functional.linear(hidden_states[picked], gate_up))
            expert_out = torch.nn.functional.linear(hidden, down) * weights[start : start + count, None]
            out.index_add_(0, picked, expert_out.float())
            start += count
        return out.to(hidden_states.dtype)

    name = "canvas_ls_quantized"
    ExpertsInterface.register(name, experts)
    return name


class _Dequantized:
    """An experts module as transformers' grouped implementation reads it, its fused weights dequantized."""

    def __init__(self, module: Any, dtype: torch.dtype):
        self._module = module
        self.gate_up_proj = module.gate_up_proj.dequantize(dtype)
        self.down_proj = module.down_proj.dequantize(dtype)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


@functools.cache
def dequantized_experts() -> str:
    """Register (on the first call) and name an MoE experts implementation for weights torchao can dequantize: the
    layer's fused expert weights dequantized to the activations' dtype, then transformers' grouped implementation."""
    from transformers.integrations.moe import ExpertsInterface, grouped_mm_experts_forward

    def experts(module: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:  # fmt: skip
        dense = _Dequantized(module, hidden_states.dtype)
        return grouped_mm_experts_forward(dense, hidden_states, top_k_index, top_k_weights)

    name = "canvas_ls_dequantized"
    ExpertsInterface.register(name, experts)
    return name
