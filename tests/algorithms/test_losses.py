"""Masked reductions, KL estimators, PPO/value losses, aggregation modes and KL controllers, checked
against hand-computed values and naive float64 Python loops."""
import math
import statistics
from types import SimpleNamespace

import pytest
import torch

from hybridrl.algorithms import (
    LOSS_AGG_MODES,
    AdaptiveKLController,
    FixedKLController,
    aggregate_loss,
    kl_controller_from_config,
    kl_penalty,
    make_kl_controller,
    masked_mean,
    masked_var,
    masked_whiten,
    ppo_policy_loss,
    value_loss,
)

F64 = torch.float64
NAN = float("nan")


# --- masked reductions ----------------------------------------------------------------------------

def test_masked_mean_var_against_statistics_module():
    x = torch.tensor([[1.0, 2.0, NAN], [4.0, -math.inf, 8.0]], dtype=F64)  # junk where masked
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    kept = [1.0, 2.0, 4.0, 8.0]
    assert masked_mean(x, mask).item() == pytest.approx(statistics.fmean(kept), abs=1e-12)
    assert masked_var(x, mask).item() == pytest.approx(statistics.variance(kept), abs=1e-12)
    assert masked_var(x, mask, unbiased=False).item() == pytest.approx(statistics.pvariance(kept), abs=1e-12)
    torch.testing.assert_close(masked_mean(x, mask, dim=1), torch.tensor([1.5, 6.0], dtype=F64))
    torch.testing.assert_close(masked_mean(x, mask, dim=0), torch.tensor([2.5, 2.0, 8.0], dtype=F64))


def test_masked_mean_empty_rows_are_zero_and_float_mask_weights():
    x = torch.tensor([[3.0, 5.0], [7.0, 9.0]], dtype=F64)
    torch.testing.assert_close(
        masked_mean(x, torch.tensor([[0, 0], [1, 1]]), dim=-1), torch.tensor([0.0, 8.0], dtype=F64)
    )
    weights = torch.tensor([[0.25, 0.75], [0.0, 0.0]], dtype=F64)
    assert masked_mean(x, weights).item() == pytest.approx((0.25 * 3 + 0.75 * 5) / 1.0)
    assert masked_mean(x, torch.zeros(2, 2)).item() == 0.0
    assert masked_var(x, torch.tensor([[0, 1], [0, 0]])).item() == 0.0  # one element: 0, not NaN


def test_masked_whiten_against_naive():
    x = torch.tensor([[1.0, 2.0, 100.0], [4.0, 5.0, 9.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    kept = [1.0, 2.0, 4.0, 5.0, 9.0]
    mean, std = statistics.fmean(kept), statistics.stdev(kept)
    expected = [
        [(v - mean) / std if m else 0.0 for v, m in zip(r, mr)] for r, mr in zip(x.tolist(), mask.tolist())
    ]
    torch.testing.assert_close(masked_whiten(x, mask), torch.tensor(expected, dtype=F64))
    kept_scale = [[e + mean if m else 0.0 for e, m in zip(r, mr)] for r, mr in zip(expected, mask.tolist())]
    torch.testing.assert_close(masked_whiten(x, mask, shift_mean=False), torch.tensor(kept_scale, dtype=F64))


# --- KL penalty -----------------------------------------------------------------------------------

def naive_kl(log_ratio, kind):
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "abs":
        return abs(log_ratio)
    return min(10.0, math.exp(-log_ratio) + log_ratio - 1)  # k3 is >= 0; only the upper clamp bites


@pytest.mark.parametrize("kind,alias", [("k1", "kl"), ("k2", "mse"), ("k3", "low_var_kl"), ("abs", "abs")])
def test_kl_penalty_kinds_and_aliases(kind, alias):
    log_ratios = [0.5, -0.3, 0.0, 2.0, -1.7, 50.0, -50.0]
    ref = torch.tensor([-1.0, -0.2, -3.0, -0.5, -2.0, -60.0, -1.0], dtype=F64)
    log_prob = (ref + torch.tensor(log_ratios, dtype=F64)).requires_grad_()
    out = kl_penalty(log_prob, ref, kind)
    expected = torch.tensor([naive_kl(r, kind) for r in log_ratios], dtype=F64)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(kl_penalty(log_prob, ref, alias), out)
    out.sum().backward()
    assert torch.isfinite(log_prob.grad).all()


def test_kl_k3_hand_value_and_clamp():
    # log_ratio 0.5: exp(-0.5) + 0.5 - 1 = 0.1065306597...
    out = kl_penalty(torch.tensor([0.3, 0.0, 0.0]), torch.tensor([-0.2, 50.0, -50.0]), "k3")
    torch.testing.assert_close(out, torch.tensor([0.10653066, 10.0, 10.0]))


def test_kl_unknown_kind_names_valid_kinds():
    with pytest.raises(ValueError, match="k3") as info:
        kl_penalty(torch.zeros(1), torch.zeros(1), "k4")
    assert "low_var_kl" in str(info.value)


# --- PPO policy loss ------------------------------------------------------------------------------

def naive_ppo_token(log_prob, old_log_prob, advantage, clip_low, clip_high, dual_clip):
    log_ratio = min(max(log_prob - old_log_prob, -20.0), 20.0)
    ratio = math.exp(log_ratio)
    plain = -advantage * ratio
    clipped = -advantage * min(max(ratio, 1 - clip_low), 1 + clip_high)
    loss = max(plain, clipped)
    dual_active = False
    if dual_clip is not None and advantage < 0:
        bound = -advantage * dual_clip
        dual_active = loss > bound
        loss = min(loss, bound)
    return loss, clipped > plain, dual_active, log_ratio


def test_ppo_hand_computed_cases():
    # A=+1, r=1.5 -> -1.2 (clipped); A=-1, r=0.5 -> 0.8 (clipped); A=-1, r=4 -> max(4, 1.2)=4 then
    # dual clip min(4, 3) = 3; A=+1, r=0.5 -> max(-0.5, -0.8) = -0.5 (unclipped). Mean = 2.1 / 4.
    ratios = torch.tensor([[1.5, 0.5, 4.0, 0.5]], dtype=F64)
    old = torch.zeros(1, 4, dtype=F64)
    log_prob = torch.log(ratios).requires_grad_()
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0]], dtype=F64)
    loss, metrics = ppo_policy_loss(log_prob, old, adv, torch.ones(1, 4))
    assert loss.item() == pytest.approx(2.1 / 4)
    assert metrics["clipfrac"].item() == pytest.approx(0.5)
    assert metrics["clipfrac_lower"].item() == pytest.approx(0.25)
    assert metrics["approx_kl"].item() == pytest.approx(-math.log(1.5 * 0.5 * 4 * 0.5) / 4)
    loss.backward()
    # Only the unclipped token has a gradient: d(-A * r)/d log_prob / N = -1 * 0.5 / 4.
    torch.testing.assert_close(log_prob.grad, torch.tensor([[0.0, 0.0, 0.0, -0.125]], dtype=F64))
    loss_no_dual, metrics = ppo_policy_loss(log_prob, old, adv, torch.ones(1, 4), dual_clip=None)
    assert loss_no_dual.item() == pytest.approx(3.1 / 4)
    assert metrics["clipfrac_lower"].item() == 0.0


