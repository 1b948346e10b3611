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
from hybridrl.algorithms.vocab_parallel import vocab_parallel_log_prob_and_entropy
from tests.support.forked import run_ranks

F64 = torch.float64


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
        # the fused pass: both values, both gradients (entropy_grad) or the log-prob's alone
        fused_log_prob, fused_entropy = vocab_parallel_log_prob_and_entropy(shard, labels)
        (fused_grad_log_prob,) = torch.autograd.grad((fused_log_prob * weights).sum(), shard, retain_graph=True)
        (fused_grad_entropy,) = torch.autograd.grad((fused_entropy * weights).sum(), shard)
        metric_log_prob, metric_entropy = vocab_parallel_log_prob_and_entropy(shard, labels, entropy_grad=False)
        assert not metric_entropy.requires_grad
        (metric_grad_log_prob,) = torch.autograd.grad((metric_log_prob * weights).sum(), shard)
        results["fused " + str(dtype)] = (fused_log_prob.detach(), fused_entropy.detach(), fused_grad_log_prob,
                                          fused_grad_entropy)
        results["metric " + str(dtype)] = (metric_log_prob.detach(), metric_entropy, metric_grad_log_prob,
                                           grad_entropy)  # no entropy gradient: the separate one stands in
    return results


def test_vocab_parallel_matches_full_vocab_on_two_gloo_ranks():
    world_size, vocab = 2, 10
    logits, labels = sample_logits(2, vocab)
    weights = torch.randn(2, 3, generator=torch.Generator().manual_seed(3), dtype=F64)
    per_rank = run_ranks(
        _shard_results, world_size, logits, labels, weights, timeout_s=120
    )

    for dtype, tol in ((F64, 1e-10), (torch.bfloat16, 2e-2)):
        full = logits.to(dtype).to(F64).requires_grad_()
        ref_log_prob = log_prob_from_logits(full, labels)
        ref_entropy = entropy_from_logits(full)
        # The log-prob gradient written out independently: weight * (onehot(label) - softmax).
        probs = torch.softmax(full.detach(), dim=-1)
        ref_grad_log_prob = weights[..., None] * (torch.nn.functional.one_hot(labels, vocab) - probs)
        (ref_grad_entropy,) = torch.autograd.grad((ref_entropy * weights).sum(), full)
        for rank, results, kind in [(r, res, k) for r, res in enumerate(per_rank) for k in ("", "fused ", "metric ")]:
            log_prob, entropy, grad_log_prob, grad_entropy = results[kind + str(dtype)]
            assert log_prob.dtype == entropy.dtype == (F64 if dtype == F64 else torch.float32)
            assert grad_log_prob.dtype == dtype
            shard = slice(rank * vocab // world_size, (rank + 1) * vocab // world_size)
            torch.testing.assert_close(log_prob.to(F64), ref_log_prob.detach(), rtol=tol, atol=tol)
            torch.testing.assert_close(entropy.to(F64), ref_entropy.detach(), rtol=tol, atol=tol)
            for grad, ref_grad in ((grad_log_prob, ref_grad_log_prob), (grad_entropy, ref_grad_entropy)):
                torch.testing.assert_close(grad.to(F64), ref_grad[..., shard], rtol=tol, atol=tol)


def test_fused_log_prob_and_entropy_gradients_against_finite_differences():
    logits = torch.randn(2, 3, 7, dtype=F64, generator=torch.Generator().manual_seed(5), requires_grad=True)
    labels = torch.tensor([[0, 6, 3], [2, 2, 5]])
    weights = torch.tensor([[1.0, -2.0, 0.5], [0.0, 3.0, -1.0]], dtype=F64)

    def both(x: torch.Tensor) -> torch.Tensor:
        log_prob, entropy = vocab_parallel_log_prob_and_entropy(x, labels)
        return log_prob * weights + 0.3 * entropy

    def log_prob_only(x: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_log_prob_and_entropy(x, labels, entropy_grad=False)[0] * weights

    assert torch.autograd.gradcheck(both, (logits,))
    assert torch.autograd.gradcheck(log_prob_only, (logits,))


def test_fused_log_prob_and_entropy_equal_the_separate_ones_on_a_large_vocab_in_float32():
    # the real model's vocabulary size and the update's fp32: the fused sums and dot product may add in
    # another order, which must stay far below the 1e-5 the layouts are held to
    gen = torch.Generator().manual_seed(7)
    logits = (4 * torch.randn(3, 5, 49152, generator=gen)).requires_grad_()
    labels = torch.randint(0, 49152, (3, 5), generator=gen)
    log_prob, entropy = vocab_parallel_log_prob_and_entropy(logits, labels)
    ref = logits.detach().double().log_softmax(-1)
    torch.testing.assert_close(log_prob.double(), ref.gather(-1, labels.unsqueeze(-1)).squeeze(-1),
                               rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy.double(), -(ref.exp() * ref).sum(-1), rtol=0, atol=1e-5)
    (grad,) = torch.autograd.grad((log_prob - 0.1 * entropy).sum(), logits)
    full = logits.detach().double().requires_grad_()
    lsm = full.log_softmax(-1)
    ref_objective = lsm.gather(-1, labels.unsqueeze(-1)).sum() + 0.1 * (lsm.exp() * lsm).sum()
    (ref_grad,) = torch.autograd.grad(ref_objective, full)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=0, atol=1e-7)


def test_fused_log_prob_and_entropy_with_banned_tokens():
    logits = torch.tensor([[2.0, 0.0, -math.inf, 1.0]], requires_grad=True)
    log_prob, entropy = vocab_parallel_log_prob_and_entropy(logits, torch.tensor([3]))
    assert entropy.item() == pytest.approx(naive_entropy([2.0, 0.0, -math.inf, 1.0]), rel=1e-6)
    assert log_prob.item() == pytest.approx(naive_log_softmax([2.0, 0.0, -math.inf, 1.0])[3], rel=1e-6)
    (log_prob + entropy).sum().backward()
    assert torch.isfinite(logits.grad).all() and logits.grad[0, 2] == 0


def _top_k_and_log_probs_at(rank: int, world_size: int, logits: torch.Tensor, ids: torch.Tensor,
                            weights: torch.Tensor, k: int):
    from hybridrl.algorithms.vocab_parallel import vocab_parallel_log_probs_at, vocab_parallel_top_k

    shard = logits.chunk(world_size, dim=-1)[rank].clone().requires_grad_(True)
    top_log_probs, top_ids = vocab_parallel_top_k(shard, k)
    at = vocab_parallel_log_probs_at(shard, ids)
    (at * weights).sum().backward()
    return top_log_probs, top_ids, at.detach(), shard.grad


@pytest.mark.parametrize("world", [1, 2])
def test_top_k_and_log_probs_at_ids_over_a_sharded_vocabulary_equal_plain_torch(world):
    """The teacher's top-k (log-probs and ids) and the student's log-probs at k given ids, over a vocabulary split
    across 2 gloo ranks, against torch's log_softmax / topk on the whole logits; the gradient of a weighted sum of
    the log-probs at ids against autograd through torch's log_softmax."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 4, 12, generator=gen) * 3  # [..., V=12]: 6 a rank at TP2
    ids = torch.randint(0, 12, (3, 4, 5), generator=gen)
    ids[0, 0] = torch.tensor([0, 11, 6, 5, 6])  # both shards' edges, and an id twice
    weights = torch.randn(3, 4, 5, generator=gen)
    k = 4
    results = run_ranks(_top_k_and_log_probs_at, world, logits, ids, weights, k, timeout_s=120)
    full = logits.clone().requires_grad_(True)
    log_softmax = full.log_softmax(-1)
    expected_at = log_softmax.gather(-1, ids)
    (expected_at * weights).sum().backward()
    expected_top, expected_ids = log_softmax.detach().topk(k, dim=-1)
    for top_log_probs, top_ids, at, _ in results:
        torch.testing.assert_close(top_log_probs, expected_top, rtol=0, atol=1e-6)
        assert torch.equal(top_ids, expected_ids)
        torch.testing.assert_close(at, expected_at.detach(), rtol=0, atol=1e-6)
    grads = torch.cat([grad for *_, grad in results], dim=-1)
    torch.testing.assert_close(grads, full.grad, rtol=0, atol=1e-6)


def _full_log_softmax_and_reverse_kl(rank: int, world_size: int, logits: torch.Tensor, target: torch.Tensor,
                                     weights: torch.Tensor):
    from hybridrl.algorithms.vocab_parallel import vocab_parallel_log_softmax, vocab_parallel_reverse_kl

    shard = logits.chunk(world_size, dim=-1)[rank].clone().requires_grad_(True)
    gathered = vocab_parallel_log_softmax(shard)
    kl = vocab_parallel_reverse_kl(shard, target.chunk(world_size, dim=-1)[rank])
    (kl * weights).sum().backward()
    return gathered, kl.detach(), shard.grad


@pytest.mark.parametrize("world", [1, 2])
def test_full_vocabulary_log_softmax_and_reverse_kl_over_a_sharded_vocabulary_equal_plain_torch(world):
    """The teacher's whole log-softmax gathered from a split vocabulary, and the student's reverse KL over the whole
    vocabulary from its shard and the target's log-probs on the same ids, against torch: sum p (log p - t) written
    here with log_softmax, and its gradient by autograd. The last id is a padded one (the float minimum, as
    `mask_vocab_padding` writes it) whose target is -inf or garbage: it must add 0, and its gradient is 0."""
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(3, 4, 12, generator=gen) * 3  # [..., V=12]: 6 a rank at TP2
    logits[..., -1] = torch.finfo(torch.float32).min
    target = torch.randn(3, 4, 12, generator=gen).log_softmax(-1)
    target[0, 0, -1] = -math.inf  # a teacher that rules the padded id out too (0 * inf would be NaN)
    target[1:, :, -1] = 123.0  # or holds anything there
    weights = torch.randn(3, 4, generator=gen)
    results = run_ranks(_full_log_softmax_and_reverse_kl, world, logits, target, weights, timeout_s=120)

    full = logits.clone().requires_grad_(True)
    log_p = full[..., :-1].log_softmax(-1)  # the padded id carries no mass
    expected_kl = (log_p.exp() * (log_p - target[..., :-1])).sum(-1)
    (expected_kl * weights).sum().backward()
    assert float(expected_kl.min()) > 0.05  # not near 0 by construction: a wrong sum would show
    for gathered, kl, _ in results:
        torch.testing.assert_close(gathered[..., :-1], logits[..., :-1].log_softmax(-1), rtol=0, atol=1e-6)
        torch.testing.assert_close(kl, expected_kl.detach(), rtol=0, atol=1e-5)
    grads = torch.cat([grad for *_, grad in results], dim=-1)
    torch.testing.assert_close(grads, full.grad, rtol=0, atol=1e-5)  # float32: KLs of ~1, gradients of ~0.5
    assert torch.all(grads[..., -1] == 0)
