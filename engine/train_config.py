"""What a training run is asked to do: `TrainConfig` (a run's settings) and the `PRESETS` (the model sizes and budgets
we train and ship). Apart from the loop (`training.py`) so that the examples (`examples.py`) and the memory plan
(`plan.py`) read them without importing the loop that imports them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class TrainConfig:
    minutes: float = 150.0  # wall-clock budget; the learning-rate schedule follows elapsed time
    max_steps: int | None = None  # and a step budget, whichever ends first (tests: work that no machine's speed moves)
    batch_size: int = 16
    prefix_tokens: int = 192  # encoder context per example (BOS included)
    head_tokens: int = 16  # clamped suffix head
    gap_choices: tuple[int, ...] = (16, 32)  # gap slots, drawn per batch
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    ar_weight: float = 0.5  # next-token loss on the encoder, relative to the diffusion loss
    self_condition_prob: float = 0.5
    # Shares of the examples with several gaps in one canvas, and of rewrites (a corrupted middle shown).
    multi_gap_share: float = 0.25
    rewrite_share: float = 0.1
    # Share of the single-gap examples cut where an editor asks (the cursor after a line's indentation, the middle
    # its code to the end of the line or of a few lines): the workspace recipe's task-matched mix (bench repo)
    editor_share: float = 0.0
    # Next edits from the repository's git history (`engine/commits.py`): off (None), or the newest commits held out
    # (`bench edits` replays them) and the older ones' hunks learnt as rewrites at `edit_share` of the examples.
    edits_held_out: int | None = None
    edit_share: float = 0.2
    token_healing: bool = True  # prefixes cut where token healing cuts them (held-out examples stay as they were)
    bf16: bool = True  # autocast (2.4x an fp32 matmul on an AVX-512 BF16 CPU; `run` takes fp32 where bf16 is emulated)
    attention: str = "sdpa"  # transformers' attention kernel: "sdpa", "eager"
    experts: str | None = None  # its MoE experts' (None: its choice; "grouped_mm", "batched_mm", "eager")
    # LoRA (peft) instead of training every weight: the adapter's rank (0: full training), and whether it also
    # adapts the fused MoE expert weights
    lora_rank: int = 0
    lora_experts: bool = False
    # A LoRA run's frozen base quantised ("int8", "int4": `engine.quantize`), so that DiffusionGemma's LoRA fits a
    # 24 or 48 GB card; "none": the base in bf16 (fp32 with --fp32)
    quantize: str = "none"
    patience: int = 0  # stop after this many evaluations without a better held-out loss, keep the best (0: never)
    # Decay of an exponential moving average of the trained weights, started from the weights the run starts from
    # (0: none). With it the held-out evaluations, early stopping, snapshots and the exported model use the average,
    # which leans towards the base early in a run and smooths the last steps' noise later on.
    ema: float = 0.0
    device: str = "auto"  # "auto": CUDA when there is a GPU, else the CPU
    threads: int = 0  # 0: torch's default
    data_workers: int = 0  # processes cutting batches ahead of the steps (0: in the training loop)
    seed: int = 0
    checkpoint_minutes: float = 10.0
    # Training minutes at which the model (a LoRA run: its adapter) is also exported to snapshots/<minutes>, with a
    # held-out evaluation in the log; the time they take is not counted in the budget (`bench repo`'s curves)
    snapshot_minutes: tuple[float, ...] = ()
    eval_every: int = 100
    log_every: int = 10


# Model sizes per preset, measured on the project's 2-core CPU: h256/4 layers (7.9M parameters, 8k vocabulary) ran a
# 16-example step in ~1.7 s with bf16 autocast (0.94 s with the fused head loss); h320/5 layers (13.7M) ~2.8 s: a model
# too big for the token budget learns less. The GPU preset's (11.6M, 22 MiB in bf16) still ships and answers a 1k-token
# prefix within ~100 ms on 2 cores (1.25x the CPU preset's encode + 5 steps).
PRESETS: dict[str, dict[str, Any]] = {
    "cpu": {
        "model": dict(
            hidden_size=256, num_layers=4, num_heads=4, head_dim=64, moe_intermediate_size=256, intermediate_size=512
        ),
        "train": dict(minutes=150.0, batch_size=16),
        "vocab_size": 8192,
        "corpus_bytes": 120_000_000,
    },
    "gpu": {
        "model": dict(
            hidden_size=320, num_layers=4, num_heads=5, head_dim=64, moe_intermediate_size=320, intermediate_size=640
        ),
        "train": dict(minutes=8.0, batch_size=128, data_workers=12),
        "vocab_size": 8192,
        "corpus_bytes": 400_000_000,
    },
}
# Vocabulary, on 300 held-out Python files (bytes per token): 4k 3.23, 8k 3.52, 16k 3.71: 16k saves 5% of tokens but
# doubles the LM-head matmul, a third of this model's compute. TRAINED_INFILL: the engine's settings for the model.
TRAINED_INFILL = {"layout": "canvas", "gap_tokens": 16, "suffix_head_tokens": 16, "max_steps": 8}
