"""Advantage estimators against hand-computed values and naive float64 Python loops."""
import math
import statistics

import numpy as np
import pytest
import torch

from hybridrl.algorithms import (
    ADV_ESTIMATORS,
    compute_advantages,
    discounted_returns,
    gae_advantages,
    get_adv_estimator,
    grpo_advantages,
    register_adv_estimator,
    reinforce_pp_advantages,
    remax_advantages,
    rloo_advantages,
    sequence_to_token_advantages,
)

F64 = torch.float64


# --- naive references: plain Python lists and floats ---------------------------------------------

def naive_gae(rewards, values, mask, gamma, lam):
    """Per row: walk the unmasked positions backwards; masked positions get 0."""
    advantages, returns = [], []
    for r_row, v_row, m_row in zip(rewards, values, mask):
        adv_row, ret_row = [0.0] * len(r_row), [0.0] * len(r_row)
        next_value, next_adv = 0.0, 0.0
        for t in [t for t in range(len(r_row)) if m_row[t]][::-1]:
            delta = r_row[t] + gamma * next_value - v_row[t]
            next_adv = delta + gamma * lam * next_adv
            next_value = v_row[t]
            adv_row[t], ret_row[t] = next_adv, next_adv + v_row[t]
        advantages.append(adv_row)
        returns.append(ret_row)
    return advantages, returns


def naive_returns_to_go(rewards, mask, gamma):
    out = []
    for r_row, m_row in zip(rewards, mask):
        row, running = [0.0] * len(r_row), 0.0
        for t in range(len(r_row) - 1, -1, -1):
            if m_row[t]:
                running = r_row[t] + gamma * running
                row[t] = running
        out.append(row)
    return out


def naive_group_stats(scores, keys):
    groups = {}
    for score, key in zip(scores, keys):
        groups.setdefault(key, []).append(score)
    return groups


def naive_grpo(scores, keys, norm_by_std=True, eps=1e-6):
    groups = naive_group_stats(scores, keys)
    out = []
    for score, key in zip(scores, keys):
        members = groups[key]
        if len(members) == 1:
            out.append(0.0)
            continue
        centered = score - statistics.fmean(members)
        out.append(centered / (statistics.stdev(members) + eps) if norm_by_std else centered)
    return out


def naive_rloo(scores, keys):
    groups = naive_group_stats(scores, keys)
    out = []
    for score, key in zip(scores, keys):
        members = groups[key]
        if len(members) == 1:
            out.append(0.0)
        else:
            others = list(members)
            others.remove(score)
            out.append(score - statistics.fmean(others))
    return out


def naive_whiten(rows, mask):
    """Whiten the unmasked entries with their (unbiased) mean and std; masked entries -> 0."""
    flat = [x for row, m_row in zip(rows, mask) for x, m in zip(row, m_row) if m]
    mean, std = statistics.fmean(flat), statistics.stdev(flat)
    return [[(x - mean) / std if m else 0.0 for x, m in zip(row, m_row)] for row, m_row in zip(rows, mask)]


def random_case(seed, batch=5, length=7):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(batch, length, generator=gen, dtype=F64)
    values = torch.randn(batch, length, generator=gen, dtype=F64)
    mask = (torch.rand(batch, length, generator=gen) > 0.3).to(F64)
    mask[0] = 0.0  # an empty row
    mask[1, :] = 1.0  # a full row
    mask[2, 2] = 0.0  # a hole
    mask[2, 1] = mask[2, 3] = 1.0
    return rewards, values, mask


# --- GAE ------------------------------------------------------------------------------------------