@pytest.mark.parametrize(
    "clip_low,clip_high,dual_clip", [(0.2, 0.2, 3.0), (0.2, 0.28, None), (0.1, 0.3, 1.5)]
)
def test_ppo_matches_naive_loop_with_extreme_log_ratios(clip_low, clip_high, dual_clip):
    gen = torch.Generator().manual_seed(7)
    old = torch.randn(4, 6, generator=gen, dtype=F64)
    log_prob = old + torch.randn(4, 6, generator=gen, dtype=F64) * 0.5
    log_prob[0, 0], log_prob[0, 1], log_prob[3, 2] = old[0, 0] + 50, old[0, 1] - 50, old[3, 2] + 30
    adv = torch.randn(4, 6, generator=gen, dtype=F64)
    adv[0, 0], adv[0, 1] = -2.0, 1.5
    mask = torch.ones(4, 6)
    mask[1] = 0  # an empty row
    mask[2, 4:] = 0
    log_prob[2, 5] = NAN  # junk under the mask must not leak
    log_prob.requires_grad_()
    loss, metrics = ppo_policy_loss(log_prob, old, adv, mask, clip_low, clip_high, dual_clip)

    rows = [
        [naive_ppo_token(lp, o, a, clip_low, clip_high, dual_clip) if m else None
         for lp, o, a, m in zip(*cols)]
        for cols in zip(log_prob.tolist(), old.tolist(), adv.tolist(), mask.tolist())
    ]
    tokens = [t for row in rows for t in row if t is not None]
    assert loss.item() == pytest.approx(statistics.fmean(t[0] for t in tokens), rel=1e-12)
    assert metrics["clipfrac"].item() == pytest.approx(statistics.fmean(float(t[1]) for t in tokens))
    assert metrics["clipfrac_lower"].item() == pytest.approx(statistics.fmean(float(t[2]) for t in tokens))
    assert metrics["approx_kl"].item() == pytest.approx(statistics.fmean(-t[3] for t in tokens))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(log_prob.grad).all()
    assert log_prob.grad[1].abs().sum() == 0 and log_prob.grad[2, 4:].abs().sum() == 0


def test_ppo_rejects_bad_dual_clip():
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_policy_loss(
            torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), dual_clip=1.0
        )


# --- value loss -----------------------------------------------------------------------------------

