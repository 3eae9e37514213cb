"""Training pieces: corpus rules, tokenizer, the in-canvas examples, and a short run that lowers the loss."""

from __future__ import annotations

import gzip
import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import DiffusionGemmaForBlockDiffusion

from canvas_ls.engine.architecture import small_config
from canvas_ls.engine.corpus import CorpusFile, decontamination_report, is_permissive
from canvas_ls.engine.examples import BatchStream, ExampleSampler, collate
from canvas_ls.engine.loss import CHUNK_ROWS, softcapped_cross_entropy
from canvas_ls.engine.tokenizer import TokenHealing, train_tokenizer
from canvas_ls.engine.training import TrainConfig, evaluate, train
from tests.conftest import tokenizer_texts


def corpus_files() -> list[CorpusFile]:
    return [CorpusFile(f"f{i}.py", "python", "test", text) for i, text in enumerate(tokenizer_texts())]


def test_licences() -> None:
    assert is_permissive("MIT")
    assert is_permissive("BSD-3-Clause | License :: OSI Approved :: BSD License")
    assert not is_permissive("MPL-2.0")
    assert not is_permissive("public domain, Python, 2-Clause BSD, GPL 3 (see COPYING.txt)")
    assert not is_permissive("UNKNOWN")


def test_tokenizer_round_trips_code(tmp_path: Path) -> None:
    tokenizer = train_tokenizer(tokenizer_texts(), 400, tmp_path)
    samples = ["def f(x):\n\treturn x  # café ✓\r\n", "", "   \n\n", "naïve = '日本語'\x00\x7f"]
    for text in samples:
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id) == (0, 1, 2)


def test_decontamination_finds_a_copied_solution(tmp_path: Path) -> None:
    task = {"task_id": "SingleLineInfilling/HumanEval/7/L0", "entry_point": "f", "test": "",
            "prompt": "def below_zero(operations):\n    balance = 0\n    for op in operations:\n",
            "canonical_solution": "        balance += op\n        if balance < 0:\n            return True\n",
            "suffix": "    return False\n"}  # fmt: skip
    path = tmp_path / "eval.jsonl.gz"
    with gzip.open(path, "wt") as sink:
        sink.write(json.dumps(task) + "\n")
    clean = decontamination_report(corpus_files(), [path])
    assert clean["problems_with_overlap"] == 0
    copied = [*corpus_files(), CorpusFile("x.py", "python", "t", task["prompt"] + task["canonical_solution"])]
    assert decontamination_report(copied, [path])["overlapping_problem_ids"] == ["7"]


def test_examples_cut_the_text_as_the_engine_will_see_it(tmp_path: Path) -> None:
    tokenizer = train_tokenizer(tokenizer_texts(), 400, tmp_path)
    sampler = ExampleSampler(corpus_files(), tokenizer, seed=0, prefix_tokens=64, head_tokens=8)
    for _ in range(50):
        example = sampler.example(gap_tokens=16)
        assert example.prefix[0] == tokenizer.bos_token_id and len(example.prefix) <= 64
        assert len(example.gap) == 16 and len(example.head) <= 8
        if example.middle_len == 16:
            continue  # a middle longer than the gap: the gap holds its start and no EOS (the answer goes on)
        assert example.gap[example.middle_len :] == [tokenizer.eos_token_id] * (16 - example.middle_len)
        joined = tokenizer.decode(example.prefix[1:] + example.gap[: example.middle_len] + example.head)
        assert any(joined in f.text for f in corpus_files()), joined  # one contiguous span of one file