def test_gae_hand_computed_two_tokens():
    # gamma = lam = 0.5, r = [0, 1], V = [0.5, 0.25]:
    # delta_1 = 1 - 0.25 = 0.75, A_1 = 0.75; delta_0 = 0 + 0.5 * 0.25 - 0.5 = -0.375,
    # A_0 = -0.375 + 0.25 * 0.75 = -0.1875; R = A + V = [0.3125, 1.0].
    adv, ret = gae_advantages(
        torch.tensor([[0.0, 1.0]], dtype=F64), torch.tensor([[0.5, 0.25]], dtype=F64),
        torch.tensor([[1.0, 1.0]], dtype=F64), gamma=0.5, lam=0.5,
    )
    torch.testing.assert_close(adv, torch.tensor([[-0.1875, 0.75]], dtype=F64))
    torch.testing.assert_close(ret, torch.tensor([[0.3125, 1.0]], dtype=F64))


def test_gae_passes_through_a_mask_hole_and_ignores_masked_inputs():
    # Same as the hand case with a masked token in between holding junk reward and value.
    adv, ret = gae_advantages(
        torch.tensor([[0.0, 9.0, 1.0, 5.0]], dtype=F64),
        torch.tensor([[0.5, 7.0, 0.25, -3.0]], dtype=F64),
        torch.tensor([[True, False, True, False]]),
        gamma=0.5, lam=0.5,
    )
    torch.testing.assert_close(adv, torch.tensor([[-0.1875, 0.0, 0.75, 0.0]], dtype=F64))
    torch.testing.assert_close(ret, torch.tensor([[0.3125, 0.0, 1.0, 0.0]], dtype=F64))


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.7, 0.0)])
def test_gae_matches_naive_loop(gamma, lam):
    rewards, values, mask = random_case(seed=1)
    adv, ret = gae_advantages(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = naive_gae(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam)
    torch.testing.assert_close(adv, torch.tensor(ref_adv, dtype=F64))
    torch.testing.assert_close(ret, torch.tensor(ref_ret, dtype=F64))
    assert torch.all(adv[0] == 0) and torch.all(ret[0] == 0)  # the empty row


def test_gae_lambda_one_is_returns_minus_values():
    # With lam = 1, A_t = G_t - V_t (the value terms telescope): an identity independent of the loop.
    rewards, values, mask = random_case(seed=2)
    adv, _ = gae_advantages(rewards, values, mask, gamma=0.9, lam=1.0)
    expected = torch.tensor(naive_returns_to_go(rewards.tolist(), mask.tolist(), 0.9), dtype=F64) - values
    torch.testing.assert_close(adv, expected * mask)


# --- returns-to-go and REINFORCE++ ----------------------------------------------------------------

def test_discounted_returns_hand_computed():
    # r = [1, junk, 2, 3] with the second masked, gamma = 0.5: G = [1 + 0.5 * 3.5, 0, 2 + 1.5, 3].
    out = discounted_returns(
        torch.tensor([[1.0, 100.0, 2.0, 3.0]], dtype=F64), torch.tensor([[1, 0, 1, 1]]), gamma=0.5
    )
    torch.testing.assert_close(out, torch.tensor([[2.75, 0.0, 3.5, 3.0]], dtype=F64))


def test_reinforce_pp_is_whitened_returns_over_the_batch():
    rewards, _, mask = random_case(seed=3)
    adv = reinforce_pp_advantages(rewards, mask, gamma=0.9)
    expected = naive_whiten(naive_returns_to_go(rewards.tolist(), mask.tolist(), 0.9), mask.tolist())
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=F64), rtol=1e-6, atol=1e-6)


# --- GRPO / Dr.GRPO / RLOO / ReMax ----------------------------------------------------------------

def test_grpo_hand_computed():
    # Group "a": scores 1, 3 -> mean 2, unbiased std sqrt(2); group "b" has one member.
    adv = grpo_advantages(torch.tensor([1.0, 5.0, 3.0], dtype=F64), ["a", "b", "a"], eps=0.0)
    s = math.sqrt(2.0)
    torch.testing.assert_close(adv, torch.tensor([-1 / s, 0.0, 1 / s], dtype=F64))


