"""Split invariance: a mini-batch's loss and gradient do not depend on how it is cut into
micro-batches and spread over DP ranks, for every aggregation mode (float64, to 1e-6 and tighter)."""
import random

import pytest
import torch

from hybridrl.algorithms import (
    LOSS_AGG_MODES,
    LossNormalizers,
    aggregate_loss,
    global_loss_normalizers,
    ppo_policy_loss,
    value_loss,
)
from tests.support.forked import run_ranks

F64 = torch.float64
BATCH, LENGTH = 11, 8


def make_mask(seed: int) -> torch.Tensor:
    """Right-padded responses of random lengths, two empty rows and a hole."""
    rng = random.Random(seed)
    mask = torch.zeros(BATCH, LENGTH, dtype=F64)
    for row in range(BATCH):
        mask[row, : rng.randint(1, LENGTH)] = 1.0
    mask[3] = 0.0
    mask[7] = 0.0
    mask[5, 1] = 0.0
    return mask


def random_cut(seed: int, dp_size: int) -> list[list[torch.Tensor]]:
    """Row indices per DP rank per micro-batch: shuffled rows, uneven micro-batch sizes."""
    rng = random.Random(1000 + seed)
    rows = list(range(BATCH))
    rng.shuffle(rows)
    micro_batches = []
    while rows:
        size = rng.randint(1, 4)
        micro_batches.append(torch.tensor(rows[:size]))
        rows = rows[size:]
    ranks: list[list[torch.Tensor]] = [[] for _ in range(dp_size)]
    for i, micro in enumerate(micro_batches):
        ranks[i % dp_size].append(micro)
    return ranks


def trim(mask: torch.Tensor) -> int:
    """Length after dropping all-masked trailing columns (dynamic padding per micro-batch)."""
    nonzero = (mask != 0).any(0).nonzero()
    return int(nonzero.max()) + 1 if len(nonzero) else 1


def simulated_global_normalizers(mask: torch.Tensor, ranks) -> LossNormalizers:
    """Each rank sums its micro-batches (global_loss_normalizers without a group); the DP
    all-reduce is simulated by summing the per-rank results."""
    per_rank = [global_loss_normalizers([mask[rows] for rows in micro_batches]) for micro_batches in ranks]
    return LossNormalizers(tokens=sum(n.tokens for n in per_rank), seqs=sum(n.seqs for n in per_rank))


def split_sum(loss_fn, mask: torch.Tensor, ranks, normalizers: LossNormalizers) -> torch.Tensor:
    """Sum over ranks and micro-batches of loss_fn(rows, length, normalizers)."""
    total = torch.zeros((), dtype=F64)
    for micro_batches in ranks:
        for rows in micro_batches:
            total = total + loss_fn(rows, trim(mask[rows]), normalizers)
    return total


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("seed,dp_size", [(0, 1), (1, 2), (2, 3), (3, 4)])
def test_aggregate_loss_split_invariance(mode, seed, dp_size):
    gen = torch.Generator().manual_seed(seed)
    loss_mat = torch.randn(BATCH, LENGTH, generator=gen, dtype=F64).requires_grad_()
    mask = make_mask(seed)
    ranks = random_cut(seed, dp_size)
    normalizers = simulated_global_normalizers(mask, ranks)

    whole = aggregate_loss(loss_mat, mask, mode, norm_length=LENGTH)

    def micro_loss(rows, length, norm):
        return aggregate_loss(
            loss_mat[rows, :length], mask[rows, :length], mode, norm_length=LENGTH, **norm.as_kwargs()
        )

    split = split_sum(micro_loss, mask, ranks, normalizers)
    torch.testing.assert_close(split, whole, rtol=1e-12, atol=1e-12)
    (grad_whole,) = torch.autograd.grad(whole, loss_mat)
    (grad_split,) = torch.autograd.grad(split, loss_mat)
    torch.testing.assert_close(grad_split, grad_whole, rtol=0, atol=1e-6)
    assert grad_whole.abs().sum() > 0


