"""Log-probabilities and entropies of tensor-parallel (vocab-sharded) logits, without gathering V.

Rank r of `tp_group` holds `logits_shard` `[..., V/tp]`, the contiguous vocabulary slice
[r * V/tp, (r + 1) * V/tp) of the full logits (Megatron's vocab-parallel output layer). Each
result needs three all-reduces of `[...]`-sized tensors (a max and sums), never `[..., V]`.

They are `torch.autograd.Function`s whose backward needs no communication: with the global max,
normalizer and (for entropy) mean saved from forward, every rank computes the gradient of its own
slice exactly -- for log-prob, onehot(label) - softmax; for entropy, -p * (x - E_p[x]).
Math is float32 (float64 for float64 input); gradients come back in the logits' dtype.

On-policy distillation's top-k loss adds two: `vocab_parallel_top_k` (a teacher's k most likely tokens: each
rank's own top-k, all-gathered, `[..., k x tp]`, never `[..., V]`) and `vocab_parallel_log_probs_at` (a student's
log-probs at those k ids, one pass over the shard for all k). Its full-vocabulary loss adds two more:
`vocab_parallel_log_softmax` (a teacher's whole distribution, gathered: `[..., V]`, the one function here that
moves V) and `vocab_parallel_reverse_kl` (KL(student || teacher) over the whole vocabulary from the student's shard
and the teacher's log-probs on the same ids; its backward needs no communication either).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def vocab_parallel_log_prob(
    logits_shard: Tensor, labels: Tensor, tp_group: dist.ProcessGroup | None = None
) -> Tensor:
    """log softmax(full logits)[label], `[...]`, from this rank's shard `[..., V/tp]`.

    `labels` `[...]` are global vocabulary ids; every rank of `tp_group` must call this with the
    same labels (a collective). `tp_group=None` means the default group; without an initialized
    torch.distributed, the shard is taken to be the whole vocabulary. A label no rank owns (an
    ignore index such as -100) yields -log Z, a finite placeholder: mask those positions.
    """
    return _VocabParallelLogProbsAt.apply(logits_shard, labels.unsqueeze(-1), tp_group).squeeze(-1)


def vocab_parallel_entropy(logits_shard: Tensor, tp_group: dist.ProcessGroup | None = None) -> Tensor:
    """Entropy of softmax(full logits), `[...]`, from this rank's shard `[..., V/tp]` (a collective)."""
    return _VocabParallelEntropy.apply(logits_shard, tp_group)


def vocab_parallel_log_prob_and_entropy(
    logits_shard: Tensor, labels: Tensor, tp_group: dist.ProcessGroup | None = None, *, entropy_grad: bool = True,
) -> tuple[Tensor, Tensor]:
    """`(vocab_parallel_log_prob, vocab_parallel_entropy)` of the same logits, from one pass over the shard.

    The two share the max, `exp(x - max)` and the normalizer: on a large vocabulary the separate
    functions read and write `[..., V/tp]` tensors about twice as often (each one's forward, and each
    one's backward recomputing the softmax). With `entropy_grad=False` the entropy is a metric only
    (not differentiable) and backward reuses the saved `exp(x - max)` instead of recomputing it.
    Logits of -inf are raised to the float minimum, as in `vocab_parallel_entropy`.
    """
    return _VocabParallelLogProbEntropy.apply(logits_shard, labels, tp_group, entropy_grad)


def vocab_parallel_log_probs_at(logits_shard: Tensor, ids: Tensor,
                                tp_group: dist.ProcessGroup | None = None) -> Tensor:
    """log softmax(full logits) at `k` global vocabulary ids per position: `[..., k]` from the shard `[..., V/tp]` and
    `ids` `[..., k]` (the same on every rank of `tp_group`: a collective). `vocab_parallel_log_prob` is its k = 1
    case; here the logits are read once for all k (no `[..., k, V]` expansion)."""
    return _VocabParallelLogProbsAt.apply(logits_shard, ids, tp_group)


def vocab_parallel_top_k(logits_shard: Tensor, k: int,
                         tp_group: dist.ProcessGroup | None = None) -> tuple[Tensor, Tensor]:
    """The `k` most likely tokens of softmax(full logits) per position: (log-probs `[..., k]`, global ids `[..., k]`,
    most likely first), from this rank's shard (a collective: each rank's own top-k, gathered, then the top k of
    those). Not differentiable (a target, e.g. a teacher's distribution)."""
    with torch.no_grad():
        x = _as_compute(logits_shard)
        rank, size = _rank_and_size(tp_group)
        global_max, normalizer = _global_max_and_normalizer(x, tp_group)
        values, local = x.topk(min(k, x.shape[-1]), dim=-1)
        ids = local + rank * x.shape[-1]
        if size > 1:
            gathered_values = [torch.empty_like(values) for _ in range(size)]
            gathered_ids = [torch.empty_like(ids) for _ in range(size)]
            dist.all_gather(gathered_values, values.contiguous(), group=tp_group)
            dist.all_gather(gathered_ids, ids.contiguous(), group=tp_group)
            values, ids = torch.cat(gathered_values, -1), torch.cat(gathered_ids, -1)
        if values.shape[-1] < k:
            raise ValueError(f"top-{k} of a vocabulary of {values.shape[-1]} tokens")
        values, order = values.topk(k, dim=-1)
        ids = torch.gather(ids, -1, order)
        return values - global_max.unsqueeze(-1) - torch.log(normalizer).unsqueeze(-1), ids


