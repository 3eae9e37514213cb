"""LoRA adapters (peft): training touches the adapter alone, the engine applies it merged or not with the same
answers, and its size for DiffusionGemma 26B-A4B is counted without building the model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import DiffusionGemmaForBlockDiffusion

from canvas_ls.engine import Engine
from canvas_ls.engine.adapters import adapter_size, add_lora, trainable_parameters
from canvas_ls.engine.architecture import full_width_config, small_config
from canvas_ls.engine.tokenizer import train_tokenizer
from tests.conftest import random_adapter, tokenizer_texts
from tests.test_cli import cli
from tests.test_training import short_run

PROMPTS = [("def add(a, b):\n    return ", "\n"), ("import os\n\n\ndef main():\n    path = ", "\n    return path\n"),
           ("x = [\n    ", "\n]\n")]  # fmt: skip


def test_lora_training_moves_the_adapter_alone(tmp_path: Path) -> None:
    tokenizer = train_tokenizer(tokenizer_texts(), 400, tmp_path / "tok")
    torch.manual_seed(0)
    model = DiffusionGemmaForBlockDiffusion(small_config(len(tokenizer)))
    adapted = add_lora(model, rank=4, experts=True)
    base = adapted.get_base_model()
    frozen = {n: p.detach().clone() for n, p in base.named_parameters() if not p.requires_grad}
    lora = {n: p.detach().clone() for n, p in base.named_parameters() if p.requires_grad}
    assert lora and all("lora" in n for n in lora)
    assert any("experts" in n for n in lora) and not any("vision" in n or "self_conditioning" in n for n in lora)
    before, summary, after = short_run(base, tokenizer, tmp_path / "run", max_steps=12, lr=1e-2, warmup_steps=2,
                                       lora_rank=4)  # fmt: skip
    assert summary["step"] == 12 and after["diffusion"] < before["diffusion"]
    for name, value in base.named_parameters():
        if name in frozen:
            assert torch.equal(value, frozen[name]), name
    assert sum(not torch.equal(p, lora[n]) for n, p in base.named_parameters() if n in lora) > len(lora) // 2


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An adapter of the attention, dense MLP and expert weights of the tiny model."""
    return random_adapter(tiny_model_dir, tmp_path_factory.mktemp("adapter"), experts=True)


def test_merged_and_unmerged_adapters_answer_alike(tiny_model_dir: Path, adapter_dir: Path,
                                                    tiny_engine_fp32: Engine) -> None:  # fmt: skip
    from canvas_ls.engine.engine import InfillRequest
    from canvas_ls.engine.loading import load_model

    merged = Engine.load(str(tiny_model_dir), "cpu", dtype="float32", adapter=str(adapter_dir))
    apart = Engine(load_model(str(tiny_model_dir), "cpu", "float32", str(adapter_dir), merge_adapter=False))
    assert merged.name.endswith(str(adapter_dir))
    assert any("lora" in n for n, _ in apart.loaded.model.named_parameters())
    assert not any("lora" in n for n, _ in merged.loaded.model.named_parameters())
    requests = [InfillRequest(p, s, {"max_new_tokens": 8, "min_new_tokens": 2, "seed": 1}) for p, s in PROMPTS]
    with_merged, with_apart = merged.infill_batch(requests), apart.infill_batch(requests)
    base = tiny_engine_fp32.infill_batch(requests)
    for a, b in zip(with_merged, with_apart, strict=True):
        assert a.tokens == b.tokens and a.steps == b.steps
    assert [r.tokens for r in with_merged] != [r.tokens for r in base]  # the adapter does change the model


def test_one_engine_answers_with_each_adapter_a_request_names(
    tiny_model_dir: Path, linear_adapters: list[Path], adapter_dir: Path, tiny_engine_fp32: Engine
) -> None:
    """Adapters held apart from the weights, switched per request, answer as the model with each one merged (fp32,
    token for token), and the model alone as before; past `limit` the least recent goes and comes back on use. An
    adapter of the expert parameters cannot share the model (peft), a batch takes one adapter at a time."""
    from canvas_ls.engine import ModelLoadError
    from canvas_ls.engine.engine import InfillRequest

    def answers(engine: Engine, adapter: Path | None = None) -> list[list[int]]:
        requests = [InfillRequest(p, s, {"max_new_tokens": 8, "min_new_tokens": 2, "seed": 1},
                                  adapter=None if adapter is None else str(adapter)) for p, s in PROMPTS]  # fmt: skip
        return [result.tokens for result in engine.infill_batch(requests)]

    merged = {a: answers(Engine.load(str(tiny_model_dir), "cpu", dtype="float32", adapter=str(a)))
              for a in linear_adapters}  # fmt: skip
    base = answers(tiny_engine_fp32)
    first, second = linear_adapters
    assert len({str(merged[first]), str(merged[second]), str(base)}) == 3  # each adapter changes the answers
    shared = Engine.load(str(tiny_model_dir), "cpu", dtype="float32")
    for adapter in (first, None, second, first, None):
        assert answers(shared, adapter) == (base if adapter is None else merged[adapter]), adapter
    assert list(shared.adapters.names) == [str(second), str(first)]
    result = shared.infill("x = ", "\n", {"max_new_tokens": 4}, adapter=str(second))
    assert result.adapter == str(second) and shared.infill("x = ", "\n", {"max_new_tokens": 4}).adapter is None
    one = Engine.load(str(tiny_model_dir), "cpu", dtype="float32")
    one.adapters.limit = 1
    for adapter in (first, second, first):
        assert answers(one, adapter) == merged[adapter] and list(one.adapters.names) == [str(adapter)]
    with pytest.raises(ModelLoadError, match="adapts the MoE expert parameters"):
        shared.infill("x = ", "\n", adapter=str(adapter_dir))
    batch = shared.batch()
    refused = batch.add_many([InfillRequest("a = ", "\n", adapter=str(first)), InfillRequest("b = ", "\n")])
    assert [str(error) for _, error in refused] == ["a batch answers with one adapter at a time"] and len(batch) == 1


