"""Log-probs under vLLM's top-k/top-p truncation, from vocab-parallel logits (the rollout's behaviour policy
recomputed with the trainer's weights: the target of `algorithm.rollout_correction.match_truncation`).

vLLM (0.32, `logprobs_mode="processed_logprobs"`) samples from, and reports the log-prob of, the
distribution its sampler builds in this order: logits in float32, divided by the temperature, then
`apply_top_k_top_p` (vllm/v1/sample/ops/topk_topp_sampler.py) sets the dropped logits to -inf, then
log-softmax. `truncated_log_prob` computes the same thing for the label token:

  top-k  the k-th largest logit v_k. vLLM's PyTorch path (CPU) keeps every logit >= v_k (all ties
         at v_k, so possibly more than k tokens); its Triton kernel (CUDA) keeps exactly k (ties at
         v_k taken in vocabulary order). `Truncation.top_k_keeps_ties` picks one; the Plan sets it
         from the device (`DevicePolicy.vllm_top_k_keeps_ties`).
  top-p  over the top-k survivors' softmax q: a token is dropped when the mass of the tokens ranked
         above it reaches p (`cumsum(ascending q) <= 1 - p`), so the kept set is the shortest prefix
         of the descending order whose mass reaches p; the top token is always kept.

Ties are handled by count, never by identity: vLLM orders equal logits by an unstable sort (CPU) or
by index (Triton), which the trainer cannot reproduce, but equal logits have equal probabilities, so
the normalizer of the kept set depends only on how many copies of the boundary value are kept. A
label whose logit equals the boundary value counts as kept (vLLM sampled it, so it kept that copy).

A label the trainer's truncation drops (its logit below the boundary: vLLM's and the trainer's
logits differ in the last bits, so a token at the boundary can be kept by one and dropped by the
other) would have log-prob -inf. It is given the log-prob it has when the kept set is extended by
it, x_y - log(Z_kept + e^x_y), and flagged in `outside`: that value is continuous in the logits
across the boundary (just inside, the same formula holds with x_y already in Z_kept), so a rounding
flip at the boundary moves the ratio a little instead of zeroing it (and with a sequence-level
weight, the whole sequence). A token far outside still gets a very low log-prob, which the
correction's cap and mask treat as a tiny ratio.

Vocab-parallel. Rank r of `tp_group` holds `logits_shard` `[..., V/tp]`, the slice [r V/tp, (r+1) V/tp)
of the vocabulary. Nothing of size `[..., V]` is gathered: top-k gathers each shard's top
min(k, V/tp) values; top-p gathers each shard's candidates, the tokens whose mass above them within
their own shard is below p (a token's global mass above is at least its shard's, so no kept token is
missed), padded to the largest count over the group. Memory, per row: the local sort of the shard
(values and int64 indices: 3x the shard's float32 bytes; top-k alone: a top-k, no sort) and
tp x (candidates) gathered values; the worst case (a flat distribution, p near 1) gathers up to the
whole row. Rows are processed in chunks of at most `CHUNK_ELEMENTS` shard elements to bound that.

Computed without gradient (the correction's target is detached); math in float32 (float64 for
float64 input). Every rank of `tp_group` must call with the same labels and truncation (collectives).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from hybridrl.algorithms.vocab_parallel import _all_reduce, _as_compute, _local_labels, _rank_and_size

# Rows are taken this many shard elements at a time (~200 MB of sort temporaries in float32 + int64).
CHUNK_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class Truncation:
    """vLLM's sampling filters: `top_k` (None or <= 0: off), `top_p` (1: off), and how top-k treats
    ties at the k-th logit (`top_k_keeps_ties`: True keeps all of them, vLLM's PyTorch path; False
    keeps exactly k, vLLM's Triton kernel)."""

    top_k: int | None = None
    top_p: float = 1.0
    top_k_keeps_ties: bool = True

    def __post_init__(self) -> None:
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")

    @property
    def k(self) -> int | None:
        return self.top_k if self.top_k is not None and self.top_k > 0 else None

    @property
    def active(self) -> bool:
        return self.k is not None or self.top_p < 1.0


@dataclass(frozen=True)
class TruncatedLogProb:
    """`log_prob` `[...]`: the label's log-prob under the truncated, renormalized distribution (extended
    by the label where the truncation drops it); `outside` `[...]` bool: where it drops it."""

    log_prob: Tensor
    outside: Tensor


def truncated_log_prob(logits_shard: Tensor, labels: Tensor, truncation: Truncation,
                       tp_group: dist.ProcessGroup | None = None) -> TruncatedLogProb:
    """log-prob of `labels` `[...]` (global vocabulary ids) under `truncation` of the logits whose
    vocab shard `[..., V/tp]` this rank holds (already divided by the temperature, as vLLM does before
    filtering). `tp_group=None`: the default group; without torch.distributed, the whole vocabulary.
    """
    with torch.no_grad():
        x = _as_compute(logits_shard.detach())
        lead = x.shape[:-1]
        x = x.reshape(-1, x.shape[-1])
        flat_labels = labels.reshape(-1)
        if flat_labels.numel() != x.shape[0]:
            raise ValueError(f"labels {tuple(labels.shape)} do not match logits {tuple(logits_shard.shape)}")
        rows = max(1, CHUNK_ELEMENTS // max(1, x.shape[-1]))
        log_probs, outside = [], []
        # The same row count on every rank (same labels), so every rank runs the same collectives.
        for start in range(0, x.shape[0], rows):
            lp, out = _chunk(x[start:start + rows], flat_labels[start:start + rows], truncation, tp_group)
            log_probs.append(lp)
            outside.append(out)
        if not log_probs:
            empty = x.new_zeros((0,))
            return TruncatedLogProb(empty.reshape(lead), empty.bool().reshape(lead))
        return TruncatedLogProb(torch.cat(log_probs).reshape(lead), torch.cat(outside).reshape(lead))


def _all_gather_last(t: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """`[n, c]` from every rank -> `[n, tp * c]` (rank-major along the last dim)."""
    _, size = _rank_and_size(group)
    if size == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _max_over_group(value: int, like: Tensor, group: dist.ProcessGroup | None) -> int:
    return int(_all_reduce(torch.tensor([value], dtype=torch.long, device=like.device), dist.ReduceOp.MAX, group))


def _exclusive_mass(values: Tensor, normalizer: Tensor) -> Tensor:
    """For descending `values` `[n, c]` (log-space, relative to the row max): the probability mass
    strictly before each position, normalized by `normalizer` `[n]`."""
    q = torch.exp(values) / normalizer.unsqueeze(-1)
    return torch.cumsum(q, dim=-1) - q


def _chunk(x: Tensor, labels: Tensor, truncation: Truncation,
           group: dist.ProcessGroup | None) -> tuple[Tensor, Tensor]:
    """One chunk of rows: (log-prob `[n]`, outside `[n]`)."""
    _, tp = _rank_and_size(group)
    n, shard = x.shape
    global_max = _all_reduce(x.max(dim=-1).values, dist.ReduceOp.MAX, group)
    # Relative to the row max, so exp never overflows; dropped tokens' exp underflows to 0 harmlessly.
    shifted = x - global_max.unsqueeze(-1)
    exp = torch.exp(shifted)
    k = truncation.k if truncation.k is not None and truncation.k < shard * tp else None
    # The kept set is described by a boundary value (log-space) and the normalizer of the kept tokens.
    boundary = torch.full((n,), -torch.inf, dtype=x.dtype, device=x.device)
    if k is None:
        normalizer = _all_reduce(exp.sum(-1), dist.ReduceOp.SUM, group)
    else:
        # Each shard holds at most k of the global top k; the k-th of the gathered values is v_k.
        top = _all_gather_last(shifted.topk(min(k, shard), dim=-1).values, group).topk(k, dim=-1).values
        boundary = top[:, k - 1]
        if truncation.top_k_keeps_ties:
            normalizer = _all_reduce((exp * (shifted >= boundary.unsqueeze(-1))).sum(-1), dist.ReduceOp.SUM, group)
        else:  # exactly the k largest, by count (which copies of a tied v_k does not change the sum)
            normalizer = torch.exp(top).sum(-1)
    if truncation.top_p < 1.0:
        boundary, normalizer = _top_p(shifted, boundary, normalizer, k, truncation, group)

    local_index, in_shard = _local_labels(labels, shard, group)
    picked = torch.gather(shifted, -1, local_index.unsqueeze(-1)).squeeze(-1)
    picked = _all_reduce(torch.where(in_shard, picked, torch.zeros_like(picked)), dist.ReduceOp.SUM, group)
    outside = picked < boundary
    # a dropped label: the kept set extended by it (continuous across the boundary, see the module doc)
    normalizer = torch.where(outside, normalizer + torch.exp(picked), normalizer)
    return picked - torch.log(normalizer), outside


def _top_p(shifted: Tensor, boundary: Tensor, normalizer: Tensor, k: int | None, truncation: Truncation,
           group: dist.ProcessGroup | None) -> tuple[Tensor, Tensor]:
    """Top-p over the top-k survivors (`boundary` = v_k, or -inf without top-k; `normalizer` = their
    mass): the new boundary value and the kept prefix's normalizer."""
    shard = shifted.shape[-1]
    survives = shifted >= boundary.unsqueeze(-1)
    if k is None:
        local = shifted.sort(dim=-1, descending=True).values
    else:  # the survivors are the only candidates: a top-k of the largest local survivor count, no sort
        width = max(1, _max_over_group(int(survives.sum(-1).max()), shifted, group))
        local = shifted.topk(min(width, shard), dim=-1).values
        local = torch.where(local >= boundary.unsqueeze(-1), local, torch.full_like(local, -torch.inf))
    # Candidates: mass above them within this shard (with the global normalizer) below p.
    candidate = (_exclusive_mass(local, normalizer) < truncation.top_p) & torch.isfinite(local)
    width = max(1, _max_over_group(int(candidate.sum(-1).max()), shifted, group))
    merged = _all_gather_last(local[:, :width].contiguous(), group).sort(dim=-1, descending=True).values
    if k is not None and not truncation.top_k_keeps_ties:
        merged = merged[:, :k]  # exactly k survive top-k: extra copies of a tied v_k are not candidates
    keep = (_exclusive_mass(merged, normalizer) < truncation.top_p) & torch.isfinite(merged)
    kept = keep.sum(-1).clamp(min=1)  # a prefix (the mass above only grows); the top token always stays
    new_boundary = merged.gather(-1, (kept - 1).unsqueeze(-1)).squeeze(-1)
    in_prefix = torch.arange(merged.shape[-1], device=merged.device) < kept.unsqueeze(-1)
    new_normalizer = (torch.exp(merged) * in_prefix).sum(-1)
    return new_boundary, new_normalizer
