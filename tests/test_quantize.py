"""Quantised weights (`engine.quantize`, torchao through transformers): what loads, how the experts run, what `auto`
picks for a GPU's memory, and the errors a user gets."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from canvas_ls.engine import Engine, ModelLoadError
from canvas_ls.engine.architecture import full_width_config
from canvas_ls.engine.loading import load_model
from canvas_ls.engine.quantize import (
    is_cpu_int8,
    is_quantized,
    quantized_experts,
    resolve,
    weight_bytes,
    weight_counts,
)
from tests.conftest import random_adapter
from tests.test_adapters import PROMPTS
from tests.test_cli import cli

GIB = 1 << 30


def test_int8_quantises_the_layers_and_experts_and_keeps_the_answers(fixed_model_dir: Path) -> None:
    """Every layer's projections and the MoE experts' fused weights load as torchao int8 tensors; embeddings, routers
    and norms stay float. The fixed model writes the same answer quantised, and its experts run per expert on views
    of the int8 weights."""
    loaded = load_model(str(fixed_model_dir), "cpu", "float32", quantize="int8")
    assert loaded.quantized == "int8" and is_quantized(loaded.model) and loaded.name == str(fixed_model_dir)
    layer = loaded.model.model.decoder.layers[0]
    for weight in (layer.self_attn.q_proj.weight, layer.mlp.down_proj.weight, layer.experts.gate_up_proj):
        assert type(weight).__name__ == "Int8Tensor"
    assert type(layer.router.proj.weight) is torch.nn.Parameter
    assert layer.experts.config._experts_implementation == quantized_experts()
    quantized, plain = Engine(loaded, compile="auto"), Engine.load(str(fixed_model_dir), "cpu", quantize="none")
    assert quantized.decoder.report()["state"] == "off"  # eager: the per-expert loop is no graph
    for prefix, suffix in PROMPTS:
        assert quantized.infill(prefix, suffix).text == plain.infill(prefix, suffix).text


def test_int8_dynamic_packs_the_projections_and_keeps_the_answers(fixed_model_dir: Path) -> None:
    """A CPU's int8-dynamic: the layers' projections (each shared with the encoder, packed once), the
    self-conditioning block's and the LM head become torch's dynamically quantised layers; embeddings, routers and
    experts stay float32. It runs eager, conditions on sparse soft embeddings, and writes the fixed model's answers."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

    from canvas_ls.engine.canvas import DenoisingBatch
    from canvas_ls.engine.conditioning import SparseSelfConditioning
    from canvas_ls.engine.elementwise import SigmoidGELUTanh
    from canvas_ls.engine.quantize import held_bytes, quantized_kind

    loaded = load_model(str(fixed_model_dir), "cpu", quantize="int8-dynamic")
    assert (loaded.quantized, loaded.identity["quantize"], loaded.identity["dtype"]) == ("int8-dynamic",) * 2 + (
        "float32",
    )
    model = loaded.model
    layer = model.model.decoder.layers[0]
    shipped = load_model(None, "cpu", quantize="int8-dynamic").model  # its decoder shares the encoder's weights
    shared = shipped.model.decoder.layers[0], shipped.model.encoder.language_model.layers[0]
    assert shared[0].self_attn.q_proj is shared[1].self_attn.q_proj and shared[0].mlp.up_proj is shared[1].mlp.up_proj
    block = model.model.decoder.self_conditioning
    for packed in (layer.self_attn.q_proj, layer.mlp.down_proj, model.lm_head, block.up_proj):
        assert isinstance(packed, DynamicLinear)
    assert type(layer.router.proj) is torch.nn.Linear and layer.experts.gate_up_proj.dtype == torch.float32
    assert type(layer.mlp.act_fn) is SigmoidGELUTanh  # eager: the GELU on exp (`elementwise.py`)
    assert model.model.decoder.embed_tokens.weight.dtype == torch.float32 and quantized_kind(model) == "int8-dynamic"
    # fp32, as int8-dynamic's float parts are, on a bf16 CPU too (where auto would load it in bf16)
    plain = Engine.load(str(fixed_model_dir), "cpu", quantize="none", dtype="float32")
    assert held_bytes(model) < held_bytes(plain.loaded.model) + model.model.decoder.embed_tokens.weight.numel()
    quantized = Engine(loaded, compile="auto")
    assert quantized.decoder.report()["detail"] == "off: int8-dynamic weights run eager"
    assert isinstance(DenoisingBatch(model).conditioning, SparseSelfConditioning)
    for prefix, suffix in PROMPTS:
        assert quantized.infill(prefix, suffix).text == plain.infill(prefix, suffix).text


