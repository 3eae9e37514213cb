"""Load a DiffusionGemmaForBlockDiffusion checkpoint and its tokenizer, or fail with one clear line.

A model is a local folder or a hub id (`from_pretrained` either way). bf16 on CUDA, placed by accelerate
(`device_map="auto"`); on a CPU, bf16 where it has native bf16 arithmetic (AVX-512 BF16 or AMX: a bf16 matmul
ran 2.4x an fp32 one on the project's CPU) and fp32 elsewhere (emulated bf16 is slower than fp32).

Every failure becomes a `ModelLoadError` whose message is a single sentence a user can act on; tracebacks stay out
of the editor and the terminal.
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .elementwise import cheaper_activations
from .errors import ModelLoadError
from .model_source import model_source
from .paths import DEFAULT_MODEL_DIR, fingerprint, installation

__all__ = ["DEFAULT_MODEL_DIR", "LoadedModel", "load_model"]


@dataclass
class LoadedModel:
    model: Any  # transformers.DiffusionGemmaForBlockDiffusion, in eval mode
    tokenizer: Any  # a transformers PreTrainedTokenizerBase
    name: str  # what the user asked for (path or hub id)
    folder: Path | None  # the local folder the files came from, when there is one
    device: torch.device
    quantized: str = "none"  # the layers' weights: "none", "int8" or "int4" (engine.quantize)
    # Which model answers, as loaded (`identity`): the resolved model, its files' fingerprint when it loaded, device,
    # dtype, quantisation and adapter. The server keys its completion cache on it and refuses an engine whose
    # identity is not the one it asked for.
    identity: dict[str, str] = field(default_factory=dict)


def resolve_device(device: str | None) -> torch.device:
    if device in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise ModelLoadError(f"unknown device '{device}' (use cpu, cuda, cuda:N or auto)") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device '{device}' was asked for, but this machine has no usable CUDA GPU: use "
                             "--device cpu, or auto (a GPU when there is one)")  # fmt: skip
    return resolved


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def cpu_has_native_bf16(cpuinfo: Path = Path("/proc/cpuinfo"), capability: str | None = None) -> bool:
    """Whether the CPU has bf16 arithmetic (AVX-512 BF16 or AMX) and torch's kernels use it: with its kernels held
    to AVX2 (`ATEN_CPU_CAPABILITY=avx2`, or a build without AVX-512) bf16 is emulated, slower than fp32."""
    if not (capability or torch.backends.cpu.get_cpu_capability()).startswith("AVX512"):
        return False
    try:
        flags = next((line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return False
    return bool({"avx512_bf16", "amx_bf16"} & set(flags.split()))


def resolve_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    """auto (None): bf16 on CUDA and on CPUs with native bf16, fp32 on other CPUs."""
    if dtype in (None, "", "auto"):
        return torch.bfloat16 if device.type == "cuda" or cpu_has_native_bf16() else torch.float32
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype '{dtype}' (use auto, float32 or bfloat16)")
    return DTYPES[dtype]


def load_model(name: str | None = None, device: str | None = None, dtype: str | None = None,
               adapter: str | None = None, merge_adapter: bool = True,
               quantize: str | None = None) -> LoadedModel:  # fmt: skip
    """Load `name` (a folder or a hub id; None: the shipped default model) onto `device` (None: best available),
    in `dtype` (None: the fastest exact-enough one for that device, see `resolve_dtype`), its layers' weights
    quantised as `quantize` says (None: "auto", see `engine.quantize`), with a LoRA `adapter` folder applied (merged
    into the weights unless `merge_adapter` is False; never merged into quantised weights). (~95 lines: the steps of
    one load in the order transformers needs them: resolve, configure quantisation, load, adapt, patch, report.)"""
    from transformers import AutoConfig, AutoTokenizer, DiffusionGemmaForBlockDiffusion

    from . import quantize as quantization

    quiet_libraries()
    target = resolve_device(device)
    weights_dtype = resolve_dtype(dtype, target)
    if target.type == "cpu":
        bound_kernel_caches()

    folder, source = model_source(name)
    name = name or str(DEFAULT_MODEL_DIR)

    try:
        config = AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as exc:
        if folder is not None:
            raise ModelLoadError(f"cannot read the model config in '{name}': {_first_line(exc)}") from exc
        raise ModelLoadError(
            f"model '{name}' is not a local folder and could not be fetched from the model hub "
            f"(offline, or no such model): {_first_line(exc)}"
        ) from exc
    if getattr(config, "model_type", None) != "diffusion_gemma":
        raise ModelLoadError(
            f"model '{name}' is a '{getattr(config, 'model_type', '?')}' model; canvas-ls needs a "
            "DiffusionGemmaForBlockDiffusion (model_type 'diffusion_gemma')"
        )

    quantized = quantization.resolve(quantize, config, target)
    # int8-dynamic loads float32 and is quantised once loaded and adapted (`quantize.cpu_int8`); torchao quantises
    # int8 and int4 while the checkpoint loads
    cpu_int8 = quantized == "int8-dynamic"
    if cpu_int8:
        weights_dtype = torch.float32
    kwargs: dict[str, Any] = {"dtype": weights_dtype}
    if quantized != "none" and not cpu_int8:
        kwargs["quantization_config"] = quantization.torchao_config(quantized)
    if target.type == "cuda":
        kwargs["device_map"] = "auto" if target.index is None else {"": target.index}
    try:
        model = DiffusionGemmaForBlockDiffusion.from_pretrained(source, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError, RuntimeError) as exc:
        raise ModelLoadError(f"cannot load model '{name}': {_first_line(exc)}") from exc
    if target.type != "cuda":
        model.to(target)
    if target.type == "cpu" and weights_dtype != torch.float32:
        model.set_attn_implementation(fp32_attention())
    text = model.config.get_text_config()
    if quantized != "none" and not cpu_int8:
        quantization.use_quantized_experts(model)
    elif text.num_experts <= DENSE_ARITHMETIC * text.top_k_experts:
        use_dense_experts(model, encoder=target.type == "cpu" and weights_dtype == torch.bfloat16)
    model.eval()
    if adapter:
        from .adapters import apply_adapter
        from .workspaces import holds_beside_others

        folder_of_adapter = Path(adapter).expanduser()
        # peft's LoRA on a 3-D parameter (the experts') needs float weights
        if (quantized != "none" and not cpu_int8 and (folder_of_adapter / "adapter_config.json").is_file()
                and not holds_beside_others(folder_of_adapter)):  # fmt: skip
            raise ModelLoadError(
                f"adapter '{adapter}' adapts the MoE experts' weights, which {quantized} weights cannot take: "
                "load it with --quantize none, or tune one without --lora-experts"
            )
        model = apply_adapter(model, adapter, merge_adapter and (quantized == "none" or cpu_int8))
    if cpu_int8:  # eager on the CPU: the packed projections, and the GELU on `exp` (`elementwise.py`)
        quantization.cpu_int8(model)
        cheaper_activations(model)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=f"{name} + {adapter}" if adapter else name,
        folder=folder,
        device=target,
        quantized=quantized,
        identity=identity(name, folder, target, str(model.dtype).removeprefix("torch."), quantized, adapter),
    )


def identity(name: str, folder: Path | None, device: torch.device, dtype: str, quantized: str,
             adapter: str | None) -> dict[str, str]:  # fmt: skip
    """A loaded model's identity (`LoadedModel.identity`), its folders' fingerprints taken now."""
    adapter_folder = Path(adapter).expanduser().resolve() if adapter else None
    return {
        **installation(),
        "model": str(folder.resolve()) if folder is not None else name,
        "fingerprint": fingerprint(folder),
        "device": device.type,
        "dtype": dtype,
        "quantize": quantized,
        "adapter": f"{adapter_folder}@{fingerprint(adapter_folder)}" if adapter_folder else "",
    }


# Kernels oneDNN keeps per matmul shape on a CPU (ideep's and oneDNN's own caches, 1024 each by default).
KERNEL_CACHE_ENTRIES = 256


def bound_kernel_caches() -> None:
    """Keep fewer of the matmul kernels oneDNN builds per shape (each prefix length is a new shape). Read once, at
    the process's first oneDNN matmul, so this must run before it; a variable the user set wins.

    Measured 2026-12-01 (2-core Xeon with AMX, shipped model in bf16, 400 requests of random prefix lengths): the
    default 1,024 entries each held the engine at 1,132 MB, 256 at 660 MB, 128 at 583 MB, flat from request 100
    on each time; a keystroke walk (150 completions over a growing file, two runs each, alternated) took p50 149
    and 197 ms at 256, 175 and 164 ms at 1,024: the same within this machine's noise."""
    for variable in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(variable, str(KERNEL_CACHE_ENTRIES))


