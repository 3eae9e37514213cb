"""Quantised MoE experts on a GPU, their weights read once: a Triton grouped matmul for int8 and int4.

DiffusionGemma 26B-A4B's experts are ~90% of its weights, and a canvas of 64 slots, each picking 8 of 128 experts,
reaches nearly every expert of every layer at each step: on a GPU a step's time is the experts' bytes over the
memory's bandwidth. `quantize.dequantized_experts` reads a layer's int8 experts, writes them out in bf16 and reads
that back (5 bytes a weight); torchao's int4 layout cannot be read by expert at all (a loop of small matmuls). This
kernel reads the quantised weights in tiles and dequantizes them in registers (int8: the per-row scales applied to
its fp32 accumulator, 1 byte a weight; int4 (`int4_experts`): two weights a byte, a scale and minimum per 128
inputs, ~0.53 bytes a weight), on the expert's own tokens only.

    grouped_quantized_linear(a, rows, <weight parts>, starts, counts, ...) -> out [S, N]
        expert e owns sorted rows p in starts[e] .. starts[e] + counts[e] - 1:
        out[p] = a[rows[p]] @ W[e].T                  W [E, N, K]: the weights the parts stand for

One program per (expert, tile of N outputs) loops over its rows BLOCK_M at a time. The counts stay on the GPU (no
host synchronisation: CUDA graphs can hold it), and the function is a torch custom op with a fake implementation,
so that torch.compile traces around it, and a backward for `a` (the same kernel on the transposed weights), so that
LoRA trains through it on a quantised base. Tests run it in Triton's interpreter on the CPU, against transformers'
grouped implementation on the dequantized weights; tile sizes are set by reasoning, not tuned on a GPU yet
(`.ci/gpu_experts.py` times it against the dequantize-then-grouped path and bf16).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

import torch

try:  # triton is a Linux x86_64 dependency; elsewhere the dequantize-then-grouped path serves
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


def available(device: torch.device) -> bool:
    """The kernel runs on CUDA with triton (or anywhere under TRITON_INTERPRET=1, for tests)."""
    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def int8_parts(weight: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(qdata [E, N, K] int8, scale [E, N]) of a torchao int8 expert weight with one scale per output row and no
    activation quantisation; None for anything else (the dequantize path serves it). Symmetric (a zero point of
    zeros, which torchao stores) is checked once, by `use_kernel`."""
    qdata, scale = getattr(weight, "qdata", None), getattr(weight, "scale", None)
    if qdata is None or scale is None or qdata.dtype != torch.int8 or qdata.dim() != 3:
        return None
    if any(getattr(weight, name, None) is not None for name in ("act_quant_kwargs", "act_pre_scale")):
        return None
    scale = scale.reshape(scale.shape[0], -1) if scale.dim() == 3 and scale.shape[-1] == 1 else scale
    if tuple(scale.shape) != tuple(qdata.shape[:2]):
        return None
    return qdata, scale


@dataclass
class Quantized:
    """An expert weight as the kernel reads it: qdata [E, N, K] int8 with scale [E, N] (one per output row, applied
    to the accumulator), or qdata [E, N, K/2] uint8 int4 pairs with scale and low [E, G, N] per `group` inputs."""

    qdata: torch.Tensor
    scale: torch.Tensor
    low: torch.Tensor | None = None
    group: int = 0

    @property
    def shape(self) -> tuple[int, int, int]:  # [E, N, K] of the weights it stands for
        experts, rows, inputs = self.qdata.shape
        return experts, rows, inputs * 2 if self.group else inputs


def weight_parts(weight: Any) -> Quantized | None:
    """The parts of an expert weight the kernel reads (torchao's int8, or `int4_experts`' int4), else None."""
    if type(weight).__name__ == "Int4ExpertsTensor":
        return Quantized(weight.qdata, weight.scale, weight.low, weight.group)
    parts = int8_parts(weight)
    return Quantized(*parts) if parts is not None else None


