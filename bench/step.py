"""`canvas-ls bench step`: where a denoising step's time goes, and how close it runs to the machine's limit.

For a model (the default one, a model folder, or DiffusionGemma 26B-A4B's published geometry with random weights)
it measures, in one run:
  - the machine's matmul peak (a square matmul in the model's dtype; for int8-dynamic weights fbgemm's int8 rate
    too), so that a step's rate reads as a share of it;
  - per-encode time of a prefix (the causal encoder into a fresh KV cache);
  - per-step time, 1 and 8 rows, at each canvas size: the decoder forward as the resident engine calls it (the
    prefix KV read through `BatchedKV`, self-conditioning logits in, an int8-dynamic model's sparse soft embeddings
    instead) and the step statistics after it
    (`step_stats_rows`, the sampler's vocabulary-sized work), eager and compiled (`torch.compile`; CUDA graphs on a
    GPU), with the compiled logits compared to the eager ones;
  - FLOPs per step counted by torch's FlopCounterMode (not estimated; a CPU's int8-dynamic projections counted by
    their shapes, which it skips), hence GFLOP/s, the arithmetic's floor (its int8 share at the measured int8 rate,
    the rest at the float matmul peak) beside the memory-bandwidth floor, and the share of the peak;
  - the engine's own step (`DenoisingBatch.step` on real jobs, 1 and 8 rows): ms per step and the bytes it
    allocates per step, in the decoder forward (its logits among them) and beyond it; `--vocab V` builds the
    shipped architecture at DiffusionGemma's vocabulary (262,144) and hidden size, where those bytes matter;
  - a torch.profiler table of one eager configuration: the ops a step spends its time in;
  - with `--quantize int8|int4` the same on quantised weights (`engine.quantize`; compiled only where the experts run
    the GPU kernel), and the bytes the weights hold (for DiffusionGemma: which card it fits).
Figures, never pass/fail; the JSON holds every number the table prints.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers.cache_utils import DynamicCache

from ..engine.architecture import full_width_config, random_model
from ..engine.canvas import BatchedKV
from ..engine.compiled import compile_model
from ..engine.conditioning import SparseSelfConditioning
from ..engine.elementwise import eager_logits
from ..engine.encoding import encode
from ..engine.quantize import is_cpu_int8
from ..engine.sampling import step_stats_rows
from .core import synchronize, timed


def memory_bandwidth(device: torch.device) -> dict[str, Any]:
    """GB/s of a large copy (read + write, 256 MiB each way): the rate a step's weight reads are measured against."""
    source = torch.ones(64 << 20, device=device)  # 256 MiB of float32, far past any cache
    target = torch.empty_like(source)
    ms = timed(lambda: target.copy_(source), device, runs=5)
    return {"bytes": 2 * source.nbytes, "ms": round(ms, 3), "gb_per_s": round(2 * source.nbytes / (ms / 1000) / 1e9, 2)}


def int8_peak() -> dict[str, Any]:
    """GOP/s of the CPU's int8-dynamic projection (`quantize.PackedLinear`, fbgemm) at 1024 rows of 4096 x 4096: the
    rate an int8-dynamic step's projections are measured against."""
    from ..engine.quantize import pack_linear

    size = 1024
    packed = pack_linear(torch.nn.Linear(size * 4, size * 4))
    rows = torch.randn(size, size * 4)
    ms = timed(lambda: packed(rows), torch.device("cpu"), runs=3)
    return {"rows": size, "size": size * 4, "ms": round(ms, 3),
            "tops": round(2 * size * (size * 4) ** 2 / (ms / 1000) / 1e12, 3)}  # fmt: skip