@functools.cache
def fp32_attention() -> str:
    """Register (on the first call) and name an attention that runs torch's SDPA in fp32 on bf16 queries, keys and
    values.

    For a bf16 model on a CPU. There SDPA's flash kernel runs bf16 through oneDNN brgemm kernels JIT-compiled per
    block shape and kept for the process's life: every new prefix length adds some (measured 2026-12-01, 2-core
    Xeon with AMX, shipped model, 400 requests of random prefix lengths: RSS +28 MB per 100 requests, ~10 MB of it
    executable pages, without end; the 10,000-request soak's engine growth). In fp32 (MKL's gemm) the same
    requests leave RSS flat (+6 MB over 400 after the first 100), at the same p50 latency (163.2 vs 163.7 ms over
    200 keystrokes); transformers' eager attention is flat too but ~15% slower."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:  # fmt: skip
        out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask,
                                              **kwargs)  # fmt: skip
        return out.to(query.dtype), weights

    name = "canvas_ls_sdpa_fp32"
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


# The decoder runs every expert on every token (`dense_experts`) where that is at most this many times the arithmetic
# of the experts the router picks (the shipped model: 4 experts, top 2, measured); elsewhere transformers' choice.
DENSE_ARITHMETIC = 2


@functools.cache
def dense_experts() -> str:
    """Register (on the first call) and name an MoE experts implementation that runs every expert on every token
    and weighs each output by the router (0 for the experts it did not pick), in two batched matmuls.

    For a model with few experts, such as the shipped one (4, top 2): twice the experts' arithmetic, but no sort,
    no per-expert loop or data-dependent shapes, which cost more than the arithmetic at a denoising step's few
    dozen tokens. The picked experts' outputs are summed in fp32 as transformers' grouped implementation sums them
    (adding the others' zeros is exact). Measured 2026-12-02 (2-core Xeon with AMX, shipped model, bf16, 40
    HumanEval multi-line holes alternated over engines of the code before and after): a step 9.5 -> 9.2 ms eager,
    6.3 -> 5.7 ms compiled, the same answers eager (40 of 40); the eager decoder forward alone 7.9 -> 6.9 ms."""
    from transformers.integrations.moe import ExpertsInterface

    def experts(module: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:  # fmt: skip
        routed = torch.zeros(
            (hidden_states.shape[0], module.num_experts), dtype=top_k_weights.dtype, device=hidden_states.device
        ).scatter_(1, top_k_index, top_k_weights)  # [T, E]
        gate_up = torch.matmul(hidden_states, module.gate_up_proj.transpose(1, 2))  # [E, T, 2I]
        out = torch.matmul(module._apply_gate(gate_up), module.down_proj.transpose(1, 2))  # [E, T, H]
        return (out * routed.t()[..., None]).sum(0).to(hidden_states.dtype)

    name = "canvas_ls_dense"
    ExpertsInterface.register(name, experts)
    return name


def use_dense_experts(model: Any, encoder: bool) -> None:
    """The decoder's experts run dense (`dense_experts`), and the encoder's too when `encoder` (bf16 on a CPU);
    otherwise the encoder keeps transformers' grouped experts. On a CPU transformers' grouped matmul is slow in bf16:
    in a 380-520-token encode 2.3 ms a call against 0.7 in fp32. Measured 2026-12-03 (2-core Xeon with AMX, shipped
    model, one process, the median of 10 encodes each): bf16 grouped vs dense, a new document's encode 46.2 vs
    34.2 ms, a 40-token tail after it 12.2 vs 9.7 ms; fp32 29.1 vs 34.1 and 9.7 vs 10.6 ms (there the doubled
    arithmetic costs more than the grouping)."""
    config = copy.copy(model.config.get_text_config())
    config._experts_implementation = dense_experts()
    layers = list(model.model.decoder.layers)
    if encoder:
        layers += list(model.model.encoder.language_model.layers)
    for layer in layers:
        layer.experts.config = config


def decoder_experts(model: Any) -> str:
    """The experts implementation the decoder runs."""
    return str(model.model.decoder.layers[0].experts.config._experts_implementation)


def quiet_libraries() -> None:
    """No library warnings or progress bars: stdout may be an LSP stream, and the CLI prints only answers."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    # The library's deprecation notices are for us (we pass `cache`, 5.24's name), not for the user's terminal.
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]