def test_editor_examples_start_after_a_lines_indentation_and_leave_its_newline(tmp_path: Path) -> None:
    """`editor_share`: examples cut where an editor asks (the cursor after a line's indentation, the middle its code
    through the end of the line or of a few lines); 0 keeps the old mix draw for draw."""
    tokenizer = train_tokenizer(tokenizer_texts(), 400, tmp_path)
    editor = ExampleSampler(corpus_files(), tokenizer, 0, 64, 8, editor_share=1.0)
    spans = 0
    for _ in range(200):
        rng_state = editor.rng.getstate()
        text = editor.rng.choice(editor.files).text
        editor.rng.setstate(rng_state)
        example = editor.example(gap_tokens=64)
        if not example.middle_len or example.middle_len == 64:
            continue
        prefix = tokenizer.decode(example.prefix[1:])
        middle = tokenizer.decode(example.gap[: example.middle_len])
        suffix = tokenizer.decode(example.head)
        assert text.count(prefix + middle + suffix) >= 1
        assert prefix.endswith("\n") or prefix.split("\n")[-1].strip(" \t") == ""  # the cursor at a line's code
        assert middle.strip() and not middle.endswith("\n") and suffix.startswith("\n")  # the newline in the suffix
        spans += 1
    assert spans > 100
    plain = ExampleSampler(corpus_files(), tokenizer, 3, 64, 8)
    zero = ExampleSampler(corpus_files(), tokenizer, 3, 64, 8, editor_share=0.0)
    assert all(plain.example(16) == zero.example(16) for _ in range(50))


def test_examples_are_cut_where_the_engine_heals(tmp_path: Path) -> None:
    """With healing, an example's prefix ends where the engine would cut the same prefix back (and the middle starts
    with the cut text); the same seed draws the same cuts either way."""
    tokenizer = train_tokenizer(tokenizer_texts(), 400, tmp_path)
    healing = TokenHealing(tokenizer, len(tokenizer))
    plain = ExampleSampler(corpus_files(), tokenizer, 0, 64, 8)
    healed = ExampleSampler(corpus_files(), tokenizer, 0, 64, 8, healing)
    moved = 0
    for _ in range(300):
        before, after = plain.example(gap_tokens=16), healed.example(gap_tokens=16)
        if not before.middle_len:
            continue
        text = tokenizer.decode(before.prefix[1:])
        cut = healing.cut(text)
        assert tokenizer.decode(after.prefix[1:])[-40:] == text[: len(text) - len(cut)][-40:]
        assert tokenizer.decode(after.gap).startswith(cut)
        moved += bool(cut)
    assert moved > 10  # the sampler cuts at any character: many prefixes end in a space or inside a word


def short_run(model: Any, tokenizer: Any, out: Path, **config: Any) -> tuple[dict, dict, dict]:
    """Train `model` briefly on the test corpus, a number of steps (the time budget only a bound: a loaded machine
    takes longer, it does not train less); (held-out losses before, the run's summary, held-out losses after)."""
    files = corpus_files()
    cfg = TrainConfig(**{"minutes": 5.0, "max_steps": 24, "batch_size": 8, "prefix_tokens": 64, "head_tokens": 8,
                         "gap_choices": (16,), "lr": 3e-3, "warmup_steps": 5, "eval_every": 1000, "log_every": 5,
                         **config})  # fmt: skip
    held_out = ExampleSampler(files, tokenizer, 7, 64, 8)
    batches = [collate([held_out.example(16) for _ in range(8)], tokenizer.pad_token_id) for _ in range(3)]
    before = evaluate(model, batches, cfg.bf16)
    summary = train(model, tokenizer, files, files, cfg, out)
    return before, summary, evaluate(model, batches, cfg.bf16)


def test_a_short_run_lowers_the_loss(tmp_path: Path) -> None:
    tokenizer = train_tokenizer(tokenizer_texts(), 400, tmp_path / "tok")
    torch.manual_seed(0)
    model = DiffusionGemmaForBlockDiffusion(small_config(len(tokenizer)))
    before, summary, after = short_run(model, tokenizer, tmp_path / "run")
    assert summary["step"] == 24 and summary["stopped"] == "steps"
    assert after["diffusion"] < before["diffusion"] and after["ar"] < before["ar"]
    assert (tmp_path / "run" / "checkpoint.pt").is_file()
    records = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert all(r["data_s_per_step"] >= 0 for r in records if "step" in r)