def test_local_normalization_is_not_split_invariant():
    """The failure the global normalizers prevent: averaging micro-batch token means."""
    gen = torch.Generator().manual_seed(5)
    loss_mat = torch.randn(BATCH, LENGTH, generator=gen, dtype=F64)
    mask = make_mask(5)
    micro_batches = random_cut(5, 1)[0]
    local_means = [aggregate_loss(loss_mat[rows], mask[rows], "token-mean") for rows in micro_batches]
    averaged = sum(local_means) / len(local_means)
    assert abs(averaged - aggregate_loss(loss_mat, mask, "token-mean")) > 1e-3


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_ppo_and_value_losses_split_invariance(mode):
    gen = torch.Generator().manual_seed(11)
    old_log_prob = torch.randn(BATCH, LENGTH, generator=gen, dtype=F64)
    log_prob = (old_log_prob + 0.3 * torch.randn(BATCH, LENGTH, generator=gen, dtype=F64)).requires_grad_()
    advantages = torch.randn(BATCH, LENGTH, generator=gen, dtype=F64)
    old_values = torch.randn(BATCH, LENGTH, generator=gen, dtype=F64)
    values = (old_values + 0.3 * torch.randn(BATCH, LENGTH, generator=gen, dtype=F64)).requires_grad_()
    returns = torch.randn(BATCH, LENGTH, generator=gen, dtype=F64)
    mask = make_mask(11)
    ranks = random_cut(11, 2)
    normalizers = simulated_global_normalizers(mask, ranks)

    def policy(rows=slice(None), length=LENGTH, norm=None):
        kwargs = norm.as_kwargs() if norm is not None else {}
        return ppo_policy_loss(
            log_prob[rows, :length], old_log_prob[rows, :length], advantages[rows, :length],
            mask[rows, :length], agg=mode, norm_length=LENGTH, **kwargs,
        )[0]

    def critic(rows=slice(None), length=LENGTH, norm=None):
        kwargs = norm.as_kwargs() if norm is not None else {}
        return value_loss(
            values[rows, :length], old_values[rows, :length], returns[rows, :length],
            mask[rows, :length], clip=0.2, agg=mode, norm_length=LENGTH, **kwargs,
        )[0]

    for loss_fn, param in ((policy, log_prob), (critic, values)):
        whole = loss_fn()
        split = split_sum(loss_fn, mask, ranks, normalizers)
        torch.testing.assert_close(split, whole, rtol=1e-12, atol=1e-12)
        (grad_whole,) = torch.autograd.grad(whole, param)
        (grad_split,) = torch.autograd.grad(split, param)
        torch.testing.assert_close(grad_split, grad_whole, rtol=0, atol=1e-6)
        assert grad_whole.abs().sum() > 0


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_context_parallel_token_split_invariance(mode):
    """Each sequence's tokens split over 2 "CP ranks" (zig-zag columns): with normalizers and
    per-sequence token counts of the complete sequences, the CP-rank losses sum to the whole."""
    gen = torch.Generator().manual_seed(31)
    loss_mat = torch.randn(BATCH, LENGTH, generator=gen, dtype=F64).requires_grad_()
    mask = make_mask(31)
    normalizers = global_loss_normalizers([mask])
    seq_token_counts = mask.sum(-1)
    whole = aggregate_loss(loss_mat, mask, mode)
    columns = [torch.tensor([0, 1, 6, 7]), torch.tensor([2, 3, 4, 5])]
    split = sum(
        aggregate_loss(
            loss_mat[:, cols], mask[:, cols], mode, norm_length=LENGTH, seq_token_counts=seq_token_counts,
            **normalizers.as_kwargs(),
        )
        for cols in columns
    )
    torch.testing.assert_close(split, whole, rtol=1e-12, atol=1e-12)
    (grad_whole,) = torch.autograd.grad(whole, loss_mat)
    (grad_split,) = torch.autograd.grad(split, loss_mat)
    torch.testing.assert_close(grad_split, grad_whole, rtol=0, atol=1e-6)


def _normalizers_over_dp(rank: int, world_size: int, masks_per_rank):
    import torch.distributed as dist

    norm = global_loss_normalizers(masks_per_rank[rank], dp_group=dist.group.WORLD)
    return norm.tokens.item(), norm.seqs.item()


def test_global_loss_normalizers_all_reduce_over_two_gloo_ranks():
    mask = make_mask(21)
    masks_per_rank = [[mask[:3], mask[3:5]], [mask[5:]]]
    expected = (float(mask.sum()), float((mask.sum(-1) > 0).sum()))  # 9 non-empty rows of 11
    assert expected[1] == 9
    results = run_ranks(_normalizers_over_dp, 2, masks_per_rank, timeout_s=120)
    assert results == [expected, expected]