def vocab_parallel_log_softmax(logits_shard: Tensor, tp_group: dist.ProcessGroup | None = None) -> Tensor:
    """log softmax(full logits) over the whole vocabulary, `[..., V/tp x tp]` on every rank of `tp_group` (a
    collective: the normalizer all-reduced, then the shards all-gathered in rank order). Not differentiable (a
    target: a teacher's distribution, shipped whole to a student whose layout may split it otherwise)."""
    with torch.no_grad():
        x = _as_compute(logits_shard)
        global_max, normalizer = _global_max_and_normalizer(x, tp_group)
        shard = x - (global_max + torch.log(normalizer)).unsqueeze(-1)
        _, size = _rank_and_size(tp_group)
        if size == 1:
            return shard
        gathered = [torch.empty_like(shard) for _ in range(size)]
        dist.all_gather(gathered, shard.contiguous(), group=tp_group)
        return torch.cat(gathered, -1)


def vocab_parallel_reverse_kl(logits_shard: Tensor, target_log_probs_shard: Tensor,
                              tp_group: dist.ProcessGroup | None = None) -> Tensor:
    """KL(softmax(full logits) || target) = sum over the whole vocabulary of p (log p - t), `[...]`, from this rank's
    logits shard `[..., V/tp]` and the target's log-probs on the same ids (`target_log_probs_shard`, `[..., V/tp]`,
    not differentiated). Ids the logits rule out (the float minimum or -inf: a padded vocabulary) add 0 whatever
    their target says. The gradient of each logit is p_j ((log p_j - t_j) - KL): no communication in backward."""
    return _VocabParallelReverseKL.apply(logits_shard, target_log_probs_shard, tp_group)


def _rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _all_reduce(tensor: Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> Tensor:
    if _rank_and_size(group)[1] > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def _as_compute(logits: Tensor) -> Tensor:
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def _global_max_and_normalizer(x: Tensor, group: dist.ProcessGroup | None) -> tuple[Tensor, Tensor]:
    """Global max over the vocabulary and the sum of exp(x - max), both `[...]`."""
    global_max = _all_reduce(x.max(dim=-1).values, dist.ReduceOp.MAX, group)
    normalizer = _all_reduce(torch.exp(x - global_max.unsqueeze(-1)).sum(-1), dist.ReduceOp.SUM, group)
    return global_max, normalizer


def _local_labels(labels: Tensor, shard_size: int, group: dist.ProcessGroup | None) -> tuple[Tensor, Tensor]:
    """(index into this rank's vocab shard, whether the label is in it); labels elsewhere index 0."""
    rank, _ = _rank_and_size(group)
    local_labels = labels.long() - rank * shard_size
    in_shard = (local_labels >= 0) & (local_labels < shard_size)
    return torch.where(in_shard, local_labels, torch.zeros_like(local_labels)), in_shard


class _VocabParallelLogProbsAt(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_shard: Tensor, ids: Tensor, group: dist.ProcessGroup | None) -> Tensor:
        x = _as_compute(logits_shard)
        local_index, in_shard = _local_labels(ids, x.shape[-1], group)
        global_max, normalizer = _global_max_and_normalizer(x, group)
        picked = torch.gather(x, -1, local_index) - global_max.unsqueeze(-1)
        picked = _all_reduce(torch.where(in_shard, picked, torch.zeros_like(picked)), dist.ReduceOp.SUM, group)
        ctx.save_for_backward(logits_shard, global_max, normalizer, local_index, in_shard)
        return picked - torch.log(normalizer).unsqueeze(-1)

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        logits_shard, global_max, normalizer, local_index, in_shard = ctx.saved_tensors
        x = _as_compute(logits_shard)
        probs = torch.exp(x - global_max.unsqueeze(-1)) / normalizer.unsqueeze(-1)
        grad = grad_output.to(x.dtype)
        # d/dx_j sum_i g_i (x_{id_i} - log Z) = sum_i g_i [id_i = j] - p_j sum_i g_i
        grad_x = -probs * grad.sum(-1, keepdim=True)
        grad_x.scatter_add_(-1, local_index, grad * in_shard.to(x.dtype))
        return grad_x.to(logits_shard.dtype), None, None


class _VocabParallelEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_shard: Tensor, group: dist.ProcessGroup | None) -> Tensor:
        x = _as_compute(logits_shard)
        # -inf logits would give 0 * inf = NaN below; the float minimum gives 0 * finite = 0.
        x = torch.clamp(x, min=torch.finfo(x.dtype).min)
        global_max, normalizer = _global_max_and_normalizer(x, group)
        shifted = x - global_max.unsqueeze(-1)
        weighted = _all_reduce((torch.exp(shifted) * shifted).sum(-1), dist.ReduceOp.SUM, group)
        mean_shifted = weighted / normalizer  # E_p[x] - max
        ctx.save_for_backward(logits_shard, global_max, normalizer, mean_shifted)
        # H = log Z - E_p[x], with both terms taken relative to the max.
        return torch.log(normalizer) - mean_shifted

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        logits_shard, global_max, normalizer, mean_shifted = ctx.saved_tensors
        x = torch.clamp(_as_compute(logits_shard), min=torch.finfo(global_max.dtype).min)
        shifted = x - global_max.unsqueeze(-1)
        probs = torch.exp(shifted) / normalizer.unsqueeze(-1)
        grad_x = -probs * (shifted - mean_shifted.unsqueeze(-1)) * grad_output.to(x.dtype).unsqueeze(-1)
        return grad_x.to(logits_shard.dtype), None