def test_a_run_with_a_moving_average_exports_the_average_of_its_weights(tmp_path: Path) -> None:
    """`ema`: the model a run leaves is the moving average of the weights after each step, started from the weights
    it started from; evaluating it in between (swapping the average in and out) does not disturb the training."""
    tokenizer = train_tokenizer(tokenizer_texts(), 400, tmp_path / "tok")

    def weights_after(steps: int, **config: Any) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = DiffusionGemmaForBlockDiffusion(small_config(len(tokenizer)))
        if steps:
            short_run(model, tokenizer, tmp_path / f"run-{steps}-{len(config)}", max_steps=steps, batch_size=4,
                      prefix_tokens=48, head_tokens=4, gap_choices=(8,), **config)  # fmt: skip
        return [p.detach().clone() for p in model.parameters()]

    w0, w1, w2 = weights_after(0), weights_after(1), weights_after(2)
    averaged = weights_after(2, ema=0.5, eval_every=1, log_every=1)  # a held-out evaluation after each step
    # decay 0.5: 0.5 * (0.5 * w0 + 0.5 * w1) + 0.5 * w2
    expected = [0.25 * a + 0.25 * b + 0.5 * c for a, b, c in zip(w0, w1, w2, strict=True)]
    assert any(not torch.equal(a, c) for a, c in zip(averaged, w2, strict=True))
    for got, want in zip(averaged, expected, strict=True):
        torch.testing.assert_close(got, want)


def test_data_workers_cut_batches_of_their_own(tmp_path: Path) -> None:
    """On a GPU, batches come from DataLoader workers: each worker cuts different examples, in the loop's format."""
    tokenizer = train_tokenizer(tokenizer_texts(), 400, tmp_path / "tok")
    cfg = TrainConfig(batch_size=4, prefix_tokens=64, head_tokens=8, gap_choices=(16,))
    stream = BatchStream(corpus_files(), tokenizer, 0, cfg, None)
    inline = next(stream.batches(0, pin_memory=False))
    workers = stream.batches(2, pin_memory=False)
    first, second = next(workers), next(workers)  # one from each worker
    assert first.prefix.shape[0] == second.prefix.shape[0] == 4 and first.gap.shape == inline.gap.shape == (4, 16)
    assert not torch.equal(first.gap, second.gap)


def test_the_fused_head_loss_is_the_models_softcapped_cross_entropy() -> None:
    """Chunked head + soft-cap + cross-entropy: the loss and gradients of the model's logits through F.cross_entropy."""
    torch.manual_seed(0)
    rows, width, vocab, cap = 3 * CHUNK_ROWS["cpu"] + 17, 32, 500, 30.0  # several chunks, the last one partial
    hidden = torch.randn(rows, width, requires_grad=True)
    weight = (3 * torch.randn(vocab, width)).requires_grad_()
    targets = torch.randint(0, vocab, (rows,))
    row_weights = torch.rand(rows)
    row_weights[::7] = 0.0  # padding rows: skipped, no gradient
    expected = softcapped_cross_entropy(hidden, weight, targets, row_weights, cap, fused=False)
    logits = torch.tanh(hidden @ weight.T / cap) * cap  # the model's soft-capped head, by hand
    torch.testing.assert_close(expected, (F.cross_entropy(logits, targets, reduction="none") * row_weights).sum())
    expected_grads = torch.autograd.grad(2 * expected, (hidden, weight))
    got = softcapped_cross_entropy(hidden, weight, targets, row_weights, cap)
    got_grads = torch.autograd.grad(2 * got, (hidden, weight))
    torch.testing.assert_close(got, expected)
    for g, e in zip(got_grads, expected_grads, strict=True):
        torch.testing.assert_close(g, e)
    assert bool((got_grads[0][::7] == 0).all())
    with torch.no_grad():  # evaluation: the loss alone
        torch.testing.assert_close(softcapped_cross_entropy(hidden, weight, targets, row_weights, cap), expected)


