"""Int4 MoE expert weights in a layout `experts_kernel` reads: what a 24 GB card holds DiffusionGemma's experts in.

torchao's int4 weight-only layout (tinygemm's tiles) serves the attention and dense MLP projections through its own
matmul, but cannot be indexed by expert, dequantized, or read by another kernel: its experts looped over the
experts the tokens picked, ~8,000 small matmuls a step. Here the experts' fused 3-D weights [E, N, K] are quantised
by a torchao config of ours (`Int4ExpertsConfig`, named for them in `quantize.torchao_config`'s `FqnToConfig`, so
that transformers quantises them weight by weight while the checkpoint loads, like the others) into:

    qdata [E, N, K/2] uint8   two weights a byte along K (the even one in the low nibble), unsigned 0..15
    scale [E, G, N]           per group of GROUP inputs (the last group may be shorter): w = q * scale + low
    low   [E, G, N]           the group's minimum (asymmetric: a weight row's range, 16 levels)

`Int4ExpertsTensor` is a torchao tensor subclass (so loading, `.to()`, sharing between the encoder and the decoder
and `held_bytes` treat it as one weight), with `dequantize` for the reference and for a GPU without triton.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torchao.core.config import AOBaseConfig
from torchao.quantization.transform_module import register_quantize_module_handler
from torchao.utils import TorchAOBaseTensor

GROUP = 128
LEVELS = 15
CHUNK = 8  # experts quantised at a time


class Int4ExpertsTensor(TorchAOBaseTensor):
    tensor_data_names: ClassVar[list[str]] = ["qdata", "scale", "low"]
    tensor_attribute_names: ClassVar[list[str]] = ["group", "shape"]

    def __new__(cls, qdata: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, group: int, shape: torch.Size):
        return torch.Tensor._make_wrapper_subclass(cls, shape, device=qdata.device, dtype=scale.dtype,
                                                   requires_grad=False)  # fmt: skip

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, group: int, shape: torch.Size):
        super().__init__()
        self.qdata, self.scale, self.low, self.group = qdata, scale, low, group

    @classmethod
    def from_float(cls, weight: torch.Tensor, group: int = GROUP) -> Int4ExpertsTensor:
        """Quantise [E, N, K] float weights (K even), group by group of `group` inputs; a few experts at a time, so
        that a GPU loading the checkpoint holds only their fp32 copies beside the weights already loaded
        (DiffusionGemma's fused gate/up weights of one layer are 1 GB in bf16)."""
        parts = [cls._quantize(chunk, group) for chunk in weight.split(CHUNK)]
        qdata, scale, low = (torch.cat(pieces) for pieces in zip(*parts, strict=True))
        return cls(qdata, scale, low, group, weight.shape)

    @staticmethod
    def _quantize(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        experts, rows, inputs = weight.shape
        groups = -(-inputs // group)
        padded = torch.nn.functional.pad(weight.float(), (0, groups * group - inputs))  # the last group: zeros
        grouped = padded.reshape(experts, rows, groups, group)
        low = grouped.amin(dim=-1, keepdim=True)
        scale = ((grouped.amax(dim=-1, keepdim=True) - low) / LEVELS).clamp_min(1e-8)
        levels = ((grouped - low) / scale).round_().clamp_(0, LEVELS).to(torch.uint8)
        levels = levels.reshape(experts, rows, groups * group)[..., :inputs]
        qdata = levels[..., 0::2] | (levels[..., 1::2] << 4)
        # Stored [E, G, N]: a tile of N outputs reads its group's scales from one row
        scale, low = (t[..., 0].transpose(1, 2).contiguous().to(weight.dtype) for t in (scale, low))
        return qdata.contiguous(), scale, low

    def dequantize(self, output_dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weights [E, N, K] in `output_dtype`, a few experts at a time (the fp32 work beside the output stays
        small: a GPU without triton dequantizes a layer's experts at every forward)."""
        out = torch.empty(self.shape, dtype=output_dtype or self.dtype, device=self.qdata.device)
        per_input = torch.arange(self.shape[-1], device=self.qdata.device) // self.group
        for start in range(0, self.shape[0], CHUNK):
            part = slice(start, start + CHUNK)
            levels = torch.stack([self.qdata[part] & 15, self.qdata[part] >> 4], dim=-1).flatten(-2).float()
            scale = self.scale[part].float().transpose(1, 2)[..., per_input]
            low = self.low[part].float().transpose(1, 2)[..., per_input]
            out[part] = levels.mul_(scale).add_(low)
        return out


@dataclass
class Int4ExpertsConfig(AOBaseConfig):
    """torchao config for MoE experts' fused weights: `Int4ExpertsTensor` with groups of `group` inputs."""

    group: int = GROUP


@register_quantize_module_handler(Int4ExpertsConfig)
def _quantize_experts(module: torch.nn.Module, config: Int4ExpertsConfig, *,
                      parameter_name: str = "weight") -> torch.nn.Module:  # fmt: skip
    weight = getattr(module, parameter_name)
    quantized = Int4ExpertsTensor.from_float(weight.detach(), config.group)
    setattr(module, parameter_name, torch.nn.Parameter(quantized, requires_grad=False))
    return module
