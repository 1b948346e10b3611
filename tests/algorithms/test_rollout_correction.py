"""Rollout-mismatch correction (TIS / MIS): weights and masks against hand-computed numbers, the
corrected PPO loss against a plain-torch reference written here, and the refusals."""
import math

import pytest
import torch

from hybridrl.algorithms import (
    RolloutCorrection,
    aggregate_loss,
    correction_metrics,
    global_loss_normalizers,
    ppo_policy_loss,
    rollout_correction_weights,
)
from hybridrl.data.batch import Batch
from hybridrl.training.actor import require_rollout_log_probs

F64 = torch.float64
NAN = float("nan")
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=F64)
# rho = pi_old / mu per token, written out; the last column of row 1 is padding
RATIOS = [[0.5, 1.5, 3.0], [1.2, 0.25, 7.0]]
ROLLOUT = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.1, NAN]], dtype=F64)  # NaN: padding is never read
TARGET = ROLLOUT.nan_to_num(0.0) + torch.tensor(RATIOS, dtype=F64).log()


def weights(**settings):
    return rollout_correction_weights(TARGET, ROLLOUT, MASK, RolloutCorrection(**settings))


def close(actual, expected):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=F64), rtol=1e-12, atol=1e-12)


def test_token_tis_is_the_capped_ratio_and_zero_on_padding():
    out = weights(is_level="token", is_cap=2.0)
    close(out.token_weight, [[0.5, 1.5, 2.0], [1.2, 0.25, 0.0]])
    close(out.log_ratio, [[math.log(0.5), math.log(1.5), math.log(3.0)], [math.log(1.2), math.log(0.25), 0.0]])


def test_sequence_tis_is_the_capped_product_on_every_token():
    # row 0: 0.5 * 1.5 * 3 = 2.25, row 1: 1.2 * 0.25 = 0.3
    close(weights(is_level="sequence", is_cap=2.0).token_weight, [[2.0, 2.0, 2.0], [0.3, 0.3, 0.0]])
    close(weights(is_level="sequence", is_cap=3.0).token_weight, [[2.25, 2.25, 2.25], [0.3, 0.3, 0.0]])


def test_token_mask_drops_tokens_outside_the_band():
    out = weights(mask_level="token", mask_low=0.4, mask_high=2.5)
    close(out.token_weight, [[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])  # 3.0 and 0.25 leave [0.4, 2.5]


def test_sequence_and_geometric_masks_judge_whole_sequences():
    # band [0.5, 2]: the products (2.25, 0.3) both leave it; the geometric means (2.25^(1/3) = 1.310,
    # 0.3^(1/2) = 0.548) both stay inside
    close(weights(mask_level="sequence", mask_low=0.5, mask_high=2.0).token_weight, [[0.0] * 3, [0.0] * 3])
    close(weights(mask_level="geometric", mask_low=0.5, mask_high=2.0).token_weight, [[1.0] * 3, [1.0, 1.0, 0.0]])
    # [0.6, 1.5]: row 1's geometric mean 0.548 leaves it, row 0's 1.310 does not
    close(weights(mask_level="geometric", mask_low=0.6, mask_high=1.5).token_weight, [[1.0] * 3, [0.0] * 3])
    # a zero lower bound keeps every small ratio
    close(weights(mask_level="token", mask_low=0.0, mask_high=2.5).token_weight, [[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])


def test_tis_and_mis_multiply():
    out = weights(is_level="token", is_cap=2.0, mask_level="token", mask_low=0.4, mask_high=2.5)
    close(out.token_weight, [[0.5, 1.5, 0.0], [1.2, 0.0, 0.0]])


def test_metrics_are_hand_computed_and_sum_to_the_mini_batch_over_micro_batches():
    settings = RolloutCorrection(is_level="token", is_cap=2.0, mask_level="token", mask_low=0.4, mask_high=2.5)
    whole = correction_metrics(rollout_correction_weights(TARGET, ROLLOUT, MASK, settings), MASK, settings, 5.0, 2.0)
    assert whole["mean/rollout_correction/is_weight_mean"].item() == pytest.approx((0.5 + 1.5 + 2 + 1.2 + 0.25) / 5)
    assert whole["max/rollout_correction/is_weight_max"].item() == pytest.approx(2.0)
    assert whole["max/rollout_correction/log_ratio_abs_max"].item() == pytest.approx(math.log(4.0))
    assert whole["total/rollout_correction/masked_token_fraction"].item() == pytest.approx(2 / 5)
    assert whole["total/rollout_correction/masked_seq_fraction"].item() == pytest.approx(1.0)
    # one row per micro-batch, with the mini-batch's normalizers: the totals add up to the whole's
    parts = [correction_metrics(rollout_correction_weights(TARGET[i:i + 1], ROLLOUT[i:i + 1], MASK[i:i + 1], settings),
                                MASK[i:i + 1], settings, 5.0, 2.0) for i in range(2)]
    for name in ("masked_token_fraction", "masked_seq_fraction"):
        key = f"total/rollout_correction/{name}"
        assert sum(p[key].item() for p in parts) == pytest.approx(whole[key].item())
    # without IS, no IS metrics; without a mask, no mask metrics
    only_mask = RolloutCorrection(mask_level="token", mask_low=0.4, mask_high=2.5)
    keys = correction_metrics(rollout_correction_weights(TARGET, ROLLOUT, MASK, only_mask), MASK, only_mask, 5, 2)
    assert not any("is_weight" in k for k in keys)


def test_extreme_log_probs_give_finite_weights():
    rollout = torch.tensor([[-math.inf, -1.0]], dtype=F64)  # a token vLLM scored -inf
    target = torch.tensor([[-1.0, -500.0]], dtype=F64)
    mask = torch.ones(1, 2, dtype=F64)
    out = rollout_correction_weights(target, rollout, mask, RolloutCorrection(is_level="sequence", is_cap=5.0))
    assert torch.isfinite(out.token_weight).all()
    close(out.log_ratio, [[20.0, -20.0]])  # clamped as PPO's log-ratio is
    close(out.token_weight, [[1.0, 1.0]])  # exp(20 - 20)


def reference_pg_loss(log_prob, old, adv, mask, weight, mode, clip=0.2, dual=3.0):
    """PPO's clipped, dual-clipped token loss times the correction weight, aggregated over the
    original response mask (masked tokens keep their place in the denominators)."""
    ratio = torch.exp(log_prob - old)
    surrogate = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip, 1 + clip))
    token = torch.where(adv < 0, torch.minimum(surrogate, -adv * dual), surrogate) * weight
    lengths = mask.sum(-1)
    if mode == "token-mean":
        return (token * mask).sum() / mask.sum()
    if mode == "seq-mean-token-mean":
        return ((token * mask).sum(-1) / lengths).mean()
    raise AssertionError(mode)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_corrected_ppo_loss_equals_the_plain_torch_reference(mode):
    gen = torch.Generator().manual_seed(3)
    lengths = torch.tensor([8, 3, 6, 5])
    mask = (torch.arange(8) < lengths.unsqueeze(-1)).to(F64)
    old = -torch.rand(4, 8, generator=gen, dtype=F64) * 2
    rollout = old - (torch.rand(4, 8, generator=gen, dtype=F64) * 2 - 1)  # ratios in [e^-1, e]
    log_prob = (old + 0.3 * torch.randn(4, 8, generator=gen, dtype=F64)).requires_grad_()
    adv = torch.randn(4, 8, generator=gen, dtype=F64)
    settings = RolloutCorrection(is_level="token", is_cap=1.5, mask_level="token", mask_low=0.5, mask_high=2.0)
    result = rollout_correction_weights(old, rollout, mask, settings)
    assert (result.token_weight[mask.bool()] == 0).any() and (result.token_weight == 1.5).any()  # both act
    loss, _ = ppo_policy_loss(log_prob, old, adv, mask, agg=mode, token_weight=result.token_weight)
    loss.backward()
    grad = log_prob.grad.clone()
    log_prob.grad = None

    ratio = torch.exp(old - rollout)  # the weight, independently: min(rho, C) inside the band, else 0
    weight = torch.where((ratio >= 0.5) & (ratio <= 2.0), ratio.clamp(max=1.5), torch.zeros(()))
    expected = reference_pg_loss(log_prob, old, adv, mask, weight, mode)
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12)
    torch.testing.assert_close(grad, log_prob.grad, rtol=1e-12, atol=1e-12)
    # dropping the weight changes the loss: the test sees the correction
    plain, _ = ppo_policy_loss(log_prob, old, adv, mask, agg=mode)
    assert abs(plain.item() - expected.item()) > 1e-3
    # split over micro-batches with the mini-batch's normalizers: the parts sum to the whole
    norms = global_loss_normalizers([mask[:1], mask[1:]])
    parts = [ppo_policy_loss(log_prob[rows], old[rows], adv[rows], mask[rows], agg=mode,
                             global_tokens=norms.tokens, global_seqs=norms.seqs,
                             token_weight=result.token_weight[rows])[0] for rows in (slice(0, 1), slice(1, 4))]
    assert sum(p.item() for p in parts) == pytest.approx(expected.item(), rel=1e-12)


