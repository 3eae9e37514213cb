"""Training: the loop (`train`: optimizer steps over batches cut by `examples.BatchStream`, evaluation on held-out
files, early stopping, a moving average of the weights, checkpoints, export) and `run`, which a `canvas-ls train`
command is (presets, corpus, tokenizer, model, the loop, the export). What one example is, and its losses, are
`examples.py`'s."""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from .commits import EditText, training_edits
from .corpus import CorpusFile
from .examples import Batch, BatchStream, ExampleSampler, collate, losses
from .tokenizer import TokenHealing
from .train_config import PRESETS, TRAINED_INFILL, TrainConfig


def train_step(model: Any, optimizer: torch.optim.Optimizer, batch: Batch, generator: torch.Generator,
               cfg: TrainConfig, self_condition: bool, fused_head: bool = True) -> dict[str, torch.Tensor]:  # fmt: skip
    """One optimizer step on `batch` (what `train` runs and `bench train` times); returns the two losses."""
    with torch.autocast(batch.gap.device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
        parts = losses(model, batch, generator, self_condition, fused_head)
    if not all(bool(torch.isfinite(value)) for value in parts.values()):  # never step (and export) a broken model
        found = ", ".join(f"{name} {float(value)}" for name, value in parts.items())
        raise TrainingError(f"the training loss is not finite ({found}); the weights were left as they were. "
                            f"Other kernels may avoid it: --attention eager, --experts eager, --fp32")  # fmt: skip
    optimizer.zero_grad(set_to_none=True)
    (parts["diffusion"] + cfg.ar_weight * parts["ar"]).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return parts


class TrainingError(Exception):
    """Training cannot go on (said in one line; the CLI prints it as an error)."""


def _snapshot(parameters: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
    return [p.detach().clone() for _, p in parameters]


def _load_into(parameters: list[tuple[str, torch.Tensor]], values: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for (_, parameter), value in zip(parameters, values, strict=True):
            parameter.copy_(value)


class WeightAverage:
    """An exponential moving average of the trained weights (torch's EMA update, `swa_utils`), kept beside them and
    swapped in wherever the run evaluates or exports its model."""

    def __init__(self, parameters: list[tuple[str, torch.Tensor]], decay: float,
                 saved: list[torch.Tensor] | None = None) -> None:  # fmt: skip
        from torch.optim.swa_utils import get_ema_multi_avg_fn

        self.parameters = parameters
        self.values = saved if saved is not None else _snapshot(parameters)
        self._update = get_ema_multi_avg_fn(decay)

    def update(self) -> None:
        self._update(self.values, [p.detach() for _, p in self.parameters], None)

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The average in the model's parameters for the block, the trained weights back after it."""
        trained = _snapshot(self.parameters)
        _load_into(self.parameters, self.values)
        try:
            yield
        finally:
            _load_into(self.parameters, trained)


def lr_at(cfg: TrainConfig, step: int, progress: float) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def evaluate(model: Any, batches: list[Batch], bf16: bool) -> dict[str, float]:
    """Held-out losses at fixed noise, and the share of non-empty middles the model would start with EOS."""
    model.eval()
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(1234)
    totals = {"diffusion": 0.0, "ar": 0.0}
    empty = counted = 0
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        for batch in batches:
            for key, value in losses(model, batch, generator, self_condition=False).items():
                totals[key] += float(value) / len(batches)
            # Fully noised canvas: does the first gap slot come out EOS although the middle is not empty?
            full = _fully_noised_first_slot(model, batch, generator)
            nonempty = batch.gap[:, 0] != model.config.text_config.eos_token_id
            empty += int((full == model.config.text_config.eos_token_id)[nonempty].sum())
            counted += int(nonempty.sum())
    model.train()
    return {**totals, "empty_share": empty / max(counted, 1)}


def _fully_noised_first_slot(model: Any, batch: Batch, generator: torch.Generator) -> torch.Tensor:
    vocab = model.config.text_config.vocab_size
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    model.model.encoder(
        input_ids=batch.prefix,
        attention_mask=batch.prefix_mask.long(),
        position_ids=batch.prefix_positions,
        cache=cache,
        use_cache=True,
    )
    noise = torch.randint(0, vocab, batch.gap.shape, generator=generator, device=batch.gap.device)
    canvas = torch.cat([noise, batch.head], dim=1)
    start = batch.prefix_mask.sum(dim=1, keepdim=True)
    positions = start + torch.arange(canvas.shape[1], device=noise.device)[None, :]
    attention = torch.cat([batch.prefix_mask, torch.ones_like(noise, dtype=torch.bool), batch.head_mask], 1).long()
    logits = model(
        decoder_input_ids=canvas,
        cache=cache,
        decoder_attention_mask=attention,
        decoder_position_ids=positions,
    ).logits
    return logits[:, 0].argmax(dim=-1)


def train(
    model: Any,
    tokenizer: Any,
    train_files: list[CorpusFile],
    eval_files: list[CorpusFile],
    cfg: TrainConfig,
    out_dir: Path,
    progress: Any = None,
    snapshot: Callable[[Path], None] | None = None,
    edits: Sequence[EditText] = (),
) -> dict[str, Any]:
    """Train `model` in place for cfg.minutes (with `edits`, next-edit examples at `cfg.edit_share`); checkpoints
    and a JSON-lines log go to `out_dir`. Resumable.
    `snapshot(folder)` exports the model at each of `cfg.snapshot_minutes` (outside the budget's clock). (~165 lines:
    one loop's set-up, steps, evaluations, checkpoints and stop in the order they happen, sharing the run's state; a
    candidate to split into a run-state object.)"""
    from .loading import resolve_device

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    device = resolve_device(cfg.device)
    # Only a model elsewhere moves: a quantised one's experts hold views of its weights (`use_quantized_experts`),
    # which torch's move of a torchao tensor refuses, and it loaded on its device.
    elsewhere = (p.device for p in model.parameters())
    if any(d.type != device.type or (device.index is not None and d.index != device.index) for d in elsewhere):
        model.to(device)
    if device.type == "cuda":
        # cuDNN's attention backward returns NaN gradients with an explicit mask on H100/H200 (pytorch/pytorch#196678,
        # torch 2.11+); our padded batches always pass one. An H200 run trained NaN from its second step with it.
        torch.backends.cuda.enable_cudnn_sdp(False)
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # LoRA: the adapter's alone
    decay = [p for n, p in trained if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in trained if not (p.ndim >= 2 and "embed" not in n)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    state = {"step": 0, "elapsed": 0.0, "examples": 0}
    checkpoint = out_dir / "checkpoint.pt"
    saved: dict[str, Any] = {}
    if checkpoint.is_file():
        saved = torch.load(checkpoint, weights_only=False, map_location=device)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        state = saved["state"]
    average = WeightAverage(trained, cfg.ema, saved.get("average")) if cfg.ema else None

    def save_checkpoint() -> None:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "state": state,
                    "average": average.values if average is not None else None}, checkpoint)  # fmt: skip

    def evaluated_weights() -> AbstractContextManager[None]:
        """The weights the run evaluates and exports: the average where there is one."""
        return average.swapped_in() if average is not None else nullcontext()

    healing = TokenHealing(tokenizer, model.config.get_text_config().vocab_size) if cfg.token_healing else None
    stream = BatchStream(train_files, tokenizer, cfg.seed + state["step"], cfg, healing, edits)
    batches = stream.batches(cfg.data_workers, pin_memory=device.type == "cuda")
    # Held-out examples, by the prefix of their figures' names: the general mix (random spans, lines, several lines:
    # what every recipe is compared on), and "editor_": the held-out lines cut where the editor asks (what the
    # workspace recipe trains on).
    samplers = {"": ExampleSampler(eval_files, tokenizer, 99, cfg.prefix_tokens, cfg.head_tokens),
                "editor_": ExampleSampler(eval_files, tokenizer, 98, cfg.prefix_tokens, cfg.head_tokens, healing,
                                          editor_share=1.0)}  # fmt: skip
    eval_sets = {
        prefix: [collate([sampler.example(g) for _ in range(cfg.batch_size)], tokenizer.pad_token_id).to(device)
                 for g in cfg.gap_choices for _ in range(2)]
        for prefix, sampler in samplers.items()
    }  # fmt: skip

    def held_out_losses() -> dict[str, float]:
        with evaluated_weights():
            return {prefix + name: value for prefix, batches in eval_sets.items()
                    for name, value in evaluate(model, batches, cfg.bf16).items()}  # fmt: skip

    def evaluated_snapshot() -> list[torch.Tensor]:
        return [v.detach().clone() for v in average.values] if average is not None else _snapshot(trained)

    generator = torch.Generator(device=device).manual_seed(cfg.seed + state["step"])
    rng = random.Random(cfg.seed + state["step"])
    log = (out_dir / "log.jsonl").open("a")
    budget = cfg.minutes * 60
    before = held_out_losses() if state["step"] == 0 else None  # the held-out start
    started = time.perf_counter() - state["elapsed"]  # the budget is training time: it starts after that evaluation
    last_checkpoint = time.perf_counter()
    # Early stopping: the weights of the best held-out diffusion loss so far, and evaluations since it was set
    best = (before["diffusion"], evaluated_snapshot()) if before is not None and cfg.patience else None
    worse = 0
    model.train()
    record: dict[str, Any] = {}
    data_seconds = 0.0
    stopped = "budget"
    snapshots = sorted(m for m in cfg.snapshot_minutes if m * 60 > state["elapsed"] and m < cfg.minutes)
    try:
        while (elapsed := time.perf_counter() - started) < budget:
            if cfg.max_steps is not None and state["step"] >= cfg.max_steps:
                stopped = "steps"
                break
            step = state["step"]
            lr = lr_at(cfg, step, elapsed / budget)
            for group in optimizer.param_groups:
                group["lr"] = lr
            waited = time.perf_counter()
            batch = next(batches).to(device)
            data_seconds += time.perf_counter() - waited
            parts = train_step(model, optimizer, batch, generator, cfg, rng.random() < cfg.self_condition_prob)
            if average is not None:
                average.update()
            state["step"] += 1
            state["examples"] += cfg.batch_size
            state["elapsed"] = time.perf_counter() - started
            if progress is not None:
                progress(state, parts["diffusion"].item(), parts["ar"].item(), budget)
            if state["step"] % cfg.log_every == 0:
                record = {
                    "step": state["step"],
                    "minutes": round(state["elapsed"] / 60, 2),
                    "lr": round(lr, 6),
                    "diffusion": round(parts["diffusion"].item(), 4),
                    "ar": round(parts["ar"].item(), 4),
                    # time the steps waited for their batches (a GPU run starved by its batch workers shows it)
                    "data_s_per_step": round(data_seconds / cfg.log_every, 4),
                }
                data_seconds = 0.0
                if state["step"] % cfg.eval_every == 0:
                    held_out = held_out_losses()
                    record.update({f"eval_{k}": round(v, 4) for k, v in held_out.items()})
                    if best is not None:
                        if held_out["diffusion"] < best[0]:
                            best, worse = (held_out["diffusion"], evaluated_snapshot()), 0
                        else:
                            worse += 1
                log.write(json.dumps(record) + "\n")
                log.flush()
                if best is not None and worse >= cfg.patience:
                    stopped = "early"
                    break
            if snapshot is not None and snapshots and state["elapsed"] >= snapshots[0] * 60:
                paused = time.perf_counter()
                minutes = snapshots.pop(0)
                held_out = held_out_losses()
                with evaluated_weights():
                    snapshot(out_dir / "snapshots" / f"{minutes:g}")
                log.write(json.dumps({"snapshot": minutes, "step": state["step"],
                                      **{f"eval_{k}": round(v, 4) for k, v in held_out.items()}}) + "\n")  # fmt: skip
                log.flush()
                started += time.perf_counter() - paused  # the snapshot's time is not training time
            if time.perf_counter() - last_checkpoint > cfg.checkpoint_minutes * 60:
                save_checkpoint()
                last_checkpoint = time.perf_counter()
    except KeyboardInterrupt:  # Ctrl-C: what was learnt so far is evaluated, saved and exported
        stopped = "interrupted"
    final = held_out_losses()
    save_checkpoint()  # the training as it stands (trained weights, optimizer, average): what a longer run resumes
    if average is not None:  # from here on the model holds the average: what is evaluated and exported
        _load_into(trained, average.values)
        average = None
    if best is not None and best[0] < final["diffusion"]:  # the best held-out weights, not the last
        _load_into(trained, best[1])
        final = held_out_losses()
    summary = {**state, **{f"eval_{k}": v for k, v in final.items()}, "stopped": stopped, "config": asdict(cfg)}
    if before is not None:
        summary.update({f"eval_before_{k}": v for k, v in before.items()})
    log.write(json.dumps({"final": summary}) + "\n")
    log.close()
    return summary


# -- the whole pipeline: corpus -> tokenizer -> model -> train -> export ----------------------------------------


def as_run(cfg: TrainConfig) -> TrainConfig:
    """`cfg` as `run` trains it: fp32 where bf16 is emulated (a `train --corpus` step ~40 s under bf16 autocast, ~1.7 s
    in fp32 on a 2-core AVX2 EPYC, 2026-12-05; bf16's 2.4x is an AVX-512 BF16 / AMX CPU's or a GPU's)."""
    from .loading import cpu_has_native_bf16, resolve_device

    if cfg.bf16 and resolve_device(cfg.device).type == "cpu" and not cpu_has_native_bf16():
        return replace(cfg, bf16=False)
    return cfg


def run_plan(cfg: TrainConfig, start_from: str | None, preset: str, vocab_size: int) -> dict[str, Any]:
    """`engine.plan.training_plan` for this run's model and settings."""
    from .plan import model_config, training_plan

    gap = max(cfg.gap_choices)
    canvas = gap + cfg.head_tokens + (gap if cfg.multi_gap_share > 0 else 0)  # several gaps: up to twice the slots
    return training_plan(model_config(start_from, preset, vocab_size), cfg.batch_size, cfg.prefix_tokens, canvas,
                         cfg.lora_rank, cfg.lora_experts, cfg.bf16, cfg.ema > 0, cfg.quantize)  # fmt: skip


def preset_model(preset: str, vocab_size: int) -> Any:
    """A freshly initialised model of the preset's size."""
    from transformers import DiffusionGemmaForBlockDiffusion

    from .architecture import small_config

    return DiffusionGemmaForBlockDiffusion(small_config(vocab_size, sliding_window=512, **PRESETS[preset]["model"]))


def run(
    preset: str,
    out_dir: Path,
    minutes: float | None = None,
    eval_dir: Path | None = None,
    install: Path | None = None,
    progress: Any = None,
    start_from: str | None = None,
    overrides: dict[str, Any] | None = None,
    repository: Path | None = None,
    held_out: float = 0.2,
    replay: float = 0.0,
    export_merged: bool = True,
) -> dict[str, Any]:
    """Build (or reuse) the corpus and tokenizer under out_dir, train (resuming), export to out_dir/model. With
    `start_from`, continue an existing model folder: its tokenizer and weights (in fp32) instead of new ones. With
    `repository`, train on that folder's own source (`corpus.collect_repository`): a `held_out` share of its whole
    files is evaluated before and after, and general-corpus files make up `replay` of the training bytes. A LoRA run
    exports out_dir/adapter, and out_dir/model with the adapter merged unless `export_merged` is False (a big base:
    the adapter is megabytes, the merged copy the whole model). (~170 lines: a `canvas-ls train` command's stages in
    order: corpus, tokenizer, model, adapter, loop, export; a candidate to split by stage.)"""
    from transformers import AutoTokenizer

    from . import corpus, plan
    from .loading import quiet_libraries, resolve_device
    from .settings import MODEL_SETTINGS_FILE
    from .tokenizer import train_tokenizer

    quiet_libraries()
    spec = PRESETS[preset]
    cfg = as_run(TrainConfig(**{**spec["train"], **({"minutes": minutes} if minutes is not None else {}),
                                **(overrides or {})}))  # fmt: skip
    from .quantize import WEIGHT_BYTES

    if cfg.quantize not in WEIGHT_BYTES:  # none, int8, int4 (`auto` is the engine's, by free memory)
        raise TrainingError(f"unknown base quantisation '{cfg.quantize}' (use none, int8 or int4)")
    quantized = cfg.quantize != "none"
    if quantized and not (start_from and cfg.lora_rank and not cfg.lora_experts):
        raise TrainingError("a quantised base (--quantize) trains a LoRA adapter (--lora RANK, without "
                            "--lora-experts) of a model given with --from")  # fmt: skip
    out_dir.mkdir(parents=True, exist_ok=True)
    corpus_path = out_dir / "corpus.jsonl.gz"

    def general_corpus() -> list[corpus.CorpusFile]:
        if not corpus_path.is_file():
            files = corpus.collect(spec["corpus_bytes"], exclude=[eval_dir] if eval_dir else [])
            corpus.save(files, corpus_path)
            report = {"corpus": corpus.summary(files)}
            if eval_dir is not None:
                report["decontamination"] = corpus.decontamination_report(files, sorted(eval_dir.glob("*.jsonl.gz")))
            (out_dir / "corpus_report.json").write_text(json.dumps(report, indent=2))
        return corpus.load(corpus_path)

    report: dict[str, Any] = {}
    edits: list[EditText] = []
    mined: dict[str, Any] | None = None
    if repository is not None and cfg.edits_held_out is not None:  # before the corpus: it may be an older tree
        try:
            edits, mined = training_edits(repository, cfg.edits_held_out, out_dir / "tree")
        except ValueError as exc:
            raise TrainingError(f"--edits: {exc}") from exc
    if repository is None:
        files = general_corpus()
        eval_files, train_files = files[: corpus.HELD_OUT_FILES], files[corpus.HELD_OUT_FILES :]
    else:  # the user's code: whole files held out, the general corpus replayed at `replay` of the bytes
        try:
            # with held-out commits, the files as they were before them (never the held-out commits' results)
            files, report = corpus.collect_repository(out_dir / "tree" if mined and mined["tree_at"] else repository)
        except ValueError as exc:
            raise TrainingError(str(exc)) from exc
        if len(files) < 2:
            raise TrainingError(f"'{repository}' holds {len(files)} usable source files; training needs at least 2 "
                                f"(left out: {report['skipped']})")  # fmt: skip
        eval_files, train_files = corpus.split_repository(files, held_out)
        replayed: list[corpus.CorpusFile] = []
        if replay > 0:
            want, taken = sum(len(f.text) for f in train_files) * replay / (1 - replay), 0
            for file in corpus.replay_files()[corpus.HELD_OUT_FILES :]:
                if taken >= want:
                    break
                replayed.append(file)
                taken += len(file.text)
        own_files, train_files = train_files, train_files + replayed
        report.update(held_out_files=[f.path for f in eval_files], replayed_files=len(replayed),
                      replayed_bytes=sum(len(f.text) for f in replayed))  # fmt: skip

    tokenizer_dir = out_dir / "tokenizer"
    if start_from:  # the model's own tokenizer: its ids are what the model learned
        tokenizer = AutoTokenizer.from_pretrained(start_from)
    else:
        if not (tokenizer_dir / "tokenizer.json").is_file():
            sample, size = [], 0
            for file in train_files:
                if size > 30_000_000:
                    break
                sample.append(file.text)
                size += len(file.text)
            train_tokenizer(sample, spec["vocab_size"], tokenizer_dir)
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    if repository is not None:  # what the model learns the repository from, in its own tokens
        own = tokenizer([f.text for f in own_files], add_special_tokens=False)["input_ids"]
        report["train_tokens"] = sum(len(ids) for ids in own)
        if mined is not None:
            report["edits"] = mined
        (out_dir / "repository_report.json").write_text(json.dumps(report, indent=2))

    problem = plan.check(run_plan(cfg, start_from, preset, len(tokenizer)), resolve_device(cfg.device))
    if problem is not None:  # refused before any weight is loaded
        raise TrainingError(problem)
    torch.manual_seed(0)
    if start_from:
        from transformers import DiffusionGemmaForBlockDiffusion

        # LoRA keeps the frozen base in bf16 (under bf16 autocast): half the memory of fp32 master weights
        base_dtype = torch.bfloat16 if cfg.lora_rank and cfg.bf16 else torch.float32
        loading: dict[str, Any] = {"dtype": base_dtype}
        if quantized:  # int8 / int4 while the checkpoint loads, on the device (int4's packing runs on the GPU)
            from . import quantize

            device = resolve_device(cfg.device)
            loading["quantization_config"] = quantize.torchao_config(quantize.check_runs_here(cfg.quantize, device))
            if device.type == "cuda":
                loading["device_map"] = {"": device.index or 0}
        model = DiffusionGemmaForBlockDiffusion.from_pretrained(start_from, **loading)
        if quantized:
            quantize.use_quantized_experts(model)
    else:
        model = preset_model(preset, len(tokenizer))
    model.set_attn_implementation(cfg.attention)
    if cfg.experts is not None and not quantized:
        model.set_experts_implementation(cfg.experts)
    adapted = None
    if cfg.lora_rank:
        from .adapters import add_lora

        adapted = add_lora(model, cfg.lora_rank, cfg.lora_experts)
        for parameter in adapted.parameters():
            if parameter.requires_grad:  # the adapter trains in fp32 whatever the base's dtype
                parameter.data = parameter.data.float()
        model = adapted.get_base_model()  # the same model class, its targeted layers now LoRA layers

    def save_model(folder: Path, trained: dict[str, Any], copy: bool = False) -> None:
        if copy:  # mid-run: a bf16 copy of the weights; the model keeps training in fp32
            weights = {k: v.detach().to("cpu", torch.bfloat16) for k, v in model.state_dict().items()}
            model.save_pretrained(str(folder), state_dict=weights)
        else:
            model.to("cpu", torch.bfloat16).save_pretrained(str(folder))
        tokenizer.save_pretrained(str(folder))
        record: dict[str, Any] = {"infill": TRAINED_INFILL, "trained": trained}
        if start_from and (Path(start_from) / MODEL_SETTINGS_FILE).is_file():
            before = json.loads((Path(start_from) / MODEL_SETTINGS_FILE).read_text())
            record["trained_before"] = before.get("trained")  # what it had seen before this run
            if "display" in before:  # the base's display threshold, until `bench calibrate` measures this model's
                record["display"] = {**before["display"], "inherited_from": str(start_from)}
        (folder / MODEL_SETTINGS_FILE).write_text(json.dumps(record, indent=2))

    def snapshot(folder: Path) -> None:  # mid-run: the adapter alone (merging would end the LoRA), or the model
        if adapted is not None:
            from .adapters import save_adapter

            save_adapter(adapted, folder / "adapter")
        else:
            save_model(folder / "model", {"snapshot_of": str(out_dir)}, copy=True)

    summary = train(model, tokenizer, train_files, eval_files, cfg, out_dir, progress, snapshot, edits)
    if report:
        summary["repository"] = {k: v for k, v in report.items() if k not in ("held_out_files", "top_sources")}

    export = out_dir / "model"
    if adapted is not None:  # the adapter alone (for `--adapter`), and the model with it merged
        from .adapters import merged, save_adapter

        save_adapter(adapted, out_dir / "adapter")
        if not export_merged or quantized:  # a merge would write float deltas into int8 / int4 weights
            return summary
        model = merged(adapted)
    save_model(export, summary)
    if install is not None:
        import shutil

        shutil.rmtree(install, ignore_errors=True)
        shutil.copytree(export, install)
    return summary
