"""Plain-torch references the tests compare hybridrl's kernels with: causal attention of one sequence, and top-k /
top-p truncation by an explicit sort."""
from __future__ import annotations

import math

import torch


def torch_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal attention of one sequence: q `[s, h, d]`, k/v `[s, kv, d]` -> `[s, h * d]`."""
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    causal = torch.ones(q.shape[0], q.shape[0], dtype=torch.bool, device=q.device).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v).reshape(q.shape[0], -1)


def sorted_reference(x: torch.Tensor, top_k: int | None, top_p: float, exactly_k: bool) -> torch.Tensor:
    """Kept mask [rows, V] by an explicit sort (value descending, index ascending among ties): top-k
    keeps the first k (exactly_k) or every logit >= the k-th; top-p then keeps the shortest prefix
    of the survivors whose mass reaches p."""
    rows, vocab = x.shape
    kept = torch.zeros(rows, vocab, dtype=torch.bool)
    for r in range(rows):
        order = sorted(range(vocab), key=lambda v: (-float(x[r, v]), v))
        if top_k is not None:
            kth = float(x[r, order[top_k - 1]])
            order = order[:top_k] if exactly_k else [v for v in order if float(x[r, v]) >= kth]
        probs = torch.softmax(x[r, order].double(), -1)
        mass, chosen = 0.0, []
        for v, q in zip(order, probs.tolist()):
            if chosen and mass >= top_p:
                break
            chosen.append(v)
            mass += q
        kept[r, chosen] = True
    return kept
