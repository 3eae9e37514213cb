"""A LoRA training step on DiffusionGemma 26B-A4B's geometry (random bf16 weights) on this machine's GPU: seconds
per step and peak memory, per batch size, so that one device run says which cards (24/48/80 GB) can tune it. The
adapter targets the attention and dense MLP projections (and, in a second run, the fused expert weights too), on the
bf16 base and then on int4 and int8 bases (`train --lora --quantize`: the layers quantised as `engine.quantize` loads
them). Part of `.ci/gpu`. Usage: OUT.json [LAYERS]"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from canvas_ls.engine.adapters import add_lora, trainable_parameters
from canvas_ls.engine.architecture import full_width_config, random_model
from canvas_ls.engine.corpus import CorpusFile
from canvas_ls.engine.examples import ExampleSampler, collate
from canvas_ls.engine.plan import training_plan
from canvas_ls.engine.quantize import int4_capable, quantize_model
from canvas_ls.engine.training import TrainConfig, train_step


def main(out: Path, layers: int = 30) -> None:
    device = torch.device("cuda")
    torch.backends.cuda.enable_cudnn_sdp(False)  # as `canvas-ls train` does (pytorch/pytorch#196678)
    tokenizer = AutoTokenizer.from_pretrained("engine/default_model")  # its ids are valid in a 262k vocabulary
    files = [CorpusFile(str(p), "python", "repo", p.read_text()) for p in sorted(Path("engine").glob("*.py"))]
    report = {"layers": layers, "runs": []}
    bases = [("none", False, (1, 4, 8)), ("none", True, (1, 4, 8)), ("int8", False, (1, 4))]
    if int4_capable(device):
        bases.insert(2, ("int4", False, (1, 4)))
    for quantize, experts, batches in bases:
        model = quantize_model(random_model(full_width_config(layers), device, torch.bfloat16), quantize)
        model.train()
        adapted = add_lora(model, rank=16, experts=experts)
        base = adapted.get_base_model()
        optimizer = torch.optim.AdamW([p for p in base.parameters() if p.requires_grad], lr=1e-4)
        for batch_size, prefix in ((batch, 1024) for batch in batches):
            cfg = TrainConfig(batch_size=batch_size, prefix_tokens=prefix, head_tokens=16, gap_choices=(32,),
                              lora_rank=16, lora_experts=experts, quantize=quantize)  # fmt: skip
            sampler = ExampleSampler(files, tokenizer, 0, prefix, 16)
            generator = torch.Generator(device=device).manual_seed(0)
            torch.cuda.reset_peak_memory_stats(device)
            try:
                times = []
                for step in range(4):
                    batch = collate([sampler.example(32) for _ in range(batch_size)], tokenizer.pad_token_id)
                    torch.cuda.synchronize(device)
                    started = time.perf_counter()
                    train_step(base, optimizer, batch.to(device), generator, cfg, self_condition=step % 2 == 1)
                    torch.cuda.synchronize(device)
                    times.append(time.perf_counter() - started)
                planned = training_plan(full_width_config(layers), batch_size, prefix, 32 + 16, 16, experts,
                                        quantize=quantize)  # fmt: skip
                row = {"base": quantize, "experts": experts, "batch": batch_size, "prefix": prefix,
                       "adapter_parameters": trainable_parameters(base), "s_per_step": round(min(times[1:]), 3),
                       "peak_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 1),
                       "planned_gib": round(planned["total_bytes"] / 2**30, 1)}  # `train --plan`'s sum  # fmt: skip
            except Exception as exc:  # out of memory, or a kernel this base lacks: said, and the next base runs
                error = "out of memory" if isinstance(exc, torch.OutOfMemoryError) else f"{type(exc).__name__}: {exc}"
                row = {"base": quantize, "experts": experts, "batch": batch_size, "prefix": prefix,
                       "error": error[:300]}  # fmt: skip
                optimizer.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
            print(row, flush=True)
            report["runs"].append(row)
            out.write_text(json.dumps(report, indent=2))
        del model, adapted, base, optimizer
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 30)