def test_several_gaps_cut_one_run_of_code(tmp_path: Path) -> None:
    """A several-gap example is one contiguous span of a file: prefix, gap 1's middle, the clamped code, gap 2's
    middle, ..., the suffix head; each gap holds its middle then EOS."""
    tokenizer = train_tokenizer(tokenizer_texts(), 400, tmp_path)
    sampler = ExampleSampler(corpus_files(), tokenizer, 0, 64, 8, multi_share=1.0)
    eos, seen = tokenizer.eos_token_id, 0
    for _ in range(60):
        example = sampler.example(gap_tokens=16)
        if example.gaps == 1:
            continue  # no run of lines in this file fitted: a plain example
        seen += 1
        assert 2 <= example.gaps <= 4 and sum(example.head_gap) == 16 * (example.gaps - 1)
        pieces = [example.gap[: example.middle_len]]
        slots = list(zip(example.head, example.head_gap, example.head_weight, strict=True))
        while slots:
            clamped = [t for t, _, _ in itertools.takewhile(lambda s: not s[1], slots)]
            slots = slots[len(clamped) :]
            gap, slots = slots[:16], slots[16:]
            tokens = [t for t, _, _ in gap]
            middle = tokens[: tokens.index(eos)] if eos in tokens else tokens
            assert tokens[len(middle) :] == [eos] * (len(tokens) - len(middle))
            if gap:  # its middle and first EOS weigh 1/k of the example (its EOS fill a little more)
                assert sum(w for _, _, w in gap[: len(middle) + 1]) == pytest.approx(1 / example.gaps)
            pieces += [clamped, middle]
        joined = tokenizer.decode(example.prefix[1:] + [t for piece in pieces for t in piece])
        assert any(joined in f.text for f in corpus_files()), joined
        batch = collate([example], tokenizer.pad_token_id)
        counted = min(example.middle_len + 1, 16)
        assert float(batch.gap_weight[0, :counted].sum()) == pytest.approx(1 / example.gaps)
    assert seen >= 5  # the tiny tokenizer spells lines in many tokens: most runs do not fit 16-slot gaps


def test_rewrite_examples_show_a_corrupted_middle(tmp_path: Path) -> None:
    tokenizer = train_tokenizer(tokenizer_texts(), 400, tmp_path)
    sampler = ExampleSampler(corpus_files(), tokenizer, 0, 64, 8, rewrite_share=1.0)
    changed = 0
    for _ in range(40):
        example = sampler.example(gap_tokens=16)
        if example.start is None:
            assert example.middle_len == 0 or len(example.prefix) < 2  # nothing to corrupt, or to corrupt with
            continue
        differs = [i for i, (a, b) in enumerate(zip(example.start, example.gap, strict=True)) if a != b]
        assert all(i < example.middle_len for i in differs)  # only middle tokens, never the EOS fill
        changed += bool(differs)
        batch = collate([example], tokenizer.pad_token_id)
        assert batch.gap_start[0].tolist() == example.start and batch.gap[0].tolist() == example.gap
    assert changed > 10


@pytest.mark.parametrize("git", [True, False])
def test_a_repository_corpus_takes_its_own_source_and_says_what_it_left(tmp_path: Path, git: bool) -> None:
    import subprocess

    from canvas_ls.engine.corpus import collect_repository

    body = "".join(f"def f{i}(x):\n    return x + {i}\n\n\n" for i in range(4))
    files = {
        "app/main.py": body,
        "app/util.py": body.replace("x +", "x *"),
        "app/copy.py": body,  # the same text as main.py
        "vendor/lib.py": body.replace("x +", "x -"),
        "node_modules/pkg/index.js": "module.exports = 1;\n" * 6,
        ".env": "API_KEY=secret\n" * 6,
        "deploy/server.key": "-----BEGIN PRIVATE KEY-----\n" * 6,
        "web/app.min.js": "var a=1;" * 10,
        "app/proto_pb2.py": "# Generated by the protocol buffer compiler.  DO NOT EDIT!\n" + body,
        "app/blob.py": "x = 1\n" * 5 + "\0",
        "ignored/notes.py": body.replace("x +", "x **"),
        "README.md": "# readme\n" * 6,
        ".gitignore": "ignored/\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    if git:
        subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    taken, report = collect_repository(tmp_path)
    assert [f.path for f in taken] == ["app/copy.py", "app/util.py"]  # of two copies, the first in path order
    assert report["listed_by"].startswith("git ls-files" if git else "a walk of the folder (its .gitignore")
    skipped = report["skipped"]
    assert skipped["duplicate"] == 1 and skipped["secret"] == 2 and skipped["binary"] == 1
    assert skipped["generated"] == 1 and skipped["minified or data"] == 1 and skipped["not source"] == 2
    assert skipped["vendored or build output"] == 2  # vendor/ and node_modules/; ignored/ never listed
    assert report["files"] == 2 and not any("ignored" in f.path for f in taken)