def test_sparse_self_conditioning_is_the_decoders_own_where_the_tail_is_even(tiny_model_dir: Path) -> None:
    """The soft embeddings `SparseSelfConditioning` computes from a slot's top tokens and an evenly spread rest equal
    the decoder's own (softmax times the embeddings) where the rest is even, and with every token counted; handed
    to the decoder through `SoftInput`, its logits are those of the decoder given the logits themselves."""
    from canvas_ls.engine.conditioning import SoftInput, SparseSelfConditioning

    model = load_model(str(tiny_model_dir), "cpu", "float32", quantize="none").model
    embed = model.model.decoder.embed_tokens
    vocab, width = embed.weight.shape[0], 6
    generator = torch.Generator().manual_seed(0)
    uneven = torch.randn(width, vocab, generator=generator) * 3
    even_tail = torch.zeros(width, vocab)
    even_tail[torch.arange(width), torch.arange(width) * 7] = 5.0  # one likely token per slot, the rest equal

    def exact(logits: torch.Tensor, temperature: float) -> torch.Tensor:
        return torch.softmax(logits / temperature, dim=-1) @ embed.weight * embed.embed_scale

    with torch.inference_mode():
        for logits, top_k in ((even_tail, 1), (even_tail, 4), (uneven, vocab)):
            sparse = SparseSelfConditioning(model, top_k=top_k)
            sparse.fit(1, width)
            sparse.write(0, logits, 0.7)
            torch.testing.assert_close(sparse.buffer[0], exact(logits, 0.7), rtol=1e-4, atol=1e-5)
        sparse.clear(0)
        assert not bool(sparse.buffer[0].any()) and not sparse.any(1)  # a cleared row conditions on nothing

        ids = torch.tensor([[5, 17, 40, 22, 9, 31]])
        expected = model(input_ids=ids, decoder_input_ids=ids, self_conditioning_logits=uneven[None]).logits
        SoftInput.of(model).soft = exact(uneven, 1.0)[None]
        fed = model(input_ids=ids, decoder_input_ids=ids).logits
        torch.testing.assert_close(fed, expected, rtol=1e-4, atol=1e-4)
        assert SoftInput.of(model).soft is None  # used once: the next forward computes its own
        unfed = model(input_ids=ids, decoder_input_ids=ids).logits
        torch.testing.assert_close(unfed, model(input_ids=ids, decoder_input_ids=ids).logits)
        assert not torch.allclose(unfed, fed)


def test_int8_dynamic_holds_workspace_adapters_apart(tiny_model_dir: Path, linear_adapters: list[Path]) -> None:
    """Workspace adapters per request on int8-dynamic weights (peft's custom-layer API, `packed_lora_class`): with
    each adapter the logits stay within 6% of the adapter's move from the float model with it (merged before packing
    they differ by 13-17%: `test_an_adapter_applies_to_int8_weights`), the base alone is the packed base exactly,
    and the encoder and decoder, which share each packed layer, share its LoRA layer."""
    from canvas_ls.engine.adapters import AdapterSet

    ids = torch.tensor([[5, 17, 40, 22, 9, 31]])

    def logits(model: Any) -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=ids, decoder_input_ids=ids).logits

    packed = load_model(str(tiny_model_dir), "cpu", quantize="int8-dynamic").model
    alone = logits(packed)
    adapters = AdapterSet(packed)
    float_base = logits(load_model(str(tiny_model_dir), "cpu", "float32", quantize="none").model)
    for folder in (*linear_adapters, linear_adapters[0]):
        adapters.activate(str(folder))
        expected = logits(load_model(str(tiny_model_dir), "cpu", "float32", str(folder), quantize="none").model)
        moved = (expected - float_base).abs().mean()
        assert (logits(packed) - expected).abs().mean() < 0.06 * moved
    adapters.activate(None)
    torch.testing.assert_close(logits(packed), alone, rtol=0, atol=0)
    decoder, encoder = packed.model.decoder.layers[0], packed.model.encoder.language_model.layers[0]
    assert type(decoder.self_attn.q_proj).__name__ == "PackedLoraLinear" and is_cpu_int8(packed)
    assert decoder.mlp.down_proj is encoder.mlp.down_proj