def test_value_loss_hand_computed():
    # clip 0.2. (v=1, old=.5, R=0): max(1, .7^2) -> .5 * 1 = .5 (unclipped wins);
    # (v=.1, old=.5, R=1): clipped v=.3, max(.81, .49) -> .405; (v=.9, old=.5, R=1): clipped v=.7,
    # max(.01, .09) -> .045 (clipped wins). Token mean = .95 / 3.
    values = torch.tensor([[1.0, 0.1, 0.9, 123.0]], dtype=F64, requires_grad=True)
    old = torch.tensor([[0.5, 0.5, 0.5, 0.0]], dtype=F64)
    returns = torch.tensor([[0.0, 1.0, 1.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, metrics = value_loss(values, old, returns, mask, clip=0.2)
    assert loss.item() == pytest.approx(0.95 / 3)
    assert metrics["clipfrac"].item() == pytest.approx(1 / 3)
    loss.backward()
    # d/dv of .5 (v - R)^2 / 3 on the two unclipped tokens; the clipped one is flat in v.
    torch.testing.assert_close(values.grad, torch.tensor([[1.0 / 3, -0.9 / 3, 0.0, 0.0]], dtype=F64))
    unclipped, _ = value_loss(values, old, returns, mask, clip=None)
    assert unclipped.item() == pytest.approx((0.5 * 1 + 0.5 * 0.81 + 0.5 * 0.01) / 3)


# --- aggregation ----------------------------------------------------------------------------------

AGG_LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]], dtype=F64)
AGG_MASK = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 1, 1]])


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("token-sum", 27.0),  # 1 + 2 + 7 + 8 + 9
        ("token-mean", 27.0 / 5),
        ("seq-mean-token-sum", (3.0 + 24.0) / 2),  # the empty row is not a sequence
        ("seq-mean-token-mean", (1.5 + 8.0) / 2),
        ("seq-mean-token-sum-norm", 27.0 / (2 * 3)),  # T = 3 by default
    ],
)
def test_aggregate_loss_modes_hand_computed(mode, expected):
    loss = AGG_LOSS.clone()
    loss[0, 2] = NAN  # masked junk
    assert aggregate_loss(loss, AGG_MASK, mode).item() == pytest.approx(expected)


def test_aggregate_loss_norm_length_and_float_weights_and_empty():
    normed = aggregate_loss(AGG_LOSS, AGG_MASK, "seq-mean-token-sum-norm", norm_length=10)
    assert normed.item() == pytest.approx(27.0 / 20)
    weights = torch.tensor([[0.5, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.25]], dtype=F64)
    assert aggregate_loss(AGG_LOSS, weights, "token-mean").item() == pytest.approx((0.5 + 2 + 2.25) / 1.75)
    for mode in LOSS_AGG_MODES:
        assert aggregate_loss(AGG_LOSS, torch.zeros(3, 3), mode).item() == 0.0


def test_aggregate_loss_unknown_mode_lists_valid_modes():
    with pytest.raises(ValueError, match="did you mean 'token-mean'") as info:
        aggregate_loss(AGG_LOSS, AGG_MASK, "token_mean")
    assert all(mode in str(info.value) for mode in LOSS_AGG_MODES)


def test_aggregate_bf16_loss_is_reduced_in_float32():
    loss = torch.full((4, 300), 1.0 + 2**-7, dtype=torch.bfloat16)
    out = aggregate_loss(loss, torch.ones(4, 300), "token-sum")
    assert out.dtype == torch.float32 and out.item() == pytest.approx(1200 * (1 + 2**-7))


# --- KL controllers -------------------------------------------------------------------------------

def test_adaptive_kl_controller_ziegler_formula():
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    ctrl.update(current_kl=9.0, n_steps=256)  # error clip(0.5) = 0.2 -> x (1 + 0.2 * 256 / 1e4)
    assert ctrl.value == pytest.approx(0.1 * 1.00512)
    ctrl.update(current_kl=5.4, n_steps=100)  # error -0.1 -> x (1 - 0.001)
    assert ctrl.value == pytest.approx(0.1 * 1.00512 * 0.999)
    ctrl.update(current_kl=0.0, n_steps=1000)  # error clip(-1) = -0.2 -> x 0.98
    assert ctrl.value == pytest.approx(0.1 * 1.00512 * 0.999 * 0.98)


def test_fixed_controller_and_factories():
    fixed = FixedKLController(0.05)
    fixed.update(100.0, 1000)
    assert fixed.value == 0.05
    assert isinstance(make_kl_controller("adaptive", 0.2, target_kl=1.0, horizon=10), AdaptiveKLController)
    section = {"type": "adaptive", "kl_coef": 0.3, "target_kl": 2.0, "horizon": 5}
    from_dict = kl_controller_from_config(section)
    assert isinstance(from_dict, AdaptiveKLController) and from_dict.value == 0.3 and from_dict.horizon == 5
    from_obj = kl_controller_from_config(SimpleNamespace(type="fixed", kl_coef=0.01))
    assert type(from_obj) is FixedKLController and from_obj.value == 0.01
    with pytest.raises(ValueError, match="did you mean 'adaptive'"):
        make_kl_controller("adaptiv")
    with pytest.raises(ValueError, match="target_kl"):
        make_kl_controller("adaptive", 0.1)