@pytest.mark.parametrize("norm_by_std", [True, False])
@pytest.mark.parametrize(
    "keys",
    [
        [3, 1, 3, 2, 1, 3, 7, 2],  # interleaved ints, a group of one (7)
        ["u-9", "u-1", "u-9", "u-2", "u-1", "u-9", "solo", "u-2"],  # string uids
        np.array(["x", "y", "x", "z", "y", "x", "w", "z"]),  # a numpy array of strings
    ],
)
def test_grpo_matches_naive_for_any_key_kind_and_order(keys, norm_by_std):
    scores = [0.5, -1.0, 2.0, 0.25, 3.0, 1.5, 4.0, -0.75]
    adv = grpo_advantages(torch.tensor(scores, dtype=F64), keys, norm_by_std=norm_by_std)
    torch.testing.assert_close(adv, torch.tensor(naive_grpo(scores, list(keys), norm_by_std), dtype=F64))


def test_grpo_tensor_index_equals_list_index():
    scores = torch.tensor([0.5, -1.0, 2.0, 0.25, 3.0, 1.5], dtype=F64)
    keys = [10, 4, 10, 4, 99, 10]
    expected = torch.tensor(naive_grpo(scores.tolist(), keys), dtype=F64)
    torch.testing.assert_close(grpo_advantages(scores, torch.tensor(keys)), expected)


def test_grpo_equal_scores_and_singletons_give_zero_not_nan():
    adv = grpo_advantages(torch.tensor([1.0, 1.0, 1.0, 7.0]), [0, 0, 0, 1])
    assert torch.equal(adv, torch.zeros(4))
    # 0.1 is inexact in binary: the group mean may differ from 0.1 by rounding; eps keeps it ~0.
    adv = grpo_advantages(torch.tensor([0.1, 0.1, 0.1], dtype=F64), ["a", "a", "a"])
    assert adv.abs().max() < 1e-9
    adv = grpo_advantages(torch.tensor([2.0, 4.0], dtype=F64), [0, 1], eps=0.0)
    assert torch.equal(adv, torch.zeros(2, dtype=F64))


def test_rloo_hand_computed_and_naive():
    # Group of three {1, 2, 6}: 1 - (2+6)/2 = -3, 2 - 3.5 = -1.5, 6 - 1.5 = 4.5; singleton -> 0.
    adv = rloo_advantages(torch.tensor([1.0, 9.0, 2.0, 6.0], dtype=F64), ["g", "s", "g", "g"])
    torch.testing.assert_close(adv, torch.tensor([-3.0, 0.0, -1.5, 4.5], dtype=F64))
    scores, keys = [0.3, -2.0, 1.1, 0.7, 5.0, 0.3], ["b", "a", "b", "a", "c", "b"]
    expected = torch.tensor(naive_rloo(scores, keys), dtype=F64)
    torch.testing.assert_close(rloo_advantages(torch.tensor(scores, dtype=F64), keys), expected)


def test_remax_and_broadcast():
    adv = remax_advantages(torch.tensor([1.0, 0.5]), torch.tensor([0.25, 1.0]))
    assert torch.equal(adv, torch.tensor([0.75, -0.5]))
    tokens = sequence_to_token_advantages(adv, torch.tensor([[1, 1, 0], [0, 0, 0]]))
    assert torch.equal(tokens, torch.tensor([[0.75, 0.75, 0.0], [0.0, 0.0, 0.0]]))
    with pytest.raises(ValueError):
        remax_advantages(torch.tensor([1.0, 0.5]), torch.tensor([0.25]))


def test_group_index_length_mismatch_is_an_error():
    with pytest.raises(ValueError, match="entries"):
        grpo_advantages(torch.tensor([1.0, 2.0]), [0, 0, 1])


# --- registry -------------------------------------------------------------------------------------