def dequantized_twin(model_dir: Path, experts: Any) -> Any:
    """The float model's first decoder experts holding `experts`' quantised weights, dequantized: transformers' own
    implementation on the same values is the reference."""
    dense = load_model(str(model_dir), "cpu", "float32", quantize="none").model.model.decoder.layers[0].experts
    with torch.no_grad():
        dense.gate_up_proj.copy_(experts.gate_up_proj.dequantize())
        dense.down_proj.copy_(experts.down_proj.dequantize())
    return dense


def routed_tokens(experts: Any, tokens: int = 23) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hidden states, each token's 2 picked experts and their router weights (seeded)."""
    torch.manual_seed(0)
    hidden = torch.randn(tokens, experts.hidden_dim)
    picks = torch.stack([torch.randperm(experts.num_experts)[:2] for _ in range(tokens)])
    return hidden, picks, torch.softmax(torch.randn(tokens, 2), dim=-1)


def test_the_quantised_experts_compute_what_transformers_computes(tiny_model_dir: Path) -> None:
    """The implementations for quantised experts against transformers' grouped one on the same int8 weights
    (dequantized into a float model): the per-expert loop (CPU, int4), the dequantize-then-grouped one and the Triton
    kernel (a GPU's int8): same routing, same sums."""
    from canvas_ls.engine.experts_kernel import kernel_experts
    from canvas_ls.engine.quantize import dequantized_experts, use_quantized_experts

    quantized = load_model(str(tiny_model_dir), "cpu", "float32", quantize="int8").model
    experts = quantized.model.decoder.layers[0].experts
    dense, (hidden, picks, weights) = dequantized_twin(tiny_model_dir, experts), routed_tokens(experts)
    with torch.inference_mode():
        expected = dense(hidden, picks, weights)
        assert experts.config._experts_implementation == quantized_experts()  # the CPU's
        torch.testing.assert_close(experts(hidden, picks, weights), expected, rtol=1e-5, atol=1e-5)
        use_quantized_experts(quantized, grouped=True, kernel=False)
        assert experts.config._experts_implementation == dequantized_experts()
        torch.testing.assert_close(experts(hidden, picks, weights), expected, rtol=1e-5, atol=1e-5)
        # A GPU's int8 path: the Triton kernel (here in its interpreter), the weights read as int8 and scaled after
        use_quantized_experts(quantized, kernel=True)
        assert experts.config._experts_implementation == kernel_experts()
        torch.testing.assert_close(experts(hidden, picks, weights), expected, rtol=1e-5, atol=1e-5)


def test_auto_picks_the_widest_weights_that_fit_the_gpus_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """DiffusionGemma 26B-A4B's weights, counted on the meta device: 48 GiB in bf16, about 25 in int8 and 14 in
    int4. `auto` keeps a quarter of the free memory for caches and activations."""
    config = full_width_config()
    counts = weight_counts(config)
    assert 25e9 < counts["quantized"] + counts["kept"] < 27e9
    sizes = {kind: weight_bytes(counts, kind) / GIB for kind in ("none", "int8", "int4")}
    assert 47 < sizes["none"] < 50 and 24 < sizes["int8"] < 27 and 13 < sizes["int4"] < 16
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: (8, 9))
    cuda = torch.device("cuda")
    for free_gib, expected in ((139, "none"), (78, "none"), (46, "int8"), (23, "int4"), (8, "int4")):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index=0, free=free_gib: (free * GIB, 141 * GIB))
        assert resolve("auto", config, cuda) == expected, free_gib
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: (7, 5))  # a T4: no tinygemm kernel
    assert resolve("auto", config, cuda) == "int8"
    cpu = torch.device("cpu")
    assert resolve("auto", config, cpu) == "int8-dynamic"  # a large model on a CPU: its fast int8
    assert resolve("auto", load_model(None, "cpu").model.config, cpu) == "none"  # the shipped model stays as it is
    with pytest.raises(ModelLoadError, match=r"int8-dynamic weights run on a CPU .* use --quantize int8 here"):
        resolve("int8-dynamic", config, cuda)
    monkeypatch.setattr(type(torch.backends.quantized), "supported_engines", ["qnnpack"])  # no x86 kernels
    assert resolve("auto", config, cpu) == "none"
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)  # no torchao: unquantised, said
    assert resolve("auto", config, cuda) == "none"