def test_the_weight_is_detached_and_shape_checked():
    log_prob = torch.zeros(1, 2, dtype=F64, requires_grad=True)
    weight = torch.ones(1, 2, dtype=F64, requires_grad=True)
    loss, _ = ppo_policy_loss(log_prob, torch.zeros(1, 2, dtype=F64), torch.ones(1, 2, dtype=F64),
                              torch.ones(1, 2), token_weight=weight)
    loss.backward()
    assert weight.grad is None and log_prob.grad is not None
    with pytest.raises(ValueError, match="token_weight"):
        ppo_policy_loss(log_prob, log_prob, log_prob, torch.ones(1, 2), token_weight=torch.ones(2, 1))


def test_aggregation_keeps_masked_tokens_in_the_denominator():
    loss = torch.tensor([[2.0, 4.0]], dtype=F64)
    mask = torch.ones(1, 2, dtype=F64)
    weight = torch.tensor([[1.0, 0.0]], dtype=F64)  # the second token masked by MIS
    assert aggregate_loss(loss * weight, mask, "token-mean").item() == pytest.approx(1.0)  # 2 / 2, not 2 / 1


@pytest.mark.parametrize("settings,fragment", [
    (dict(is_level="tokens"), "did you mean 'token'"),
    (dict(mask_level="geo"), "rollout mask level"),
    (dict(is_level="token", is_cap=0.0), "is_cap must be > 0"),
    (dict(mask_level="token", mask_low=2.0, mask_high=1.5), "mask_low < mask_high"),
])
def test_bad_settings_are_refused(settings, fragment):
    with pytest.raises(ValueError, match=fragment):
        RolloutCorrection(**settings)


def test_the_update_refuses_a_batch_without_rollout_log_probs():
    batch = Batch({"responses": torch.zeros(2, 3, dtype=torch.long)})
    assert not require_rollout_log_probs(batch, RolloutCorrection())  # off: nothing needed
    with pytest.raises(ValueError, match="algorithm.rollout_correction .*rollout_log_probs"):
        require_rollout_log_probs(batch, RolloutCorrection(is_level="token"))
    batch["rollout_log_probs"] = torch.zeros(2, 3)
    assert require_rollout_log_probs(batch, RolloutCorrection(mask_level="sequence"))
