"""One MoE layer of DiffusionGemma 26B-A4B's geometry (128 experts, top 8, random bf16 weights) on this machine's GPU:
ms per call and the difference from bf16 for each way canvas-ls runs its experts: bf16 with transformers' grouped
matmul, int8 and int4 dequantized per layer then grouped (`quantize.dequantized_experts`), int8 and int4 by the
Triton kernel (`experts_kernel`), eager and in one CUDA graph; the bf16 reference holds the quantised weights' own
values, so the differences are the implementations', not quantisation's. Tokens: a 64- and a 256-slot canvas, and
8 rows of 64. Part of `.ci/gpu`; prints a table, writes JSON to argv[1]."""

from __future__ import annotations

import copy
import functools
import json
import sys
from pathlib import Path
from typing import Any

import torch

from canvas_ls.bench.core import timed
from canvas_ls.engine.architecture import full_width_config, random_model, small_config
from canvas_ls.engine.experts_kernel import kernel_experts
from canvas_ls.engine.quantize import dequantized_experts, quantize_model


def graphed(fn: Any) -> Any:
    """fn captured in a CUDA graph (after a warm-up on a side stream), replayed per call."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return lambda: (graph.replay(), out)[1]


def with_implementation(experts: Any, name: str) -> Any:
    config = copy.copy(experts.config)
    config._experts_implementation = name
    experts.config = config
    return experts


def measure(label: str, module: Any, tokens: int, inputs: tuple[torch.Tensor, ...], reference: torch.Tensor,
            device: torch.device) -> dict[str, Any]:  # fmt: skip
    """One implementation's figures at one token count, printed as a table row; an error is said, not raised."""
    case: dict[str, Any] = {"tokens": tokens, "implementation": label}
    try:
        call = functools.partial(module, *inputs)
        case["max_abs_diff"] = float((call().float() - reference.float()).abs().max())
        case["eager_ms"] = round(timed(call, device, 20), 3)
        if device.type == "cuda":
            case["graph_ms"] = round(timed(graphed(call), device, 20), 3)
    except Exception as exc:  # said, and the next one measured
        case["error"] = f"{type(exc).__name__}: {exc}"[:300]
    cells = [f"{case.get(k, float('nan')):>9.3f}" for k in ("eager_ms", "graph_ms")]
    print(f"{tokens:>7} {label:<24} {' '.join(cells)} {case.get('max_abs_diff', float('nan')):>19.4g}"
          + (f"  {case['error']}" if "error" in case else ""))  # fmt: skip
    return case


def main(out: Path, device: torch.device) -> None:
    """On the CPU (a smoke run here, the kernel in Triton's interpreter) the tiny test architecture in fp32, no
    graphs."""
    config = full_width_config(1) if device.type == "cuda" else small_config(384)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the interpreter has no bf16
    plain = random_model(config, device, dtype).model.decoder.layers[0].experts
    kinds = ("int8", "int4") if device.type == "cuda" else ("int8",)  # torchao's int4 projections need a GPU
    quantized = {kind: quantize_model(random_model(config, device, dtype), kind).model.decoder.layers[0].experts
                 for kind in kinds}  # fmt: skip
    text = config.get_text_config()
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    report: dict[str, Any] = {"device": name, "experts": text.num_experts,
                              "top_k": text.top_k_experts, "hidden": text.hidden_size,
                              "intermediate": text.moe_intermediate_size, "cases": []}  # fmt: skip
    print(f"{report['device']}: one MoE layer, {text.num_experts} experts, top {text.top_k_experts}")
    print(f"{'tokens':>7} {'implementation':<24} {'ms eager':>9} {'ms graph':>9} {'max |diff| vs bf16':>19}")
    for tokens in (64, 256, 512) if device.type == "cuda" else (24,):
        generator = torch.Generator(device).manual_seed(tokens)
        hidden = torch.randn(tokens, text.hidden_size, device=device, dtype=dtype, generator=generator)
        scores = torch.randn(tokens, text.num_experts, device=device, generator=generator)
        weights, picks = torch.topk(torch.softmax(scores, dim=-1), text.top_k_experts, dim=-1)
        weights = weights.to(dtype)
        for kind, experts in quantized.items():
            with torch.no_grad():  # the bf16 reference holds the quantised weights' own values: differences are the
                plain.gate_up_proj.copy_(experts.gate_up_proj.dequantize(dtype))  # kernels', not quantisation's
                plain.down_proj.copy_(experts.down_proj.dequantize(dtype))
            with torch.inference_mode():
                reference = plain(hidden, picks, weights)
                runs = [(f"{kind} dequantized+grouped", experts, dequantized_experts()),
                        (f"{kind} triton kernel", experts, kernel_experts())]  # fmt: skip
                if kind == kinds[0]:
                    runs.insert(0, ("bf16 grouped", plain, plain.config._experts_implementation))
                for label, module, implementation in runs:
                    report["cases"].append(measure(label, with_implementation(module, implementation), tokens,
                                                   (hidden, picks, weights), reference, device))  # fmt: skip
    out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), torch.device(sys.argv[2] if len(sys.argv) > 2 else "cuda"))
