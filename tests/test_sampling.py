"""The fused sampler step (Triton, run by its interpreter on the CPU) against the torch reference, and the
small-tensor acceptance and stopping rules against transformers' own classes."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
    EntropyBoundSampler,
    EntropyBoundSamplerConfig,
    StableAndConfidentStoppingCriteria,
)

from canvas_ls.engine.sampling import (
    EntropyStableAndConfident,
    SeededEntropyBoundSampler,
    logsumexp_sliced,
    step_stats_fused,
    step_stats_torch,
)


def generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize(
    ("rows", "vocab", "block", "dtype"),
    [
        (1, 1000, 256, torch.float32),  # a canvas of 1, vocab not a multiple of the block
        (7, 5003, 1024, torch.float32),
        (16, 4096, 1024, torch.bfloat16),  # the model's dtype on GPU
    ],
)
@pytest.mark.parametrize("temperature", [0.4, 1.0, 1.7])
def test_fused_matches_the_torch_reference(rows: int, vocab: int, block: int, dtype: torch.dtype,
                                           temperature: float) -> None:  # fmt: skip
    logits = (torch.randn(rows, vocab, generator=generator(rows)) * 4).to(dtype)
    fused = step_stats_fused(logits, temperature, generator(), block=block)
    reference = step_stats_torch(logits, temperature, generator())
    assert torch.equal(fused.argmax, reference.argmax)
    torch.testing.assert_close(fused.entropy, reference.entropy, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fused.lse, reference.lse, atol=1e-4, rtol=1e-5)
    assert fused.sample.min() >= 0 and fused.sample.max() < vocab


@pytest.mark.parametrize(
    ("vocab", "columns", "dtype"),
    [(5003, 1024, torch.float32), (4096, 1024, torch.bfloat16), (70000, 16384, torch.float32)],
)
def test_the_sliced_cpu_pass_answers_as_the_whole_row(vocab: int, columns: int, dtype: torch.dtype) -> None:
    """A vocabulary wider than a slice is read slice by slice (the last one partial): the same argmax and the same
    draws from the same uniforms as one pass over the whole row, its log-sum-exp and entropy within float
    rounding; a barred token (probability zero) is never drawn, nor is a column past the vocabulary."""
    logits = (torch.randn(24, vocab, generator=generator(vocab)) * 4).to(dtype)
    logits[:, vocab - 1] = -1e9  # barred, and in the partial slice
    logits[5, vocab - 2] = 60.0  # a row whose mass sits in the partial slice
    logits[6, 10] = 60.0  # ...and one in the first
    sliced = step_stats_torch(logits, 0.7, generator(1), columns=columns)
    whole = step_stats_torch(logits, 0.7, generator(1), columns=vocab)
    assert torch.equal(sliced.argmax, whole.argmax) and sliced.argmax[5] == vocab - 2 and sliced.argmax[6] == 10
    assert torch.equal(sliced.sample, whole.sample) and sliced.sample[5] == vocab - 2 and sliced.sample[6] == 10
    torch.testing.assert_close(sliced.lse, whole.lse, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(sliced.entropy, whole.entropy, atol=1e-4, rtol=1e-4)
    draws = step_stats_torch(logits[:1].expand(4000, vocab), 0.7, generator(2), columns=columns).sample
    assert draws.max() < vocab - 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_sliced_log_sum_exp_is_torchs(dtype: torch.dtype) -> None:
    """What the self-conditioning and the token cache read instead of a softmax over the vocabulary: torch's
    logsumexp of the scaled logits, of chosen rows too, with the logits left as they were."""
    logits = (torch.randn(2, 6, 1003, generator=generator(4)) * 5).to(dtype)
    before = logits.clone()
    expected = torch.logsumexp(logits.float() / 0.7, dim=-1)
    torch.testing.assert_close(logsumexp_sliced(logits, 1 / 0.7, columns=256), expected, atol=1e-5, rtol=1e-6)
    rows = torch.tensor([4, 1])
    flat = logits[0]
    torch.testing.assert_close(logsumexp_sliced(flat, rows=rows, columns=100), torch.logsumexp(flat[rows].float(), -1))
    assert torch.equal(logits, before)


def test_sliced_samples_follow_the_softmax() -> None:
    """The sliced pass's draws (11 tokens in slices of 4, the last of 3) from one distribution: chi-square
    goodness-of-fit over 5,000 draws."""
    vocab, draws, temperature = 11, 5000, 0.8
    logits = torch.randn(vocab, generator=generator(3)) * 0.8
    stats = step_stats_torch(logits.expand(draws, vocab), temperature, generator(11), columns=4)
    counts = torch.bincount(stats.sample, minlength=vocab).double()
    expected = torch.softmax(logits.double() / temperature, dim=-1) * draws
    chi_square = float(((counts - expected) ** 2 / expected).sum())
    dof = vocab - 1
    assert chi_square < dof + 6 * math.sqrt(2 * dof), chi_square


def test_fused_samples_follow_the_softmax() -> None:
    """250 independent draws from one distribution (11 tokens, blocks of 4): a chi-square goodness-of-fit.
    (Each row is one program in Triton's interpreter, which runs them one by one: hence a small vocabulary.)"""
    vocab, draws, temperature = 11, 250, 0.8
    logits = torch.randn(vocab, generator=generator(3)) * 0.8
    stats = step_stats_fused(logits.expand(draws, vocab).contiguous(), temperature, generator(11), block=4)
    counts = torch.bincount(stats.sample, minlength=vocab).double()
    expected = torch.softmax(logits.double() / temperature, dim=-1) * draws
    chi_square = float(((counts - expected) ** 2 / expected).sum())
    dof = vocab - 1
    assert chi_square < dof + 6 * math.sqrt(2 * dof), chi_square  # p well below 1e-3 for a wrong distribution
    # ...and the test has power: the same counts are far from a distribution at another temperature.
    wrong = torch.softmax(logits.double() / (2 * temperature), dim=-1) * draws
    assert float(((counts - wrong) ** 2 / wrong).sum()) > chi_square


def test_fused_sampling_is_deterministic_under_a_seed() -> None:
    logits = torch.randn(8, 300, generator=generator(5))
    first = step_stats_fused(logits, 1.0, generator(9), block=128).sample
    again = step_stats_fused(logits, 1.0, generator(9), block=128).sample
    assert torch.equal(first, again)


def test_entropy_acceptance_matches_transformers_sampler() -> None:
    config = EntropyBoundSamplerConfig(entropy_bound=0.7)
    ours = SeededEntropyBoundSampler(config, 24, 500, 8, generator())
    theirs = EntropyBoundSampler(config, 24, 500, 8)
    for seed in range(5):
        logits = torch.randn(2, 24, 500, generator=generator(seed)) * (seed + 1)
        current = torch.randint(0, 500, (2, 24), generator=generator(seed + 100))
        proposal = torch.randint(0, 500, (2, 24), generator=generator(seed + 200))
        entropy = step_stats_torch(logits.view(-1, 500), 1.0, generator()).entropy.view(2, 24)
        assert torch.equal(ours.accept_entropy(current, proposal, entropy),
                           theirs.accept_canvas(current, proposal, logits, 1))  # fmt: skip
        assert torch.equal(ours.accepted_token_mask, theirs.accepted_token_mask)


def test_entropy_stopping_matches_transformers_criterion() -> None:
    ours = EntropyStableAndConfident(stability_threshold=2, confidence_threshold=0.5)
    theirs = StableAndConfidentStoppingCriteria(stability_threshold=2, confidence_threshold=0.5)
    canvas = torch.randint(0, 50, (1, 6), generator=generator(1))
    for step in range(8):
        sharp = step >= 3  # confident from step 3, the argmax canvas stable from step 2
        logits = torch.randn(1, 6, 50, generator=generator(step)) * (40 if sharp else 1)
        logits[0, torch.arange(6), canvas[0]] += 60 if sharp else 0
        argmax = canvas if step >= 2 else torch.randint(0, 50, (1, 6), generator=generator(step + 30))
        entropy = step_stats_torch(logits.view(-1, 50), 1.0, generator()).entropy.view(1, 6)
        assert torch.equal(ours(argmax, token_entropy=entropy), theirs(argmax, logits)), step


def test_bench_sampler_reports_torch_and_leaves_fused_to_cuda() -> None:
    from canvas_ls.bench.core import format_sampler, run_sampler

    report = run_sampler("cpu", canvases=(4,), vocabs=(100,), steps=2)
    [row] = report["rows"]
    assert row["torch_ms"] > 0 and row["fused_ms"] is None
    assert "runs on CUDA only" in format_sampler(report)


def test_torch_samples_follow_the_softmax() -> None:
    vocab, draws, temperature = 11, 4000, 0.8
    logits = torch.randn(vocab, generator=generator(3)) * 0.8
    stats = step_stats_torch(logits.expand(draws, vocab).contiguous(), temperature, generator(12))
    counts = torch.bincount(stats.sample, minlength=vocab).double()
    expected = torch.softmax(logits.double() / temperature, dim=-1) * draws
    dof = vocab - 1
    assert float(((counts - expected) ** 2 / expected).sum()) < dof + 6 * math.sqrt(2 * dof)


def test_rows_batched_match_rows_alone() -> None:
    """step_stats_rows on a padded batch gives each row what it gets alone, from the same generator state."""
    from canvas_ls.engine.sampling import step_stats_rows

    torch.manual_seed(5)
    logits = torch.randn(3, 6, 40)
    lengths, temperatures, seeds = [6, 2, 4], [1.0, 0.5, 0.8], [1, 2, 3]
    together = step_stats_rows(logits, temperatures, [generator(s) for s in seeds], lengths)
    for row, (n, t, s) in enumerate(zip(lengths, temperatures, seeds, strict=True)):
        alone = step_stats_rows(logits[row : row + 1, :n], [t], [generator(s)], [n])[0]
        for field in ("sample", "argmax", "entropy", "lse"):
            assert getattr(together[row], field).shape == (1, n)
            assert torch.equal(getattr(together[row], field), getattr(alone, field)), field
