"""Log-probs and entropies from logits: full vocabulary against naive float64 loops, and the
vocab-parallel versions (values and gradients) against the full vocabulary on 2 real gloo ranks."""
import math

import pytest
import torch

from hybridrl.algorithms import (
    entropy_from_logits,
    log_prob_from_logits,
    vocab_parallel_entropy,
    vocab_parallel_log_prob,
)
from hybridrl.parallel.forked import run_ranks

F64 = torch.float64
# The ranks need torch only; skipping the launcher's default megatron preload saves seconds.
RANK_PRELOAD = ("torch", "hybridrl.algorithms.vocab_parallel", "hybridrl.algorithms.aggregation")


def naive_log_softmax(row):
    top = max(row)
    log_z = top + math.log(sum(math.exp(v - top) for v in row))
    return [v - log_z for v in row]


def naive_entropy(row):
    return -sum(math.exp(lp) * lp for lp in naive_log_softmax(row) if lp != -math.inf)


def sample_logits(seed: int, vocab: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(2, 3, vocab, generator=gen, dtype=F64)
    logits[0, 0, vocab - 1] = 1e4  # a dominant logit in the last shard: global max matters
    logits[1, 2, :] -= 2e4  # all very negative: exp underflows without the shift
    labels = torch.randint(0, vocab, (2, 3), generator=gen)
    labels[0, 0], labels[0, 1], labels[1, 0] = vocab - 1, 0, vocab // 2
    return logits, labels


def test_full_vocab_log_prob_and_entropy_against_naive():
    logits, labels = sample_logits(0)
    log_prob = log_prob_from_logits(logits, labels)
    entropy = entropy_from_logits(logits)
    for index in [(b, t) for b in range(2) for t in range(3)]:
        row = logits[index].tolist()
        # The naive loop itself loses ~1e-12 subtracting logits of 2e4 from each other.
        assert log_prob[index].item() == pytest.approx(naive_log_softmax(row)[labels[index]], abs=1e-10)
        assert entropy[index].item() == pytest.approx(naive_entropy(row), abs=1e-10)


def test_full_vocab_low_precision_math_in_float32_and_banned_tokens():
    logits = torch.tensor([[2.0, 0.0, -math.inf, 1.0]], dtype=torch.bfloat16, requires_grad=True)
    entropy = entropy_from_logits(logits)
    log_prob = log_prob_from_logits(logits, torch.tensor([3]))
    assert entropy.dtype == torch.float32 and log_prob.dtype == torch.float32
    assert entropy.item() == pytest.approx(naive_entropy([2.0, 0.0, -math.inf, 1.0]), rel=1e-6)
    assert log_prob.item() == pytest.approx(naive_log_softmax([2.0, 0.0, -math.inf, 1.0])[3], rel=1e-6)
    entropy.sum().backward()
    assert torch.isfinite(logits.grad.float()).all()


def test_full_vocab_entropy_gradient_against_finite_differences():
    logits = torch.randn(2, 5, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(entropy_from_logits, (logits,))


def test_vocab_parallel_without_distributed_is_the_full_vocab():
    logits, labels = sample_logits(1)
    torch.testing.assert_close(vocab_parallel_log_prob(logits, labels), log_prob_from_logits(logits, labels))
    torch.testing.assert_close(vocab_parallel_entropy(logits), entropy_from_logits(logits))


def _shard_results(rank: int, world_size: int, logits: torch.Tensor, labels: torch.Tensor, weights):
    """Run on each gloo rank: log-prob and entropy of this rank's vocab slice, and their gradients."""
    shard_size = logits.shape[-1] // world_size
    results = {}
    for dtype in (F64, torch.bfloat16):
        shard = logits[..., rank * shard_size:(rank + 1) * shard_size].to(dtype).clone().requires_grad_()
        log_prob = vocab_parallel_log_prob(shard, labels)
        entropy = vocab_parallel_entropy(shard)
        (grad_log_prob,) = torch.autograd.grad((log_prob * weights).sum(), shard)
        (grad_entropy,) = torch.autograd.grad((entropy * weights).sum(), shard)
        results[str(dtype)] = (log_prob.detach(), entropy.detach(), grad_log_prob, grad_entropy)
    return results


def test_vocab_parallel_matches_full_vocab_on_two_gloo_ranks():
    world_size, vocab = 2, 10
    logits, labels = sample_logits(2, vocab)
    weights = torch.randn(2, 3, generator=torch.Generator().manual_seed(3), dtype=F64)
    per_rank = run_ranks(
        _shard_results, world_size, logits, labels, weights, timeout_s=120, preload=RANK_PRELOAD
    )

    for dtype, tol in ((F64, 1e-10), (torch.bfloat16, 2e-2)):
        full = logits.to(dtype).to(F64).requires_grad_()
        ref_log_prob = log_prob_from_logits(full, labels)
        ref_entropy = entropy_from_logits(full)
        # The log-prob gradient written out independently: weight * (onehot(label) - softmax).
        probs = torch.softmax(full.detach(), dim=-1)
        ref_grad_log_prob = weights[..., None] * (torch.nn.functional.one_hot(labels, vocab) - probs)
        (ref_grad_entropy,) = torch.autograd.grad((ref_entropy * weights).sum(), full)
        for rank, results in enumerate(per_rank):
            log_prob, entropy, grad_log_prob, grad_entropy = results[str(dtype)]
            assert log_prob.dtype == entropy.dtype == (F64 if dtype == F64 else torch.float32)
            assert grad_log_prob.dtype == dtype
            shard = slice(rank * vocab // world_size, (rank + 1) * vocab // world_size)
            torch.testing.assert_close(log_prob.to(F64), ref_log_prob.detach(), rtol=tol, atol=tol)
            torch.testing.assert_close(entropy.to(F64), ref_entropy.detach(), rtol=tol, atol=tol)
            for grad, ref_grad in ((grad_log_prob, ref_grad_log_prob), (grad_entropy, ref_grad_entropy)):
                torch.testing.assert_close(grad.to(F64), ref_grad[..., shard], rtol=tol, atol=tol)