def matmul_peak(device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """TFLOP/s of a square matmul in `dtype`: the rate a step's arithmetic is measured against."""
    size = 8192 if device.type == "cuda" else 1024
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    ms = timed(lambda: a @ b, device, runs=10 if device.type == "cuda" else 5)
    return {"size": size, "dtype": str(dtype).removeprefix("torch."), "ms": round(ms, 3),
            "tflops": round(2 * size**3 / (ms / 1000) / 1e12, 3)}  # fmt: skip


class StepCase:
    """The inputs of one decoder forward as the resident engine builds them: `rows` copies of a prefix's KV (one
    encode), a canvas of `canvas` slots per row, last step's logits for self-conditioning."""

    def __init__(self, model: Any, prefix: torch.Tensor, canvas: int, rows: int):
        device = prefix.device
        vocab = model.config.text_config.vocab_size
        self.cache = DynamicCache(config=model.config.get_text_config(decoder=True))
        encode(model, prefix, self.cache, start=0)
        kv = BatchedKV([self.cache] * rows, list(model.config.text_config.layer_types))
        generator = torch.Generator(device=device).manual_seed(0)
        start = prefix.shape[1]
        self.rows, self.canvas = rows, canvas
        self.generators = [torch.Generator(device=device).manual_seed(r) for r in range(rows)]
        embed_dtype = model.get_input_embeddings().weight.dtype
        last = torch.randn(rows, canvas, vocab, generator=generator, device=device).to(embed_dtype)
        # A CPU's int8-dynamic model conditions on soft embeddings, computed sparsely when a step ends and handed
        # to the decoder by a hook, as the engine does (`conditioning.SparseSelfConditioning`): no logits go in
        self.sparse = SparseSelfConditioning(model) if is_cpu_int8(model) else None
        if self.sparse is not None:
            self.sparse.fit(rows, canvas)
            for row in range(rows):
                self.sparse.write(row, last[row], 1.0)
        self.kwargs = dict(
            decoder_input_ids=torch.randint(3, vocab, (rows, canvas), generator=generator, device=device),
            cache=kv,
            self_conditioning_logits=last if self.sparse is None else None,
            self_conditioning_mask=torch.ones(rows, dtype=torch.bool, device=device) if self.sparse is None else None,
            decoder_attention_mask=kv.masks([canvas] * rows, canvas),
            decoder_position_ids=start + torch.arange(canvas, device=device)[None, :].expand(rows, -1),
        )

    def forward(self, runner: Callable[[dict[str, Any]], torch.Tensor]) -> torch.Tensor:
        if self.sparse is not None:
            self.sparse.feed(self.rows, self.canvas)
        return runner(self.kwargs)

    def statistics(self, logits: torch.Tensor) -> None:
        step_stats_rows(logits, [1.0] * self.rows, self.generators, [self.canvas] * self.rows)


class _Forward:
    """The batch's decoder forward, marked for the profiler (its allocations told apart from the step's own); on a
    GPU it counts the bytes it allocates itself (`allocated`)."""

    static_inputs = False

    def __init__(self, model: Any):
        self.model = model
        self.allocated = 0

    def __call__(self, **inputs: Any) -> torch.Tensor:
        device = next(self.model.parameters()).device
        before = _allocated(device)
        with torch.profiler.record_function(FORWARD):
            logits = eager_logits(self.model, inputs)  # the engine's eager forward
        self.allocated += _allocated(device) - before
        return logits


def _allocated(device: torch.device) -> int:
    """Bytes the CUDA allocator has handed out so far (0 on the CPU: the profiler counts there)."""
    return torch.cuda.memory_stats(device)["allocated_bytes.all.allocated"] if device.type == "cuda" else 0


FORWARD = "canvas-ls: decoder forward"


def engine_step(model: Any, prefix_tokens: int, rows: int, gap: int = 16, suffix: int = 16, steps: int = 6,
                runs: int = 10) -> dict[str, Any]:  # fmt: skip
    """The resident engine's step as it runs (`DenoisingBatch.step`: inputs, the decoder forward with
    self-conditioning, sampling, the next step's self-conditioning): `rows` jobs of a `gap`-slot gap and a
    `suffix`-token suffix head on one `prefix_tokens` prefix, kept from converging. Median ms per step, and the bytes
    it allocates per step: in the decoder forward, its returned logits, and the step's own beyond both (the
    profiler's memory events on the CPU, the allocator's counters on a GPU)."""
    from ..engine.canvas import CanvasJob, DenoiseParams, DenoisingBatch
    from ..engine.settings import InfillSettings

    device = next(model.parameters()).device
    vocab = model.config.text_config.vocab_size
    generator = torch.Generator().manual_seed(2)
    prefix = torch.randint(3, vocab, (prefix_tokens,), generator=generator).tolist()
    head = torch.randint(3, vocab, (suffix,), generator=generator).tolist()
    settings = InfillSettings(gap_tokens=gap, max_new_tokens=gap, max_steps=10_000, confidence_threshold=0.0)
    batch = DenoisingBatch(model, pad_id=0, decoder=_Forward(model))  # type: ignore[arg-type]
    for _ in range(rows):
        batch.add(CanvasJob(model, prefix, head, DenoiseParams(settings, max_new_tokens=gap), stop_ids=[1, 0]))
    for _ in range(2):  # past each job's first step: every row conditioned from now on
        batch.step()
    milliseconds = timed(batch.step, device, runs, warmup=0)
    forward, total = _allocations(batch, device, steps)
    logits = rows * (gap + suffix) * vocab * 4  # float32 (softcapped)
    assert len(batch) == rows, "a job converged: the figures would mix batch sizes"
    return {"rows": rows, "canvas": gap + suffix, "vocab": vocab, "step_ms": round(milliseconds, 3),
            "bytes_per_step": {"total": total, "forward": forward, "logits": logits,
                               "step_own": total - forward}}  # fmt: skip


def _allocations(batch: Any, device: torch.device, steps: int) -> tuple[int, int]:
    """Bytes allocated per `batch.step()` (mean of `steps`): inside the decoder forward, and in all."""
    if device.type == "cuda":
        forward = batch.decoder
        forward.allocated, before = 0, _allocated(device)
        for _ in range(steps):
            batch.step()
        return forward.allocated // steps, (_allocated(device) - before) // steps
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(steps):
            batch.step()
    inside = total = 0
    for event in prof.events():
        allocated = event.self_cpu_memory_usage
        if allocated <= 0:
            continue
        total += allocated
        parent = event.cpu_parent
        while parent is not None and parent.name != FORWARD:
            parent = parent.cpu_parent
        inside += allocated if parent is not None else 0
    return inside // steps, total // steps


def vocab_model(vocab: int, layers: int, device: torch.device, dtype: torch.dtype) -> Any:
    """The shipped model's architecture at DiffusionGemma's vocabulary and hidden size (`vocab`, 2816), `layers`
    deep, random weights: what the step's vocabulary-sized work costs, without DiffusionGemma's 30 layers."""
    from ..engine.architecture import FULL_WIDTH, small_config

    return random_model(small_config(vocab, hidden_size=FULL_WIDTH["hidden_size"], num_layers=layers), device, dtype)


def flops_of(fn: Callable[[], Any]) -> dict[str, int] | None:
    """FLOPs of one call as torch's FlopCounterMode counts them, the CPU's int8-dynamic projections among them
    (`quantized::linear_dynamic`, which it does not count itself): {"total": ..., "int8": those projections' share};
    None where it cannot (its attention formula refused this shape on CUDA)."""
    from torch.utils.flop_counter import FlopCounterMode

    try:  # `quantize.cpu_int8`'s layers (fbgemm); a torch without the quantised CPU kernels has none to count
        int8_ops = (torch.ops.quantized.linear_dynamic, torch.ops.quantized.linear_dynamic.default)
    except (AttributeError, RuntimeError):
        int8_ops = ()
    counter = FlopCounterMode(display=False, custom_mapping={int8_ops[0]: _int8_linear_flops} if int8_ops else None)
    try:
        with counter:
            fn()
    except AssertionError:
        return None
    counts = counter.get_flop_counts()["Global"]
    int8 = sum(count for op, count in counts.items() if op in int8_ops)
    return {"total": int(counter.get_total_flops()), "int8": int(int8)}


def _int8_linear_flops(x_shape: torch.Size, *_: Any, out_shape: torch.Size, **__: Any) -> int:
    """A multiply and an add per weight per row: rows x in x out x 2."""
    return 2 * math.prod(x_shape) * out_shape[-1]


def _gflop(flops: dict[str, int] | None, part: str = "total") -> float | None:
    return None if flops is None else round(flops[part] / 1e9, 3)


def profile_table(fn: Callable[[], Any], device: torch.device, top: int = 12) -> list[dict[str, Any]]:
    """The ops one call spends its time in (self time, summed over 5 calls), largest first."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    fn()
    with profile(activities=activities) as prof:
        for _ in range(5):
            fn()
        synchronize(device)
    cuda = device.type == "cuda"
    events = [e for e in prof.key_averages() if (e.self_device_time_total if cuda else e.self_cpu_time_total) > 0]
    events.sort(key=lambda e: e.self_device_time_total if cuda else e.self_cpu_time_total, reverse=True)
    total = sum(e.self_device_time_total if cuda else e.self_cpu_time_total for e in events) or 1
    rows = []
    for event in events[:top]:
        self_us = event.self_device_time_total if cuda else event.self_cpu_time_total
        rows.append({"op": event.key, "calls_per_step": event.count // 5, "self_ms_per_step": round(self_us / 5000, 3),
                     "share": round(self_us / total, 3)})  # fmt: skip
    return rows


@torch.inference_mode()
def run_step_bench(
    model: Any,
    name: str,
    prefix_tokens: int,
    canvases: tuple[int, ...] = (64, 256),
    rows: tuple[int, ...] = (1, 8),
    compile_canvases: tuple[int, ...] = (64, 256),
    runs: int = 10,
    progress: Callable[[str], None] = lambda _: None,
    checkpoint: Callable[[dict[str, Any]], None] = lambda _: None,
) -> dict[str, Any]:
    """The figures of the module docstring for `model` (already on its device, in its dtype); `checkpoint` gets the
    report after each figure (a caller's time limit can stop a compilation)."""
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    vocab = model.config.text_config.vocab_size
    from ..engine.quantize import held_bytes, is_quantized

    report: dict[str, Any] = {
        "model": name,
        "weights_bytes": held_bytes(model),
        "weights_gib": round(held_bytes(model) / 2**30, 3),
        "quantized": is_quantized(model),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "parameters": sum(p.numel() for p in model.parameters()),
        "prefix_tokens": prefix_tokens,
        "peak": matmul_peak(device, dtype),
        "int8_peak": int8_peak() if is_cpu_int8(model) else None,
        "bandwidth": memory_bandwidth(device),
        "step_weight_bytes": step_weight_bytes(model),
        "cases": [],
    }
    prefix = torch.randint(3, vocab, (1, prefix_tokens), generator=torch.Generator().manual_seed(1)).to(device)

    def one_encode() -> None:
        encode(model, prefix, DynamicCache(config=model.config.get_text_config(decoder=True)), start=0)

    report["encode_ms"] = round(timed(one_encode, device, runs=max(3, runs // 2)), 3)
    report["encode_gflop"] = _gflop(flops_of(one_encode))
    progress(f"{name}: encode {report['encode_ms']} ms")
    compiled = compile_model(model, device, dynamic=False) if compile_canvases else None
    cases = {(canvas, count): StepCase(model, prefix, canvas, count) for canvas in canvases for count in rows}

    def eager(inputs: dict[str, Any]) -> torch.Tensor:  # the engine's eager forward
        return eager_logits(model, inputs)

    eager_answers: dict[tuple[int, int], torch.Tensor] = {}
    for (canvas, count), case in cases.items():
        flops = flops_of(lambda case=case: case.forward(eager))
        report["cases"].append({"canvas": canvas, "rows": count, "gflop": _gflop(flops),
                                "int8_gflop": _gflop(flops, "int8"),
                                "arithmetic_floor_ms": arithmetic_floor_ms(report, flops)})  # fmt: skip
    # Every eager figure first: a compilation that overruns the caller's time limit leaves them measured.
    passes = [("eager", eager, list(cases))]
    if compiled is not None:
        passes.append(("compiled", lambda inputs: compiled(**inputs).logits,
                       [key for key in cases if key[0] in compile_canvases]))  # fmt: skip
    for label, runner, keys in passes:
        for key in keys:
            case, row = cases[key], report["cases"][list(cases).index(key)]
            try:
                started = time.perf_counter()
                case.forward(runner)  # a compiled model compiles on its first call at a shape
                synchronize(device)
                first = time.perf_counter() - started
                forward_ms = timed(lambda case=case, runner=runner: case.forward(runner), device, runs)
                logits = case.forward(runner).clone()
                step_ms = timed(lambda case=case, runner=runner: case.statistics(case.forward(runner)), device, runs)
            except Exception as exc:  # a model or backend the compiler cannot take: said, and eager stands
                row[label] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                progress(f"{name}: canvas {key[0]} x{key[1]} {label} failed: {row[label]['error']}")
                continue
            row[label] = {"first_call_s": round(first, 3), "forward_ms": round(forward_ms, 3),
                          "step_ms": round(step_ms, 3)}  # fmt: skip
            if row["gflop"] is not None:  # the share of the peak: the arithmetic's floor over the time it took
                row[label].update(gflops=round(row["gflop"] / (forward_ms / 1000), 1),
                                  share_of_peak=round(row["arithmetic_floor_ms"] / forward_ms, 4))  # fmt: skip
            if label == "eager":
                eager_answers[key] = logits
            else:
                row[label]["max_abs_diff_vs_eager"] = float((logits.float() - eager_answers[key].float()).abs().max())
            progress(f"{name}: canvas {key[0]} x{key[1]} {label}: forward {forward_ms:.2f} ms, step {step_ms:.2f} ms")
            checkpoint(report)
    report["floor_ms"] = round(report["step_weight_bytes"] / (report["bandwidth"]["gb_per_s"] * 1e9) * 1000, 3)
    report["engine_steps"] = []
    for count in rows:
        report["engine_steps"].append(engine_step(model, prefix_tokens, count, runs=runs))
        progress(f"{name}: engine step x{count}: {report['engine_steps'][-1]['step_ms']} ms")
        checkpoint(report)
    first = StepCase(model, prefix, canvases[0], 1)
    ops = profile_table(lambda: first.statistics(first.forward(eager)), device)
    report["profile"] = {"canvas": canvases[0], "rows": 1, "ops": ops}
    return report


def step_weight_bytes(model: Any) -> int:
    """What a step must read at least once: every weight of the text model (the decoder's layers, a CPU's
    int8-dynamic ones as packed, and the embedding, which dense self-conditioning multiplies whole and the tied LM
    head reads again); not the vision tower. An int8-dynamic model reads its own packed LM head and gathers a few
    rows of the embedding (sparse self-conditioning): its embedding is not counted."""
    from ..engine.quantize import held_bytes

    total = held_bytes(model) - sum(p.nbytes for n, p in model.named_parameters() if "vision" in n)
    return total - (model.get_input_embeddings().weight.nbytes if is_cpu_int8(model) else 0)


def arithmetic_floor_ms(report: dict[str, Any], flops: dict[str, int] | None) -> float | None:
    """The least time a step's arithmetic takes at the machine's measured rates: its int8-dynamic projections at
    the int8 peak, the rest at the float matmul peak (every FLOP as fast as a large matmul: a floor)."""
    if flops is None:
        return None
    int8 = report["int8_peak"]["tops"] * 1e12 if report.get("int8_peak") else None
    rest = flops["total"] - (flops["int8"] if int8 else 0)
    seconds = rest / (report["peak"]["tflops"] * 1e12) + (flops["int8"] / int8 if int8 else 0)
    return round(seconds * 1000, 3)


def _floor_lines(report: dict[str, Any]) -> list[str]:
    """The memory-bandwidth floor of a step (its weights once, at the measured copy rate), and each eager step's
    multiple of it and of its arithmetic's floor (`arithmetic_floor_ms`): which of the two bounds it."""
    bandwidth, weight_bytes, floor_ms = report["bandwidth"], report["step_weight_bytes"], report["floor_ms"]
    lines = [f"memory-bandwidth floor: {weight_bytes / 2**30:.2f} GiB of weights at {bandwidth['gb_per_s']} GB/s "
             f"(a 256 MiB copy) = {floor_ms:.1f} ms a step"]  # fmt: skip
    int8 = report.get("int8_peak")
    rates = f"{report['peak']['tflops'] * 1000:.0f} GFLOP/s"
    if int8:
        rates = f"{int8['tops'] * 1000:.0f} GOP/s for int8 ({int8['rows']} x {int8['size']}^2), {rates} for the rest"
    for case in report["cases"]:
        step_ms, arithmetic = case.get("eager", {}).get("forward_ms"), case.get("arithmetic_floor_ms")
        if not step_ms:
            continue
        line = f"  canvas {case['canvas']} x{case['rows']}: eager forward {step_ms / floor_ms:.2f}x the floor"
        if arithmetic:
            bound = "arithmetic" if arithmetic > floor_ms else "memory"
            line += (
                f"; its arithmetic ({case['gflop']:.2f} GFLOP, {case['int8_gflop']:.2f} of them int8) at "
                f"{rates} takes {arithmetic:.1f} ms: {bound}-bound, forward {step_ms / arithmetic:.2f}x that"
            )
        lines.append(line)
    return lines


def format_step(report: dict[str, Any]) -> str:
    peak = report["peak"]
    lines = [
        f"{report['model']} on {report['device']} ({report['dtype']}, {report['threads']} threads, "
        f"{report['parameters'] / 1e6:.1f}M parameters, weights {report['weights_gib']:.2f} GiB); "
        f"matmul peak {peak['tflops']} TFLOP/s ({peak['size']}^3 {peak['dtype']})",
        f"encode {report['prefix_tokens']} tokens: {report['encode_ms']} ms ({report['encode_gflop'] or '?'} GFLOP)",
        *_floor_lines(report),
        f"{'canvas':>6} {'rows':>4} {'GFLOP':>8} | {'eager fwd':>9} {'step':>8} {'GFLOP/s':>9} {'peak':>6} | "
        f"{'compiled fwd':>12} {'step':>8} {'peak':>6} {'x eager':>7}",
    ]
    for case in report["cases"]:
        eager, compiled = case.get("eager", {}), case.get("compiled", {})

        def cell(side: dict[str, Any], key: str, width: int, fmt: str = "{:.2f}") -> str:
            shown = fmt.format(side[key]) if side.get(key) is not None else "error" if "error" in side else "-"
            return shown.rjust(width)

        ratio = (f"{compiled['step_ms'] / eager['step_ms']:.2f}" if "step_ms" in compiled and "step_ms" in eager
                 else "-")  # fmt: skip
        lines.append(
            f"{case['canvas']:>6} {case['rows']:>4} {cell(case, 'gflop', 8)} | {cell(eager, 'forward_ms', 9)} "
            f"{cell(eager, 'step_ms', 8)} {cell(eager, 'gflops', 9, '{:.0f}')} "
            f"{cell(eager, 'share_of_peak', 6, '{:.1%}')} "
            f"| {cell(compiled, 'forward_ms', 12)} {cell(compiled, 'step_ms', 8)} "
            f"{cell(compiled, 'share_of_peak', 6, '{:.1%}')} {ratio:>7}"
        )
    for case in report["cases"]:
        for label in ("eager", "compiled"):
            if "error" in case.get(label, {}):
                lines.append(f"canvas {case['canvas']} x{case['rows']} {label}: {case[label]['error']}")
    engine = report.get("engine_steps")
    if engine:
        lines.append(f"the engine's step (DenoisingBatch.step, canvas {engine[0]['canvas']} slots, V = "
                     f"{engine[0]['vocab']:,}); MB allocated per step:")  # fmt: skip
        lines.append(f"{'rows':>6} {'step ms':>9} {'forward':>9} {'its logits':>10} {'the step beyond it':>19}")
        for row in engine:
            sizes = {key: value / 2**20 for key, value in row["bytes_per_step"].items()}
            lines.append(f"{row['rows']:>6} {row['step_ms']:>9.2f} {sizes['forward']:>9.1f} {sizes['logits']:>10.1f} "
                         f"{sizes['step_own']:>19.1f}")  # fmt: skip
    profile = report.get("profile")
    if profile:
        lines.append(f"where an eager step goes (canvas {profile['canvas']}, 1 row; self time per step):")
        for op in profile["ops"]:
            lines.append(f"  {op['op'][:40]:<40} {op['calls_per_step']:>6} calls {op['self_ms_per_step']:>9.3f} ms "
                         f"{op['share']:>6.1%}")  # fmt: skip
    return "\n".join(lines)


def run(model_name: str | None, layers: int | None, device: str | None, dtype: str | None,
        prefix_tokens: int | None, canvases: tuple[int, ...], rows: tuple[int, ...], compile_canvases: tuple[int, ...],
        runs: int, progress: Callable[[str], None] = lambda _: None,
        checkpoint: Callable[[dict[str, Any]], None] = lambda _: None,
        quantize: str = "none", vocab: int | None = None) -> dict[str, Any]:  # fmt: skip
    """`bench step` for a model folder or hub id (None: the shipped one) or, with model_name "full-width", for
    DiffusionGemma 26B-A4B's geometry with random weights (`layers` of its 30), or with `vocab` for the shipped
    architecture at that vocabulary and DiffusionGemma's hidden size (`layers` deep, 2 by default); its layers'
    weights quantised as `quantize` says (eager only unless their experts run the GPU kernel: `quantize.compiles`)."""
    from ..engine.loading import load_model, resolve_device, resolve_dtype
    from ..engine.quantize import compiles, quantize_model, resolve

    if vocab is not None:
        target = resolve_device(device)
        layers = layers or 2
        model = vocab_model(vocab, layers, target, resolve_dtype(dtype, target))
        name = f"shipped architecture at V = {vocab:,}, hidden 2816, {layers} layers, random weights"
    elif model_name == "full-width":
        target = resolve_device(device)
        layers = layers or 30
        config = full_width_config(layers)
        model = random_model(config, target, resolve_dtype(dtype, target))
        model = quantize_model(model, resolve(quantize, config, target))
        name = f"DiffusionGemma 26B-A4B geometry, {layers} of 30 layers, random weights"
    else:
        loaded = load_model(model_name, device, dtype, quantize=quantize)
        model, name = loaded.model, loaded.name
    if quantize != "none":
        experts = model.model.decoder.layers[0].experts.config._experts_implementation
        name += f", {quantize} weights, experts {experts}"
        if not compiles(model):  # the experts loop over what the tokens picked: no one graph
            compile_canvases = ()
    default_prefix = 4096 if next(model.parameters()).device.type == "cuda" else 1024
    return run_step_bench(
        model, name, prefix_tokens or default_prefix, canvases, rows, compile_canvases, runs, progress, checkpoint
    )