def test_what_cannot_run_here_is_refused_with_the_way_out(tiny_model_dir: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    with pytest.raises(ModelLoadError, match=r"int4 weights run on NVIDIA GPUs .* use --quantize int8 here"):
        load_model(str(tiny_model_dir), "cpu", quantize="int4")
    with pytest.raises(ModelLoadError, match=r"quantisation 'int3' \(use auto, none, int8, int4, int8-dynamic\)"):
        load_model(str(tiny_model_dir), "cpu", quantize="int3")
    result = cli("complete", __file__, "--line", "0", "--character", "0", "--model", str(tiny_model_dir),
                 "--device", "cpu", "--quantize", "int4")  # fmt: skip
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("canvas-ls: error: int4 weights run on NVIDIA GPUs")
    experts = random_adapter(tiny_model_dir, tmp_path / "experts", experts=True)
    with pytest.raises(ModelLoadError, match="adapts the MoE experts' weights, which int8 weights cannot take"):
        load_model(str(tiny_model_dir), "cpu", adapter=str(experts), quantize="int8")
    monkeypatch.setitem(sys.modules, "torchao.quantization", None)  # installed without the `quantize` extra
    with pytest.raises(ModelLoadError, match=r"need torchao: pip install 'canvas-ls\[quantize\]'"):
        load_model(str(tiny_model_dir), "cpu", quantize="int8")


@pytest.mark.parametrize(("kind", "error"), [("int8", 0.1), ("int8-dynamic", 0.15)])
def test_an_adapter_applies_to_int8_weights(tiny_model_dir: Path, tmp_path: Path, kind: str, error: float) -> None:
    """A LoRA adapter of the attention and dense MLP applies to int8 weights: torchao's, through peft's torchao
    layers, kept apart (a merge would write float deltas into int8 weights); int8-dynamic's, merged into the float
    weights before they are packed. The logits move as far from the int8 base as the adapter moves the float model,
    and stay near the float model with the adapter (int8-dynamic also rounds each call's activations: 12% of the
    adapter's move here, against under 10% for weights alone)."""
    adapter = random_adapter(tiny_model_dir, tmp_path / "adapter")
    ids = torch.tensor([[5, 17, 40, 22, 9, 31]])

    def logits(quantize: str, with_adapter: bool) -> torch.Tensor:
        model = load_model(str(tiny_model_dir), "cpu", "float32", str(adapter) if with_adapter else None,
                           quantize=quantize).model  # fmt: skip
        with torch.no_grad():
            return model(input_ids=ids, decoder_input_ids=ids).logits

    adapted_int8, adapted_float = logits(kind, True), logits("none", True)
    base_int8, base_float = logits(kind, False), logits("none", False)
    moved = (adapted_float - base_float).abs().mean()
    assert moved > 0.05
    assert (adapted_int8 - adapted_float).abs().mean() < error * moved
    torch.testing.assert_close((adapted_int8 - base_int8).abs().mean(), moved, rtol=0.1, atol=0)


def test_a_lora_run_trains_on_an_int8_base_and_its_adapter_loads(tiny_model_dir: Path, tmp_path: Path) -> None:
    """`train --lora --quantize int8` (QLoRA-style): the frozen base loads in int8, the adapter trains in fp32 and is
    exported alone (no merge into int8 weights); the engine loads it on the int8 base. The plan counts the base at
    one byte a quantised weight."""
    import json
    import shutil

    from canvas_ls.engine.plan import training_plan
    from canvas_ls.engine.quantize import WEIGHT_BYTES

    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    for index, (prefix, suffix) in enumerate(PROMPTS * 4):
        (repo / "pkg" / f"m{index}.py").write_text(prefix + f"value_{index}" + suffix)
    model = tmp_path / "base"
    shutil.copytree(tiny_model_dir, model)
    out = tmp_path / "out"
    done = cli("train", "--from", str(model), "--corpus", str(repo), "--lora", "4", "--quantize", "int8",
               "--minutes", "0.05", "--out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout[done.stdout.index("{") :])
    assert summary["step"] >= 1 and "eval_diffusion" in summary
    final = json.loads((out / "log.jsonl").read_text().splitlines()[-1])["final"]["config"]
    assert (final["lora_rank"], final["quantize"]) == (4, "int8")
    assert (out / "adapter" / "adapter_config.json").is_file() and not (out / "model").exists()
    answer = cli("complete", str(repo / "pkg" / "m0.py"), "--line", "1", "--character", "11", "--model", str(model),
                 "--adapter", str(out / "adapter"), "--quantize", "int8", "--json")  # fmt: skip
    assert answer.returncode == 0, answer.stderr
    refused = cli("train", "--from", str(model), "--corpus", str(repo), "--quantize", "int8", "--out", str(out))
    assert refused.returncode == 2 and "a quantised base (--quantize) trains a LoRA adapter" in refused.stderr

    config = full_width_config(layers=2)
    plain, int8 = (training_plan(config, 1, 64, 48, lora_rank=4, quantize=kind) for kind in ("none", "int8"))
    covered = weight_counts(config)["quantized"]
    assert int8["mode"] == "LoRA rank 4, int8 base" and plain["mode"] == "LoRA rank 4"
    assert plain["bytes"]["weights"] - int8["bytes"]["weights"] == covered * (2 - WEIGHT_BYTES["int8"])


def test_quantising_a_model_in_memory_matches_quantising_it_while_it_loads() -> None:
    """`quantize_model` (what `bench step --quantize` runs on random full-width layers) makes the weights loading
    makes, and keeps the decoder's weights shared with the encoder (the shipped model shares them): the same bytes,
    the same logits."""
    from canvas_ls.engine.quantize import held_bytes, quantize_model

    loaded = load_model(None, "cpu", "float32", quantize="int8").model
    built = quantize_model(load_model(None, "cpu", "float32", quantize="none").model, "int8")
    layer, encoder_layer = built.model.decoder.layers[1], built.model.encoder.language_model.layers[1]
    assert layer.experts.down_proj is encoder_layer.experts.down_proj and is_quantized(built)
    assert held_bytes(built) == held_bytes(loaded) < 0.7 * held_bytes(load_model(None, "cpu", "float32").model)
    ids = torch.tensor([[5, 17, 40, 22, 9, 31]])
    with torch.no_grad():
        torch.testing.assert_close(built(input_ids=ids, decoder_input_ids=ids).logits,
                                   loaded(input_ids=ids, decoder_input_ids=ids).logits)  # fmt: skip


@pytest.mark.parametrize("kind", ["int8", "int8-dynamic"])
def test_workspace_adapters_switch_per_request_on_int8(tiny_model_dir: Path, linear_adapters: list[Path],
                                                       kind: str) -> None:  # fmt: skip
    """What a DiffusionGemma user on a 24/48 GB card (int8) or a large model on a CPU (int8-dynamic) gets from
    "Learn this workspace": one engine on the quantised base answers each request with its workspace's adapter (held
    apart, switched per batch) or with the base alone, and switching back and forth changes nothing.

    The base answer compared is the one from its cached prefix (the second request): int8-dynamic quantises an
    encoder call's activations with one scale, so a prefix encoded whole and one whose last tokens came after a
    snapshot may answer differently in late tokens (`prefix_cache.py`)."""
    engine = Engine.load(str(tiny_model_dir), "cpu", quantize=kind)
    prompt = PROMPTS[0]
    engine.infill(*prompt, {"seed": 1})
    base = engine.infill(*prompt, {"seed": 1}).tokens
    adapted = [engine.infill(*prompt, {"seed": 1}, adapter=str(folder)).tokens for folder in linear_adapters]
    assert adapted[0] != base and adapted[1] != base and adapted[0] != adapted[1]
    assert engine.infill(*prompt, {"seed": 1}).tokens == base
    assert engine.infill(*prompt, {"seed": 1}, adapter=str(linear_adapters[0])).tokens == adapted[0]


def test_torchao_is_imported_only_where_quantised_weights_are_asked_for(tiny_model_dir: Path) -> None:
    """transformers would import torchao in every process where it is installed (+0.3 s a start, and a CPU engine
    measured ~3% slower with it): a process that loads unquantised weights never imports it, one that asks for int8
    does."""
    import subprocess

    code = ("import sys; from canvas_ls.engine import Engine; Engine.load(sys.argv[1], 'cpu'); "
            "print('torchao' in sys.modules); Engine.load(sys.argv[1], 'cpu', quantize='int8'); "
            "print('torchao' in sys.modules)")  # fmt: skip
    run = subprocess.run([sys.executable, "-c", code, str(tiny_model_dir)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["False", "True"]


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_kernel_covers_ragged_experts_rows_and_widths(kind: str, dtype: torch.dtype,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The Triton grouped matmul (its interpreter here) on shapes no tile divides: 3 experts holding 0, 5 and 37 rows
    (several row tiles), 40 outputs, 100 inputs (int4: groups of 32, the last one short), rows gathered out of order,
    and its gradient; in half precision too (the interpreter computes through numpy, which has float16 but no
    bfloat16: a GPU's bf16 runs the same code)."""
    from canvas_ls.engine import int4_experts
    from canvas_ls.engine.experts_kernel import Quantized, grouped_linear, weight_parts
    from canvas_ls.engine.int4_experts import Int4ExpertsTensor

    monkeypatch.setattr(int4_experts, "CHUNK", 2)  # quantised 2 experts at a time, then 1
    generator = torch.Generator().manual_seed(0)
    if kind == "int8":
        qdata = torch.randint(-127, 128, (3, 40, 100), dtype=torch.int8, generator=generator)
        scale = torch.rand(3, 40, generator=generator) / 100
        weight, dense = Quantized(qdata, scale.to(dtype)), qdata.float() * scale[..., None]
    else:
        original = torch.randn(3, 40, 100, generator=generator).to(dtype)
        int4 = Int4ExpertsTensor.from_float(original, group=32)
        weight, dense = weight_parts(int4), int4.dequantize(torch.float32)
        assert int4.qdata.shape == (3, 40, 50) and int4.scale.shape == (3, 4, 40) and weight.shape == (3, 40, 100)
        half_step = int4.scale.float().transpose(1, 2).repeat_interleave(32, dim=-1)[..., :100] / 2
        assert bool(((dense - original.float()).abs() <= half_step + 1e-2).all())  # 16 levels per group's range
    a = torch.randn(9, 100, generator=generator).to(dtype)
    counts = torch.tensor([0, 5, 37], dtype=torch.int32)
    starts = torch.tensor([0, 0, 5], dtype=torch.int32)
    rows = torch.randint(0, 9, (42,), dtype=torch.int32, generator=generator)
    a.requires_grad_(True)
    out = grouped_linear(a, rows, weight, starts, counts, 14)
    experts = torch.repeat_interleave(torch.arange(3), counts.long())
    reference = a.detach().float().requires_grad_(True)
    expected = torch.einsum("sk,snk->sn", reference[rows.long()], dense[experts])
    assert out.dtype == dtype and out.shape == (42, 40)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance * 10)
    # LoRA on a quantised base trains through the experts: the gradient reaches the activations (weights frozen)
    grad = torch.randn(42, 40, generator=generator)
    out.backward(grad.to(dtype))
    expected.backward(grad)
    torch.testing.assert_close(a.grad.float(), reference.grad, rtol=tolerance, atol=tolerance * 10)


def test_int8_experts_in_the_kernel_trace_into_one_graph_and_let_the_model_compile(tiny_model_dir: Path) -> None:
    """The kernel is a custom op without host synchronisation: dynamo captures a quantised experts layer whole
    (fullgraph, token counts dynamic) and its answers are eager's; so a model whose experts run it compiles
    (`quantize.compiles`: CUDA graphs on a GPU), while the per-expert loop keeps a quantised model eager."""
    from canvas_ls.engine.quantize import compiles, use_quantized_experts

    model = load_model(str(tiny_model_dir), "cpu", "float32", quantize="int8").model
    assert not compiles(model)  # the CPU's per-expert loop
    use_quantized_experts(model, kernel=True)
    assert compiles(model)
    experts = model.model.decoder.layers[0].experts
    traced = torch.compile(experts, backend="aot_eager", fullgraph=True, dynamic=True)
    with torch.inference_mode():
        for tokens in (23, 31):
            routed = routed_tokens(experts, tokens)
            torch.testing.assert_close(traced(*routed), experts(*routed))


def test_int4_experts_load_in_the_kernels_layout_and_compute_what_transformers_computes(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """int4 experts (a GPU's; tinygemm's layout cannot be read by expert) load through transformers' TorchAoConfig
    into `int4_experts`' layout, shared by the encoder and the decoder, and the kernel computes what transformers'
    grouped implementation computes on their dequantized values. (The projections here are int8, since torchao's int4
    projections need a GPU.)"""
    from torchao.quantization import FqnToConfig, Int8WeightOnlyConfig
    from transformers import TorchAoConfig

    from canvas_ls.engine import quantize
    from canvas_ls.engine.experts_kernel import kernel_experts
    from canvas_ls.engine.int4_experts import Int4ExpertsConfig, Int4ExpertsTensor
    from canvas_ls.engine.lazy_torchao import want_torchao

    want_torchao()  # what a quantised load does first (transformers sees torchao from then on)
    layers, experts_pattern = quantize.QUANTIZED
    mixed = {layers: Int8WeightOnlyConfig(set_inductor_config=False), experts_pattern: Int4ExpertsConfig()}
    monkeypatch.setattr(
        quantize,
        "torchao_config",
        lambda kind: TorchAoConfig(quant_type=FqnToConfig(mixed), modules_to_not_convert=["lm_head"]),
    )
    with_kernel = quantize.use_quantized_experts  # the CPU would loop per expert, which int4 experts do not offer
    monkeypatch.setattr(quantize, "use_quantized_experts", lambda model: with_kernel(model, kernel=True))
    model = load_model(str(tiny_model_dir), "cpu", "float32", quantize="int8").model
    experts = model.model.decoder.layers[0].experts
    assert isinstance(experts.gate_up_proj, Int4ExpertsTensor) and quantize.quantized_kind(model) == "int4"
    assert experts.gate_up_proj is model.model.encoder.language_model.layers[0].experts.gate_up_proj
    assert experts.config._experts_implementation == kernel_experts() and quantize.compiles(model)
    dense, (hidden, picks, weights) = dequantized_twin(tiny_model_dir, experts), routed_tokens(experts)
    with torch.inference_mode():
        torch.testing.assert_close(experts(hidden, picks, weights), dense(hidden, picks, weights),
                                   rtol=1e-5, atol=1e-5)  # fmt: skip


def test_lora_gradients_through_the_kernels_experts_are_the_grouped_ones(tiny_model_dir: Path) -> None:
    """LoRA on an int8 base trains through the kernel (its backward for the activations): the adapter's gradients
    through a whole forward equal those through the dequantize-then-grouped experts on the same weights."""
    from canvas_ls.engine.adapters import add_lora
    from canvas_ls.engine.quantize import use_quantized_experts

    model = load_model(str(tiny_model_dir), "cpu", "float32", quantize="int8").model
    adapted = add_lora(model, rank=4)
    with torch.no_grad():  # peft starts B at zero, which would leave every A without a gradient
        for name, parameter in adapted.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.1)
    ids = torch.randint(5, model.config.text_config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))

    def gradients(kernel: bool) -> dict[str, torch.Tensor]:
        use_quantized_experts(model, grouped=True, kernel=kernel)
        adapted.zero_grad()
        model.model.encoder(input_ids=ids).last_hidden_state.pow(2).mean().backward()
        return {n: p.grad.clone() for n, p in adapted.named_parameters() if p.grad is not None}

    through_kernel, through_grouped = gradients(True), gradients(False)
    assert through_kernel.keys() == through_grouped.keys() and len(through_kernel) > 4
    reached = [name for name, grad in through_kernel.items() if "layers.0." in name and bool(grad.abs().sum() > 0)]
    assert any("lora_A" in name for name in reached)  # through every layer's experts down to the first layer
    for name, grad in through_grouped.items():
        torch.testing.assert_close(through_kernel[name], grad, rtol=1e-4, atol=1e-6, msg=name)