if triton is not None:

    @triton.jit
    def _grouped_kernel(
        a_ptr, rows_ptr, w_ptr, scale_ptr, low_ptr, starts_ptr, counts_ptr, out_ptr,
        n_out, k_in,
        stride_am, stride_we, stride_wn, stride_wk, stride_se, stride_sg, stride_om,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
        GROUP: tl.constexpr, TRANSPOSED: tl.constexpr,
    ):  # fmt: skip
        """One program: expert program_id(0)'s rows, outputs program_id(1) * BLOCK_N ... . Weight element (n, k):
        forward, n is the output column and k the input; TRANSPOSED (the backward), the other way round. GROUP 0:
        int8 with a scale per n (on the accumulator, forward); else int4 pairs with scale and low per GROUP k."""
        expert = tl.program_id(0)
        columns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        column_ok = columns < n_out
        start = tl.load(starts_ptr + expert)
        count = tl.load(counts_ptr + expert)
        w_base = w_ptr + expert.to(tl.int64) * stride_we
        s_base = scale_ptr + expert.to(tl.int64) * stride_se
        l_base = low_ptr + expert.to(tl.int64) * stride_se
        for m0 in range(0, count, BLOCK_M):
            ranks = m0 + tl.arange(0, BLOCK_M)
            row_ok = ranks < count
            rows = tl.load(rows_ptr + start + ranks, mask=row_ok, other=0).to(tl.int64)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, k_in, BLOCK_K):
                inner = k0 + tl.arange(0, BLOCK_K)
                inner_ok = inner < k_in
                a = tl.load(a_ptr + rows[:, None] * stride_am + inner[None, :],
                            mask=row_ok[:, None] & inner_ok[None, :], other=0.0)  # fmt: skip
                ok = inner_ok[:, None] & column_ok[None, :]
                if TRANSPOSED:
                    n = inner[:, None] + 0 * columns[None, :]
                    k = columns[None, :] + 0 * inner[:, None]
                else:
                    n = columns[None, :] + 0 * inner[:, None]
                    k = inner[:, None] + 0 * columns[None, :]
                if GROUP == 0:  # int8
                    w = tl.load(w_base + n * stride_wn + k * stride_wk, mask=ok, other=0).to(tl.float32)
                    if TRANSPOSED:  # the scale runs along the reduction: per element
                        w = w * tl.load(s_base + n, mask=ok, other=0.0).to(tl.float32)
                else:  # int4: two a byte along k, the even one low
                    pair = tl.load(w_base + n * stride_wn + (k // 2) * stride_wk, mask=ok, other=0)
                    level = ((pair >> ((k % 2) * 4).to(tl.uint8)) & 15).to(tl.float32)
                    at = (k // GROUP) * stride_sg + n
                    w = level * tl.load(s_base + at, mask=ok, other=0.0).to(tl.float32)
                    w = w + tl.load(l_base + at, mask=ok, other=0.0).to(tl.float32)
                if IEEE:  # noqa: SIM108 (a constexpr branch: Triton compiles one side)
                    acc = tl.dot(a, w.to(a.dtype), acc, input_precision="ieee")
                else:
                    acc = tl.dot(a, w.to(a.dtype), acc)
            if GROUP == 0 and not TRANSPOSED:  # int8's scale per output column, once
                acc = acc * tl.load(s_base + columns, mask=column_ok, other=0.0).to(tl.float32)[None, :]
            positions = (start + ranks).to(tl.int64)
            tl.store(out_ptr + positions[:, None] * stride_om + columns[None, :], acc.to(out_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & column_ok[None, :])  # fmt: skip

    @torch.library.custom_op("canvas_ls::grouped_quantized_linear", mutates_args=())
    def grouped_quantized_linear(a: torch.Tensor, rows: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor,
                                 low: torch.Tensor | None, group: int, starts: torch.Tensor, counts: torch.Tensor,
                                 rows_per_expert: int, transposed: bool = False) -> torch.Tensor:  # fmt: skip
        """out [S, N] (S = len(rows), a's dtype): row p = a[rows[p]] @ W[e].T for the expert e whose sorted rows
        hold p, W the dequantized weights (`Quantized`); `transposed`: @ W[e] instead ([S, K]).
        `rows_per_expert`: the tokens an expert gets on average (it sizes the row tile)."""
        experts, n_rows, n_inputs = Quantized(qdata, scale, low, group).shape
        n_out, k_in = (n_inputs, n_rows) if transposed else (n_rows, n_inputs)
        a = a if a.stride(-1) == 1 else a.contiguous()  # the kernel steps along a row by one
        out = torch.empty((rows.shape[0], n_out), dtype=a.dtype, device=a.device)
        block_m = 16 if rows_per_expert <= 16 else 32 if rows_per_expert <= 32 else 64
        block_n, block_k = 64, 64
        grid = (experts, triton.cdiv(n_out, block_n))
        _grouped_kernel[grid](
            a, rows, qdata, scale, scale if low is None else low, starts, counts, out,
            n_out, k_in,
            a.stride(0), qdata.stride(0), qdata.stride(1), qdata.stride(2), scale.stride(0),
            scale.stride(1) if group else 0, out.stride(0),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=a.dtype == torch.float32,
            GROUP=group, TRANSPOSED=transposed,
        )  # fmt: skip
        return out

    @grouped_quantized_linear.register_fake
    def _(a: torch.Tensor, rows: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, low: torch.Tensor | None,
          group: int, starts: torch.Tensor, counts: torch.Tensor, rows_per_expert: int,
          transposed: bool = False) -> torch.Tensor:  # fmt: skip
        _, n_rows, n_inputs = Quantized(qdata, scale, low, group).shape
        return a.new_empty((rows.shape[0], n_inputs if transposed else n_rows))

    def _keep(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        a, rows, qdata, scale, low, group, starts, counts, rows_per_expert, transposed = inputs
        ctx.save_for_backward(rows, qdata, scale, low, starts, counts)
        ctx.a_shape, ctx.group, ctx.rows_per_expert, ctx.transposed = a.shape, group, rows_per_expert, transposed

    def _backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """The gradient for `a` only (the quantised weights are frozen: LoRA on a quantised base): each row's
        gradient times its expert's weights the other way round (the same kernel), summed into the rows of `a` it
        read."""
        rows, qdata, scale, low, starts, counts = ctx.saved_tensors
        sorted_rows = torch.arange(rows.shape[0], dtype=torch.int32, device=rows.device)
        per_row = grouped_quantized_linear(grad.contiguous(), sorted_rows, qdata, scale, low, ctx.group, starts,
                                           counts, ctx.rows_per_expert, not ctx.transposed)  # fmt: skip
        grad_a = torch.zeros(ctx.a_shape, dtype=torch.float32, device=grad.device)
        grad_a.index_add_(0, rows.long(), per_row.float())
        return grad_a.to(grad.dtype), *([None] * 9)

    grouped_quantized_linear.register_autograd(_backward, setup_context=_keep)


def grouped_linear(a: torch.Tensor, rows: torch.Tensor, weight: Quantized, starts: torch.Tensor, counts: torch.Tensor,
                   rows_per_expert: int) -> torch.Tensor:  # fmt: skip
    """`grouped_quantized_linear` on a `Quantized` weight."""
    return grouped_quantized_linear(a, rows, weight.qdata, weight.scale, weight.low, weight.group, starts, counts,
                                    rows_per_expert)  # fmt: skip


def quantized_experts_forward(module: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                              top_k_weights: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """transformers' experts interface on int8 or int4 weights: (token, pick) pairs sorted by expert, the gate/up
    projection by the kernel on the gathered tokens, the model's own gating, the down projection by the kernel, then
    each pair weighed by the router and summed per token in fp32, as transformers' grouped implementation sums
    them."""
    gate_up, down = weight_parts(module.gate_up_proj), weight_parts(module.down_proj)
    assert gate_up is not None and down is not None  # `use_kernel` checked them
    tokens, top_k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(module.num_experts, dtype=torch.int32, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    starts = (torch.cumsum(counts, 0, dtype=torch.int32) - counts).contiguous()
    rows = (order // top_k).to(torch.int32)
    per_expert = max(1, flat.numel() // module.num_experts)
    projected = grouped_linear(hidden_states.contiguous(), rows, gate_up, starts, counts, per_expert)
    gated = module._apply_gate(projected).contiguous()
    sorted_rows = torch.arange(flat.numel(), dtype=torch.int32, device=flat.device)
    out_sorted = grouped_linear(gated, sorted_rows, down, starts, counts, per_expert)
    weighted = out_sorted.float() * top_k_weights.reshape(-1)[order, None].float()
    out = torch.zeros((tokens, hidden_states.shape[-1]), dtype=torch.float32, device=hidden_states.device)
    out.index_add_(0, rows.long(), weighted)
    return out.to(hidden_states.dtype)


def use_kernel(experts: Any) -> bool:
    """Whether an experts module's weights are ones the kernel reads (int8, symmetric, one scale per output row; or
    `int4_experts`; not transposed, no biases) on a device it runs on."""
    weights = (experts.gate_up_proj, experts.down_proj)
    return (
        available(experts.gate_up_proj.device)
        and not getattr(experts, "is_transposed", False)
        and not getattr(experts, "has_bias", False)
        and getattr(experts, "has_gate", True)
        and all(weight_parts(weight) is not None for weight in weights)
        and not any(
            getattr(weight, "zero_point", None) is not None and bool(weight.zero_point.any()) for weight in weights
        )
    )


@functools.cache
def kernel_experts() -> str:
    """Register (on the first call) and name the experts implementation that runs `quantized_experts_forward`."""
    from transformers.integrations.moe import ExpertsInterface

    name = "canvas_ls_kernel"
    ExpertsInterface.register(name, quantized_experts_forward)
    return name
