"""The LM head and its soft-capped cross-entropy in one pass, in row chunks: the training step's vocabulary cost.

With an 8k vocabulary and a 256-wide model, the logits of a 16 x 192-token batch are 100 MB of fp32, and eager
PyTorch walks them a dozen times (the head's matmul, /cap, tanh, *cap, log-softmax, and each of their backwards):
on the project's 2-core CPU that took as long as every other matmul of the step. Here each chunk of rows goes
through matmul -> soft-cap -> log-softmax -> gradient while it is still in cache, and the gradients of the hidden
states and the head's weight are made in the forward pass (the loss is a scalar, so backward only scales them).
Same maths as `model.lm_head` + the model's soft-capping + `F.cross_entropy`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

# Rows per chunk: 256 x 8k fp32 logits (8 MB) stay in a CPU's cache; a GPU wants few, large kernels instead.
CHUNK_ROWS = {"cpu": 256, "cuda": 8192}


class _SoftcappedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        row_weights: torch.Tensor,
        cap: float | None,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        w = weight.to(dtype)
        need_grads = any(ctx.needs_input_grad[:2])  # False under no_grad (evaluation): the loss alone
        grad_hidden = torch.zeros(hidden.shape if need_grads else 0, dtype=torch.float32, device=hidden.device)
        grad_weight = torch.zeros(weight.shape if need_grads else 0, dtype=torch.float32, device=weight.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        chunk = CHUNK_ROWS.get(hidden.device.type, CHUNK_ROWS["cpu"])
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            scale = row_weights[rows].float()
            keep = scale != 0
            if not bool(keep.any()):
                continue
            h = hidden[rows][keep].to(dtype)
            scale, target = scale[keep], targets[rows][keep]
            logits = (h @ w.T).float()
            if cap:
                squashed = logits.div_(cap).tanh_()  # the model's soft-cap: cap * tanh(z / cap)
                logits = squashed * cap
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, target[:, None]).squeeze(1)
            total += ((lse - picked) * scale).sum()
            if not need_grads:
                continue
            grad = logits.sub_(lse[:, None]).exp_()  # softmax
            grad[torch.arange(len(target), device=grad.device), target] -= 1.0
            if cap:
                grad.mul_(squashed.square_().neg_().add_(1.0))  # d(cap * tanh(z / cap)) / dz
            grad.mul_(scale[:, None])
            grad = grad.to(dtype)
            grad_hidden[rows][keep] = (grad @ w).float()
            grad_weight += (grad.T @ h).float()
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return total

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        grad_hidden, grad_weight = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        return (
            (grad_hidden * grad_output).to(hidden_dtype),
            (grad_weight * grad_output).to(weight_dtype),
            None,
            None,
            None,
            None,
        )


def softcapped_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    row_weights: torch.Tensor,
    cap: float | None,
    fused: bool = True,
) -> torch.Tensor:
    """sum_i row_weights[i] * CE(cap * tanh(hidden[i] @ weight.T / cap), targets[i]) over rows [N, H]; rows of
    weight 0 are skipped (use them for padding). Matmuls run in the autocast dtype when autocast is on.
    `fused=False`: the same in plain eager PyTorch (the reference, and the baseline of `bench train`)."""
    if not fused:
        logits = (hidden @ weight.T).float()
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return (F.cross_entropy(logits, targets, reduction="none") * row_weights).sum()
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    with torch.autocast(device, enabled=False):
        return _SoftcappedLinearCrossEntropy.apply(hidden, weight, targets, row_weights, cap, dtype)