class _VocabParallelLogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_shard: Tensor, labels: Tensor, group: dist.ProcessGroup | None,
                entropy_grad: bool) -> tuple[Tensor, Tensor]:
        x = _as_compute(logits_shard)
        local_index, in_shard = _local_labels(labels, x.shape[-1], group)

        global_max = _all_reduce(x.max(dim=-1).values, dist.ReduceOp.MAX, group)
        shifted = x - global_max.unsqueeze(-1)
        # -inf logits: exp gives 0 and 0 * float-min gives 0 in the entropy's sum (0 * -inf is NaN)
        shifted.clamp_(min=torch.finfo(shifted.dtype).min)
        exp = torch.exp(shifted)
        # the two [...]-sized sums travel in one all-reduce
        sums = _all_reduce(torch.stack([exp.sum(-1), torch.linalg.vecdot(exp, shifted)]), dist.ReduceOp.SUM, group)
        normalizer, weighted = sums[0], sums[1]
        picked = torch.gather(shifted, -1, local_index.unsqueeze(-1)).squeeze(-1)
        picked = _all_reduce(torch.where(in_shard, picked, torch.zeros_like(picked)), dist.ReduceOp.SUM, group)
        log_normalizer = torch.log(normalizer)
        mean_shifted = weighted / normalizer  # E_p[x] - max
        ctx.entropy_grad = entropy_grad
        ctx.logits_dtype = logits_shard.dtype
        # entropy's gradient needs x - max; without it, only p = exp / normalizer
        ctx.save_for_backward(shifted if entropy_grad else exp, normalizer, mean_shifted, local_index, in_shard)
        entropy = log_normalizer - mean_shifted
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return picked - log_normalizer, entropy

    @staticmethod
    def backward(ctx, grad_log_prob: Tensor, grad_entropy: Tensor | None):
        saved, normalizer, mean_shifted, local_index, in_shard = ctx.saved_tensors
        dtype = normalizer.dtype
        g = grad_log_prob.to(dtype)
        if ctx.entropy_grad:
            shifted = saved
            probs = torch.exp(shifted).div_(normalizer.unsqueeze(-1))
            # d log p_label = onehot - p; d H = -p * (x - E_p[x])
            coeff = shifted.sub(mean_shifted.unsqueeze(-1))
            if grad_entropy is not None:
                coeff.mul_(grad_entropy.to(dtype).unsqueeze(-1))
            else:
                coeff.zero_()
            grad_x = probs.mul_(coeff.add_(g.unsqueeze(-1))).neg_()
        else:
            grad_x = saved * (-g / normalizer).unsqueeze(-1)
        grad_x.scatter_add_(-1, local_index.unsqueeze(-1), (g * in_shard.to(dtype)).unsqueeze(-1))
        return grad_x.to(ctx.logits_dtype), None, None, None


class _VocabParallelReverseKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_shard: Tensor, target: Tensor, group: dist.ProcessGroup | None) -> Tensor:
        x = _as_compute(logits_shard)
        x = torch.clamp(x, min=torch.finfo(x.dtype).min)
        global_max, normalizer = _global_max_and_normalizer(x, group)
        log_p = x - (global_max + torch.log(normalizer)).unsqueeze(-1)
        probs = torch.exp(log_p)
        # p = 0 (a ruled-out id, or one whose mass underflows) contributes 0, not 0 * (-inf - t) = NaN
        gap = torch.where(probs > 0, log_p - target.to(log_p.dtype), torch.zeros_like(log_p))
        kl = _all_reduce((probs * gap).sum(-1), dist.ReduceOp.SUM, group)
        ctx.logits_dtype = logits_shard.dtype
        ctx.save_for_backward(probs, gap, kl)
        return kl

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        probs, gap, kl = ctx.saved_tensors
        # d/dx_j sum_v p_v (log p_v - t_v) = p_j ((log p_j - t_j) - KL)
        grad_x = probs * (gap - kl.unsqueeze(-1)) * grad_output.to(probs.dtype).unsqueeze(-1)
        return grad_x.to(ctx.logits_dtype), None, None
