"""`canvas-ls complete` as a user runs it: a real process, a fixture file, a model folder."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from canvas_ls.server.cli import main
from tests.conftest import FIXTURES, NOTHING_LOADED, REPO, refused_before_loading

STATS = FIXTURES / "python" / "stats.py"
RESULT_FIELDS = {
    "text",
    "tokens",
    "healed",
    "token_texts",
    "confidence",
    "steps",
    "forward_passes",
    "tokens_per_forward",
    "canvases",
    "canvas_stops",
    "stop_reason",
    "encode_ms",
    "denoise_ms",
    "prefix_tokens",
    "prefix_reused_tokens",
    "suffix_head_tokens",
    "layout",
    "model",
    "dtype",
    "settings",
    "gaps",
    "score",
    "score_kind",
    "min_confidence",
    "adapter",
}


def canvas_ls(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "canvas_ls.server.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
        stdin=subprocess.DEVNULL,
    )


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """The command run by the same `main` in this process: what it prints and returns, without another start of
    torch and transformers (~6 s a process here). Tests of what a fresh process prints use `canvas_ls`."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exit_:  # argparse refuses the arguments this way
            code = exit_.code if isinstance(exit_.code, int) else 1
    return subprocess.CompletedProcess(["canvas-ls", *args], code, out.getvalue(), err.getvalue())