def test_registry_estimators_spread_sequence_scores_over_tokens():
    token_rewards = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 3.0], [2.0, 0.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    # Sequence scores 1, 3, 2 in one group: mean 2, unbiased std 1.
    adv, ret = compute_advantages("grpo", token_rewards, mask, group_index=[0, 0, 0], eps=0.0)
    expected = torch.tensor([[-1.0, -1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, expected)
    adv, _ = compute_advantages("rloo", token_rewards, mask, group_index=[0, 0, 0])
    torch.testing.assert_close(adv[:, 0], torch.tensor([-1.5, 1.5, 0.0], dtype=F64))
    baseline = torch.tensor([1.0, 1.0, 1.0], dtype=F64)
    adv, _ = compute_advantages("remax", token_rewards, mask, baseline_scores=baseline)
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.0, 2.0, 1.0], dtype=F64))


def test_registry_dr_grpo_skips_the_std_division_grpo_applies():
    # Sequence scores 1, 5, 3 in one group: mean 3, unbiased std 2, so the two estimators differ
    # by exactly that factor: GRPO (s - 3) / 2 = -1, 1, 0; Dr.GRPO s - 3 = -2, 2, 0.
    token_rewards = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 5.0], [3.0, 0.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    grpo, _ = compute_advantages("grpo", token_rewards, mask, group_index=[0, 0, 0], eps=0.0)
    dr_grpo, dr_returns = compute_advantages("dr_grpo", token_rewards, mask, group_index=[0, 0, 0])
    torch.testing.assert_close(grpo, torch.tensor([[-1.0, -1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]], dtype=F64))
    expected = torch.tensor([[-2.0, -2.0, 0.0], [2.0, 2.0, 2.0], [0.0, 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(dr_grpo, expected)
    torch.testing.assert_close(dr_returns, expected)


def test_registry_gae_whitens_and_reinforce_pp_matches_function():
    rewards, values, mask = random_case(seed=4)
    adv, ret = compute_advantages("gae", rewards, mask, values=values, gamma=0.9, lam=0.8)
    ref_adv, ref_ret = naive_gae(rewards.tolist(), values.tolist(), mask.tolist(), 0.9, 0.8)
    whitened = naive_whiten(ref_adv, mask.tolist())
    torch.testing.assert_close(adv, torch.tensor(whitened, dtype=F64), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ret, torch.tensor(ref_ret, dtype=F64))
    raw, _ = compute_advantages(
        "gae", rewards, mask, values=values, gamma=0.9, lam=0.8, whiten_advantages=False
    )
    torch.testing.assert_close(raw, torch.tensor(ref_adv, dtype=F64))
    rpp, _ = compute_advantages("reinforce_plus_plus", rewards, mask, gamma=0.9)
    torch.testing.assert_close(rpp, reinforce_pp_advantages(rewards, mask, gamma=0.9))


def test_registry_errors():
    with pytest.raises(ValueError, match="did you mean 'grpo'") as info:
        get_adv_estimator("gpro")
    assert "reinforce_plus_plus" in str(info.value)
    with pytest.raises(ValueError, match="needs values"):
        compute_advantages("gae", torch.zeros(1, 2), torch.ones(1, 2))
    with pytest.raises(ValueError, match="needs group_index"):
        compute_advantages("grpo", torch.zeros(1, 2), torch.ones(1, 2))
    with pytest.raises(TypeError):
        compute_advantages("grpo", torch.zeros(1, 2), torch.ones(1, 2), group_idx=[0])  # typo
    with pytest.raises(ValueError, match="already registered"):
        register_adv_estimator("grpo")(lambda inputs: (inputs.token_rewards, inputs.token_rewards))


def test_register_custom_estimator():
    @register_adv_estimator("test_only_constant")
    def constant(inputs):
        ones = torch.ones_like(inputs.token_rewards)
        return ones, ones

    try:
        adv, _ = compute_advantages("test_only_constant", torch.zeros(2, 2), torch.ones(2, 2))
        assert torch.equal(adv, torch.ones(2, 2))
    finally:
        del ADV_ESTIMATORS["test_only_constant"]
