"""Trainer-side log-probs under vLLM's top-k/top-p truncation (`hybridrl.algorithms.truncation`).

vLLM's own filter is the reference of the default mode in tests/rollout/test_engine.py (it runs where
vLLM is already imported). Here: the exactly-k mode (vLLM's Triton kernel) against a plain-torch sort
written in this file, and the vocab-parallel computation on 2 gloo ranks against one rank, with rows
cut into several chunks and vocabulary padding.
"""
import pytest
import torch

from hybridrl.algorithms import truncation as truncation_module
from hybridrl.algorithms.truncation import Truncation, truncated_log_prob
from tests.support.forked import run_ranks
from tests.support.references import sorted_reference

VOCAB = 64




def tied_logits(seed: int, rows: int = 6) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = (4 * torch.randn(rows, VOCAB, generator=gen)).round() / 2  # many equal values
    x[0, 5:11] = x[0].max() + 1  # six tied at the top
    return x


# (2, 1 - 1e-8): top_p rounds to 1 in float32 (vLLM's dtype for it), so the top-k survivors' summed mass
# can fall short of it (it does on these logits): top-p must still stop at the k survivors, not take
# the other copies of a tied v_k
@pytest.mark.parametrize("top_k, top_p, seed", [(3, 1.0, 3), (8, 1.0, 8), (None, 0.7, 0), (8, 0.6, 8),
                                                (4, 0.95, 4), (1, 1.0, 1), (2, 1 - 1e-8, 0)])
def test_exactly_k_mode_against_a_plain_sort(top_k, top_p, seed):
    x = tied_logits(seed)
    rows = x.shape[0]
    kept = sorted_reference(x, top_k, top_p, exactly_k=True)
    every = truncated_log_prob(x.unsqueeze(1).expand(rows, VOCAB, VOCAB), torch.arange(VOCAB).expand(rows, VOCAB),
                               Truncation(top_k, top_p, top_k_keeps_ties=False))
    expected = torch.where(kept, x, -torch.inf).log_softmax(-1)
    assert torch.allclose(every.log_prob[kept], expected[kept], atol=1e-6)
    # inside: the reference's set, plus the other copies of its boundary value (count-based ties)
    boundary = torch.where(kept, x, torch.inf).min(-1, keepdim=True).values
    inside = ~every.outside
    assert (kept <= inside).all() and ((inside & ~kept) <= (x == boundary)).all()
    if top_k == 3:  # row 0: six tied at the top, exactly 3 kept: each has probability 1/3
        assert torch.allclose(every.log_prob[0, 5:11], torch.full((6,), -torch.log(torch.tensor(3.0))))


def test_ties_at_the_k_th_logit_are_the_difference_between_the_modes():
    x = tied_logits(0)[:1]
    labels = torch.tensor([5])  # one of the six tied at the top
    keeps_ties = truncated_log_prob(x, labels, Truncation(3, 1.0, top_k_keeps_ties=True))
    exactly_k = truncated_log_prob(x, labels, Truncation(3, 1.0, top_k_keeps_ties=False))
    assert keeps_ties.log_prob.item() == pytest.approx(-torch.log(torch.tensor(6.0)).item(), abs=1e-6)
    assert exactly_k.log_prob.item() == pytest.approx(-torch.log(torch.tensor(3.0)).item(), abs=1e-6)


def test_no_truncation_is_the_full_log_softmax_and_bad_top_p_is_refused():
    x = tied_logits(1)
    labels = torch.randint(0, VOCAB, (x.shape[0],), generator=torch.Generator().manual_seed(0))
    out = truncated_log_prob(x, labels, Truncation())
    assert torch.allclose(out.log_prob, x.log_softmax(-1).gather(-1, labels[:, None]).squeeze(-1), atol=1e-6)
    assert not out.outside.any() and not Truncation(top_k=-1).active
    with pytest.raises(ValueError, match=r"top_p=0 must be in \(0, 1\]"):
        Truncation(top_p=0)


TP_CASES = [(5, 1.0, True), (None, 0.9, True), (12, 0.8, True), (12, 0.8, False), (None, 0.3, False)]


def _tp_rank(rank: int, world: int, logits: torch.Tensor, labels: torch.Tensor, chunk_elements: int):
    """This rank's vocab shard; rows cut into chunks of `chunk_elements` shard elements."""
    truncation_module.CHUNK_ELEMENTS = chunk_elements
    shard = logits.shape[-1] // world
    mine = logits[..., rank * shard:(rank + 1) * shard]
    return [truncated_log_prob(mine, labels, Truncation(k, p, ties)) for k, p, ties in TP_CASES]


def test_vocab_parallel_tp2_equals_one_rank():
    gen = torch.Generator().manual_seed(3)
    rows = 40
    logits = 2 * torch.randn(rows, VOCAB, generator=gen)
    logits[:20] = (2 * logits[:20]).round() / 2  # ties, across the two shards too
    logits[20:30, 40:] += 3  # the mass in rank 1's half
    logits[30:, -4:] = torch.finfo(torch.float32).min  # megatron's padded vocab ids (mask_vocab_padding)
    labels = torch.randint(0, VOCAB - 4, (rows,), generator=gen)
    labels[:8] = logits[:8].argmax(-1)  # the top tokens: kept by every case
    single = [truncated_log_prob(logits, labels, Truncation(k, p, ties)) for k, p, ties in TP_CASES]
    # 7 rows of 32 shard elements per chunk: six chunks, the last a partial one
    ranks = run_ranks(_tp_rank, 2, logits, labels, 7 * (VOCAB // 2))
    for case, expected in zip(TP_CASES, single):
        assert expected.outside.any() and not expected.outside.all(), case  # both kinds of label
        for got in (r[TP_CASES.index(case)] for r in ranks):
            torch.testing.assert_close(got.log_prob, expected.log_prob, atol=1e-5, rtol=0)
            assert torch.equal(got.outside, expected.outside), case