def test_complete_json_prints_every_field(tiny_model_dir: Path) -> None:
    done = canvas_ls(
        "complete",
        str(STATS),
        "--line",
        "19",
        "--character",
        "11",
        "--model",
        str(tiny_model_dir),
        "--json",
        "--max-new-tokens",
        "16",
        "--max-steps",
        "4",
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert set(result) == RESULT_FIELDS
    assert result["layout"] == "canvas"
    assert result["steps"] == result["forward_passes"] > 0
    assert len(result["confidence"]) == len(result["tokens"]) <= 16
    assert (result["stop_reason"], len(result["tokens"])) == ("max_tokens", 16)  # the tiny model fills its 16
    assert done.stderr == ""  # no library chatter


def test_complete_plain_prints_the_text(tiny_model_dir: Path) -> None:
    args = (
        "complete",
        str(STATS),
        "--line",
        "9",
        "--character",
        "0",
        "--model",
        str(tiny_model_dir),
        "--max-new-tokens",
        "8",
        "--max-steps",
        "3",
    )
    plain = cli(*args)
    as_json = cli(*args, "--json")
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout == json.loads(as_json.stdout)["text"] + "\n"


def one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("canvas-ls: error: ")
    return lines[0]


def test_missing_model_folder_is_one_clear_line(tmp_path: Path) -> None:
    done = canvas_ls("complete", str(STATS), "--line", "0", "--character", "0", "--model", str(tmp_path / "nope"))
    assert "does not exist" in one_line_error(done)


@pytest.mark.parametrize("command", [["complete", str(STATS), "--line", "0", "--character", "0"], ["engine"]])
def test_a_model_that_is_not_there_is_refused_before_torch_loads(command: list[str], tmp_path: Path) -> None:
    """A mistyped folder, a folder without a model, a hub id while the hub is off: refused at once (`model_source`),
    before torch, transformers or the engine's compiling process load."""
    (tmp_path / "empty").mkdir()
    for model, error in [(str(tmp_path / "nope"), f"model folder '{tmp_path / 'nope'}' does not exist"),
                         (str(tmp_path / "empty"), f"folder '{tmp_path / 'empty'}' holds no model (no config.json in "
                                                   "it)"),
                         ("google/diffusiongemma-26B-A4B-it", "model 'google/diffusiongemma-26B-A4B-it' is not a local "
                          "folder, not in the Hugging Face cache, and could not be fetched from the model hub, which "
                          "HF_HUB_OFFLINE switches off: download it where the hub can be reached and pass its folder "
                          "(--model /path/to/it)")]:  # fmt: skip
        done = refused_before_loading([*command, "--model", model], env={"HF_HUB_OFFLINE": "1"})
        assert (done.returncode, done.stderr, done.stdout.strip()) == (2, f"canvas-ls: error: {error}\n",
                                                                       NOTHING_LOADED)  # fmt: skip


def test_folder_without_a_model_is_one_clear_line(tmp_path: Path) -> None:
    done = cli("complete", str(STATS), "--line", "0", "--character", "0", "--model", str(tmp_path))
    assert "holds no model" in one_line_error(done)


def test_hub_id_while_offline_is_one_clear_line() -> None:
    done = canvas_ls(
        "complete",
        str(STATS),
        "--line",
        "0",
        "--character",
        "0",
        "--model",
        "google/diffusiongemma-26B-A4B-it",
        env={"HF_HUB_OFFLINE": "1"},
    )
    assert "could not be fetched from the model hub" in one_line_error(done)


def test_position_past_the_end_is_one_clear_line(tiny_model_dir: Path) -> None:
    done = cli("complete", str(STATS), "--line", "500", "--character", "0", "--model", str(tiny_model_dir))
    assert "line 500 is past the end" in one_line_error(done)


def test_a_hub_id_the_hub_cannot_serve_fails_at_once_with_what_to_do() -> None:
    """Not a folder, not cached, and the hub's address refuses connections: said after one try, not the hub
    client's retries."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("huggingface_hub.constants.ENDPOINT", "http://127.0.0.1:9")
        done = cli("complete", str(STATS), "--line", "0", "--character", "0", "--model", "someone/no-such-model")
    line = one_line_error(done)
    assert line.startswith(
        "canvas-ls: error: model 'someone/no-such-model' is not a local folder, not in the Hugging Face cache, and the "
        "hub (http://127.0.0.1:9) cannot be reached from this machine ("
    )
    assert line.endswith("download it where the hub can be reached and pass its folder (--model /path/to/it)")


def test_a_character_past_the_end_of_its_line_names_the_lines_length(tiny_model_dir: Path) -> None:
    done = cli("complete", str(STATS), "--line", "0", "--character", "400", "--model", str(tiny_model_dir))
    length = len(STATS.read_text().splitlines()[0])
    assert one_line_error(done) == (
        f"canvas-ls: error: {STATS}: character 400 is past the end of line 0, which has {length} characters "
        f"(utf-16 code units, 0-based positions 0-{length})"
    )


def test_a_file_that_is_not_utf8_is_read_as_its_coding_line_says_or_refused_with_how_to_convert(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    declared = tmp_path / "declared.py"
    declared.write_bytes(b'# -*- coding: latin-1 -*-\nname = "caf\xe9"\nx = \n')
    done = cli("complete", str(declared), "--line", "2", "--character", "4", "--model", str(tiny_model_dir), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["prefix_tokens"] > 0
    plain = tmp_path / "plain.py"
    plain.write_bytes(b'name = "caf\xe9"\nx = \n')
    done = cli("complete", str(plain), "--line", "1", "--character", "4", "--model", str(tiny_model_dir))
    assert one_line_error(done) == (
        f"canvas-ls: error: {plain} is not UTF-8 (byte 0xe9 at offset 11); canvas-ls reads UTF-8, or the encoding a "
        f"Python file declares (# -*- coding: latin-1 -*-): convert it, e.g. iconv -f latin1 -t utf-8 {plain} > "
        f"{tmp_path / 'plain.utf8.py'}"
    )


def test_version_and_a_gpu_that_is_not_there() -> None:
    done = cli("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"canvas-ls 0.1.0 ({REPO})"
    import torch

    if torch.cuda.is_available():
        return
    done = cli("complete", str(STATS), "--line", "0", "--character", "0", "--device", "cuda")
    assert one_line_error(done) == (
        "canvas-ls: error: device 'cuda' was asked for, but this machine has no usable CUDA GPU: use --device cpu, "
        "or auto (a GPU when there is one)"
    )


def test_dtype_follows_the_cpu(tmp_path: Path) -> None:
    import pytest
    import torch

    from canvas_ls.engine.loading import ModelLoadError, cpu_has_native_bf16, resolve_dtype

    with_bf16, without = tmp_path / "bf16", tmp_path / "plain"
    with_bf16.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx512f avx512_bf16 avx512_vnni\n")
    without.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f\n")
    assert cpu_has_native_bf16(with_bf16, "AVX512") and not cpu_has_native_bf16(without, "AVX512")
    assert not cpu_has_native_bf16(with_bf16, "AVX2")  # torch's kernels held to AVX2: bf16 would be emulated
    assert not cpu_has_native_bf16(tmp_path / "missing")
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float32", torch.device("cpu")) == torch.float32
    assert resolve_dtype(None, torch.device("cpu")) == (torch.bfloat16 if cpu_has_native_bf16() else torch.float32)
    with pytest.raises(ModelLoadError, match="unknown dtype 'half'"):
        resolve_dtype("half", torch.device("cpu"))


def test_a_bf16_model_on_a_cpu_attends_in_fp32(tiny_model_dir: Path) -> None:
    """bf16 SDPA on a CPU keeps a JIT kernel per block shape for the process's life (the soak's engine growth);
    the engine runs a bf16 model's attention in fp32 there and bounds oneDNN's per-shape kernel caches."""
    import torch
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from canvas_ls.engine.loading import fp32_attention, load_model

    assert load_model(str(tiny_model_dir), "cpu", "float32").model.config._attn_implementation == "sdpa"
    model = load_model(str(tiny_model_dir), "cpu", "bfloat16").model
    assert model.config._attn_implementation == fp32_attention()
    assert int(os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"]) < 1024 and int(os.environ["LRU_CACHE_CAPACITY"]) < 1024

    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, 4, 37, 32, generator=generator).bfloat16() for _ in range(3))
    module = torch.nn.Module()
    module.is_causal = False
    out, _ = ALL_ATTENTION_FUNCTIONS[fp32_attention()](module, query, key, value, None, scaling=0.25)
    exact = torch.nn.functional.scaled_dot_product_attention(query.float(), key.float(), value.float(), scale=0.25)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, exact.transpose(1, 2).bfloat16())


def test_the_decoders_few_experts_run_dense_with_the_same_answers(tiny_model_dir: Path) -> None:
    """A model with few experts runs every decoder expert on every token (no sort or per-expert loop at a step's
    few dozen tokens); the encoder keeps transformers' grouped experts in fp32 and runs dense too in bf16 on a CPU
    (transformers' grouped matmul is slow there). Outputs equal the grouped ones (fp32), and so do the engine's
    answers."""
    import torch
    from transformers.integrations.moe import grouped_mm_experts_forward

    from canvas_ls.engine import Engine
    from canvas_ls.engine.compiled import graph_path
    from canvas_ls.engine.loading import decoder_experts, dense_experts

    dense = Engine.load(str(tiny_model_dir), "cpu", dtype="float32")
    model = dense.loaded.model
    assert decoder_experts(model) == dense_experts()
    assert model.model.encoder.language_model.layers[0].experts.config._experts_implementation != dense_experts()
    encoder_bf16 = Engine.load(str(tiny_model_dir), "cpu", dtype="bfloat16").loaded.model.model.encoder
    assert all(layer.experts.config._experts_implementation == dense_experts()
               for layer in encoder_bf16.language_model.layers)  # fmt: skip

    experts = model.model.decoder.layers[1].experts
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, experts.hidden_dim, generator=generator)
    scores = torch.randn(37, experts.num_experts, generator=generator).softmax(-1)
    weights, index = scores.topk(2, dim=-1)
    expected = grouped_mm_experts_forward(experts, hidden, index, weights)
    torch.testing.assert_close(experts(hidden, index, weights), expected, rtol=1e-6, atol=1e-6)

    grouped = Engine.load(str(tiny_model_dir), "cpu", dtype="float32")
    for layer in grouped.loaded.model.model.decoder.layers:
        layer.experts.config = grouped.loaded.model.config.get_text_config()
    assert decoder_experts(grouped.loaded.model) != dense_experts()
    assert graph_path(grouped.loaded.model, "1 row", "inductor") != graph_path(model, "1 row", "inductor")
    for prefix, suffix in (("def add(a, b):\n    return ", "\n"), ("import json\n\nvalue = json.", "(text)\n")):
        ours, theirs = dense.infill(prefix, suffix, {"seed": 3}), grouped.infill(prefix, suffix, {"seed": 3})
        assert ours.tokens == theirs.tokens and ours.steps == theirs.steps


def test_complete_runs_in_the_dtype_asked_for(tiny_model_dir: Path) -> None:
    for dtype in ("float32", "bfloat16"):
        done = cli("complete", str(STATS), "--line", "19", "--character", "11",
                         "--model", str(tiny_model_dir), "--dtype", dtype, "--json")  # fmt: skip
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)
        assert result["dtype"] == dtype and result["steps"] >= 1


def test_fill_prints_each_region_and_the_filled_file(tiny_model_dir: Path) -> None:
    """`canvas-ls fill` with two holes and a rewrite (LSP ranges, given out of order): one canvas, answers per
    region in the order given; without --json, the file with the fills in place."""
    common = ("--model", str(tiny_model_dir), "--set", "max_steps=4", "--set", "max_new_tokens=8")
    regions = ("--hole", "8:4-8:36", "--hole", "2:0-2:30", "--rewrite", "19:4-19:20", "--strength", "0.4")
    done = cli("fill", str(STATS), *regions, *common, "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert [r["range"]["start"]["line"] for r in report["regions"]] == [8, 2, 19]
    assert [r["strength"] for r in report["regions"]] == [1.0, 1.0, 0.4]
    assert all(r["stop_reason"] in ("eos", "truncated") and "text" in r for r in report["regions"])
    assert len(report["result"]["gaps"]) == 3 and report["result"]["forward_passes"] == report["result"]["steps"]
    plain = cli("fill", str(STATS), *regions, *common)
    lines = STATS.read_text().split("\n")
    offsets = [sum(len(line) + 1 for line in lines[:number]) for number in range(len(lines))]
    filled = STATS.read_text()
    for region in sorted(report["regions"], key=lambda r: r["range"]["start"]["line"], reverse=True):
        start, end = region["range"]["start"], region["range"]["end"]
        at, to = offsets[start["line"]] + start["character"], offsets[end["line"]] + end["character"]
        filled = filled[:at] + region["text"] + filled[to:]
    assert plain.stdout == filled  # each answer in its region, the rest of the file as it was


@pytest.mark.parametrize(
    ("regions", "message"),
    [
        (("--hole", "2:0-2:30", "--hole", "2:10-2:31"), "regions 1 and 2 overlap"),
        (("--hole", "5:0-2:0"), "region 1 is reversed"),
        (("--hole", "900:0-901:0"), "past the end"),
        (("--hole", "2:0"), "is not a range L:C-L:C"),
        ((), "give at least one --hole or --rewrite"),
    ],
)
def test_fill_errors_are_one_clear_line(tiny_model_dir: Path, regions: tuple[str, ...], message: str) -> None:
    done = cli("fill", str(STATS), *regions, "--model", str(tiny_model_dir))
    assert done.returncode == 2 and message in done.stderr and done.stdout == ""