def test_an_adapter_that_is_not_one_is_a_clear_error(tiny_model_dir: Path, tmp_path: Path) -> None:
    from canvas_ls.engine import ModelLoadError
    from canvas_ls.engine.loading import load_model

    (tmp_path / "notes").mkdir()
    with pytest.raises(ModelLoadError) as raised:  # the CLI prints it as one line, exit 2 (tests/test_cli.py)
        load_model(str(tiny_model_dir), "cpu", adapter=str(tmp_path / "notes"))
    assert str(raised.value).endswith("is not a peft adapter folder (no adapter_config.json in it)")


def test_the_full_size_adapter_is_counted_on_the_meta_device() -> None:
    size = adapter_size(full_width_config(), rank=16)
    experts = adapter_size(full_width_config(), rank=16, experts=True)
    assert 25e9 < size["model_parameters"] < 27e9  # DiffusionGemma 26B-A4B
    # one LoRA per shared encoder/decoder weight: 30 layers x rank 16 x (q, k, v, o, gate, up, down) in + out dims
    assert size["adapter_parameters"] < experts["adapter_parameters"] < 0.025 * size["model_parameters"]
    # each expert of each layer: rank 16 x (2816 + 1408) for gate_up and 16 x (704 + 2816) for down
    assert experts["adapter_parameters"] - size["adapter_parameters"] == 30 * 128 * 16 * (2816 + 1408 + 704 + 2816)


def test_train_lora_on_a_repository_exports_an_adapter_the_engine_takes(tiny_model_dir: Path, tmp_path: Path) -> None:
    import json
    import shutil

    repo = tmp_path / "repo"
    for index, text in enumerate(tokenizer_texts()[:12]):
        (repo / "pkg").mkdir(parents=True, exist_ok=True)
        (repo / "pkg" / f"m{index}.py").write_text(text)
    model = tmp_path / "base"
    shutil.copytree(tiny_model_dir, model)
    out = tmp_path / "out"
    done = cli("train", "--from", str(model), "--corpus", str(repo), "--lora", "4", "--minutes", "0.05", "--out",
               str(out), "--fp32")  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout[done.stdout.index("{") :])
    assert summary["step"] >= 1 and "eval_before_diffusion" in summary and "eval_diffusion" in summary
    assert summary["repository"]["files"] >= 2 and summary["stopped"] == "budget"
    final = json.loads((out / "log.jsonl").read_text().splitlines()[-1])["final"]["config"]
    assert (final["lora_rank"], final["bf16"]) == (4, False)  # the command's flags reach the training
    held_out = json.loads((out / "repository_report.json").read_text())["held_out_files"]
    assert held_out and all(name.startswith("pkg/") for name in held_out)
    assert (out / "adapter" / "adapter_config.json").is_file() and (out / "model" / "config.json").is_file()
    (repo / "pkg" / "m0.py").write_text("def f(x):\n    return ")
    answer = cli("complete", str(repo / "pkg" / "m0.py"), "--line", "1", "--character", "11", "--model", str(model),
                 "--adapter", str(out / "adapter"), "--json")  # fmt: skip
    assert answer.returncode == 0, answer.stderr
    assert json.loads(answer.stdout)["model"].endswith(str(out / "adapter"))


def test_the_training_plan_counts_the_model_and_refuses_what_cannot_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    from canvas_ls.engine import plan

    config = small_config(512)
    full = plan.training_plan(config, batch_size=4, prefix_tokens=64, canvas_tokens=48)
    lora = plan.training_plan(config, batch_size=4, prefix_tokens=64, canvas_tokens=48, lora_rank=4)
    real = DiffusionGemmaForBlockDiffusion(config)
    assert full["parameters"] == lora["parameters"] == sum(p.numel() for p in real.parameters())
    assert lora["trainable"] == trainable_parameters(add_lora(real, 4)) < full["trainable"] == full["parameters"]
    assert full["bytes"]["weights"] == 4 * full["parameters"]  # fp32 master weights
    assert full["bytes"]["optimizer"] == 2 * full["bytes"]["gradients"] == 8 * full["trainable"]
    frozen = lora["parameters"] - lora["trainable"]
    assert lora["bytes"]["weights"] == 2 * frozen + 4 * lora["trainable"]  # bf16 base, fp32 adapter
    assert lora["bytes"]["activations"] == full["bytes"]["activations"] > 0
    averaged = plan.training_plan(config, batch_size=4, prefix_tokens=64, canvas_tokens=48, lora_rank=4, ema=True)
    assert averaged["bytes"]["average"] == 4 * lora["trainable"]  # the moving average: an fp32 copy of the adapter
    assert averaged["total_bytes"] == lora["total_bytes"] + averaged["bytes"]["average"]
    assert "average" not in lora["bytes"]
    assert "average" in plan.format_plan([full, averaged], "here", "small")
    monkeypatch.setattr(plan, "available_bytes", lambda device: (full["total_bytes"] - 1, "a small card"))
    refused = plan.check(full, torch.device("cpu"))
    assert refused is not None and "a small card" in refused and "--lora" in refused
    assert plan.check(lora, torch.device("cpu")) is None
