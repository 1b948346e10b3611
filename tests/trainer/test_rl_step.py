"""Controller-side step math against hand-computed numbers."""
import math

import numpy as np
import pytest
import torch

from hybridrl.algorithms.kl_control import AdaptiveKLController, FixedKLController
from hybridrl.data.batch import Batch
from hybridrl.rewards.manager import token_level_rewards as place_scores_on_last_token
from hybridrl.trainer.rl_step import (
    AdvantageSettings,
    add_distillation_advantages,
    add_turn_scores,
    apply_kl_in_reward,
    compute_batch_advantages,
    groups_with_reward_spread,
    overlong_penalty,
    response_metrics,
)


def test_kl_in_reward_subtracts_beta_times_k1_and_adapts():
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    ref = torch.tensor([[-1.5, -1.0, -0.5]])
    mask = torch.tensor([[1, 1, 0]])
    scores = torch.tensor([[0.0, 1.0, 0.0]])
    batch = Batch({"old_log_probs": old, "ref_log_probs": ref, "response_mask": mask, "token_level_scores": scores})
    ctrl = FixedKLController(0.1)
    metrics = apply_kl_in_reward(batch, ctrl, "k1")
    # k1 = old - ref = [0.5, -1.0, (masked)]
    assert torch.allclose(batch["token_level_rewards"], torch.tensor([[-0.05, 1.1, 0.0]]))
    assert metrics["actor/reward_kl_penalty"] == pytest.approx((0.5 - 1.0) / 2)
    adaptive = AdaptiveKLController(0.1, target_kl=1.0, horizon=10)
    apply_kl_in_reward(batch, adaptive, "k1")
    # Ziegler: error = clip(kl/target - 1, -0.2, 0.2) = clip(-1.25) = -0.2; beta *= 1 + err * n/horizon
    assert adaptive.value == pytest.approx(0.1 * (1 - 0.2 * 1 / 10))


def test_grpo_advantages_from_batch_match_hand_computation():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]])
    scores = torch.tensor([1.0, 0.0, 3.0, 5.0])
    batch = Batch({"response_mask": mask, "token_level_rewards": place_scores_on_last_token(scores, mask)},
                  {"uid": np.array(["a", "a", "b", "b"], dtype=object)})
    compute_batch_advantages(batch, AdvantageSettings("grpo"))
    # group a: mean .5, unbiased std sqrt(.5); group b: mean 4, std sqrt(2)
    a = 0.5 / math.sqrt(0.5)
    b = 1.0 / math.sqrt(2.0)
    expected_seq = torch.tensor([a, -a, -b, b])
    adv = batch["advantages"]
    for row in range(4):
        valid = mask[row].bool()
        assert torch.allclose(adv[row][valid], expected_seq[row].expand(int(valid.sum())), atol=1e-5)
        assert torch.all(adv[row][~valid] == 0)


def test_gae_uses_values_column():
    mask = torch.tensor([[1, 1]])
    rewards = torch.tensor([[0.0, 1.0]])
    values = torch.tensor([[0.5, 0.2]])
    batch = Batch({"response_mask": mask, "token_level_rewards": rewards, "values": values})
    compute_batch_advantages(batch, AdvantageSettings("gae", gamma=0.9, lam=0.8))
    # delta1 = 1 - 0.2 = 0.8; delta0 = 0 + 0.9*0.2 - 0.5 = -0.32; A0 = -0.32 + 0.72*0.8 = 0.256
    assert torch.allclose(batch["returns"], torch.tensor([[0.256 + 0.5, 0.8 + 0.2]]), atol=1e-6)


def test_overlong_penalty_linear_in_buffer():
    lengths = torch.tensor([10, 16, 18, 20, 25])
    out = overlong_penalty(lengths, max_length=20, buffer=4, factor=1.0)
    assert torch.allclose(out, torch.tensor([0.0, 0.0, -0.5, -1.0, -1.0]))
    hard = overlong_penalty(lengths, max_length=20, buffer=0, factor=2.0)
    assert torch.allclose(hard, torch.tensor([0.0, 0.0, 0.0, 0.0, -2.0]))


def test_dynamic_sampling_keeps_only_groups_with_spread():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 3.0])
    uids = np.array(["x", "x", "y", "y", "z", "z", "solo"], dtype=object)
    keep = groups_with_reward_spread(scores, uids)
    assert keep.tolist() == [False, False, True, True, False, False, False]


def test_response_metrics():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    batch = Batch({"response_mask": mask, "responses": torch.zeros(2, 3, dtype=torch.long),
                   "attention_mask": torch.cat([torch.ones(2, 1, dtype=torch.long), mask], 1),
                   "token_level_scores": torch.tensor([[0, 1.0, 0], [0, 0, 0.0]])})
    m = response_metrics(batch)
    assert m["response_length/mean"] == 2.5 and m["response_length/clip_ratio"] == 0.5
    assert m["critic/score/mean"] == 0.5 and m["critic/score/max"] == 1.0
    assert "response_length/model_tokens_mean" not in m


def test_rollout_log_prob_gap_is_over_response_tokens_only():
    from hybridrl.trainer.rl_step import rollout_log_prob_gap

    old = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.25, 9.0]])
    rollout = torch.tensor([[-1.5, -2.0, 0.0], [-0.5, -0.5, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])  # the 3 and 9 gaps sit on padding
    gap = rollout_log_prob_gap(old, rollout, mask)
    assert gap == {"rollout/log_prob_abs_diff_max": 0.5, "rollout/log_prob_abs_diff_mean": 0.75 / 4}


def test_response_metrics_of_multi_turn_rows_count_observation_tokens_in_the_length():
    # row 0: model, observation, observation, model (4 of 4 columns: at the budget); row 1: one model token
    mask = torch.tensor([[1, 0, 0, 1], [1, 0, 0, 0]])
    attended = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    batch = Batch({"response_mask": mask, "responses": torch.zeros(2, 4, dtype=torch.long),
                   "attention_mask": torch.cat([torch.ones(2, 2, dtype=torch.long), attended], 1)})
    m = response_metrics(batch)
    assert m["response_length/mean"] == 2.5 and m["response_length/max"] == 4
    assert m["response_length/clip_ratio"] == 0.5 and m["response_length/model_tokens_mean"] == 1.5


def _scored(uids, scores):
    mask = torch.ones(len(uids), 2, dtype=torch.long)
    return Batch({"response_mask": mask, "token_level_scores": place_scores_on_last_token(torch.tensor(scores), mask)},
                 {"uid": np.array(uids, dtype=object)})


def test_select_groups_prefers_spread_then_fills_with_zero_spread():
    from hybridrl.trainer.rl_step import count_groups_with_spread, select_groups_with_spread

    first = _scored(["a", "a", "b", "b", "c", "c"], [1.0, 0.0, 1.0, 1.0, 0.0, 0.0])   # a has spread
    second = _scored(["d", "d", "e", "e", "f", "f"], [0.0, 0.0, 0.5, 1.0, 1.0, 0.0])  # e, f have spread
    assert count_groups_with_spread([first, second]) == 3
    batch, zero_used = select_groups_with_spread([first, second], 3)
    assert list(batch["uid"]) == ["a", "a", "e", "e", "f", "f"] and zero_used == 0
    batch, zero_used = select_groups_with_spread([first, second], 5)
    assert list(batch["uid"]) == ["a", "a", "e", "e", "f", "f", "b", "b", "c", "c"] and zero_used == 2
    with pytest.raises(ValueError, match="only 6 groups"):
        select_groups_with_spread([first, second], 7)


def test_merge_part_metrics_weights_means_sums_counts_and_takes_extremes():
    from hybridrl.trainer.part_metrics import merge_part_metrics

    rounds = [
        {"reward/score_mean": 0.5, "reward/score_min": 0.1, "reward/score_max": 0.8, "reward/fallbacks": 1.0,
         "reward/timeouts": 1.0, "rollout/generate_s": 2.0, "rollout/response_tokens": 100.0,
         "rollout/tokens_per_s": 50.0, "rollout/kv_cache_usage_bound": 0.25},
        {"reward/score_mean": 0.2, "reward/score_min": 0.0, "reward/score_max": 0.9, "reward/fallbacks": 2.0,
         "reward/timeouts": 0.0, "rollout/generate_s": 3.0, "rollout/response_tokens": 200.0,
         "rollout/tokens_per_s": 66.0, "rollout/kv_cache_usage_bound": 0.5},
    ]
    merged = merge_part_metrics(rounds, [64, 32])
    assert merged == pytest.approx({
        "reward/score_mean": (0.5 * 64 + 0.2 * 32) / 96, "reward/score_min": 0.0, "reward/score_max": 0.9,
        "reward/fallbacks": 3.0, "reward/timeouts": 1.0, "rollout/generate_s": 5.0, "rollout/response_tokens": 300.0,
        "rollout/tokens_per_s": 300.0 / 5.0, "rollout/kv_cache_usage_bound": 0.5,
    })
    # replicas generate at the same time: the step waited for the slower one
    concurrent = merge_part_metrics(rounds, [64, 32], concurrent=True)
    assert concurrent["rollout/generate_s"] == 3.0 and concurrent["rollout/tokens_per_s"] == pytest.approx(100.0)
    assert concurrent["rollout/response_tokens"] == 300.0 and concurrent["reward/fallbacks"] == 3.0


def test_baseline_per_row_follows_each_rows_prompt():
    from hybridrl.trainer.rl_step import baseline_per_row

    rows = np.array(["b", "a", "b", "c", "a"], dtype=object)
    baseline = baseline_per_row(rows, ["a", "b", "c"], torch.tensor([0.5, 1.0, -2.0]))
    assert baseline.tolist() == [1.0, 0.5, 1.0, -2.0, 0.5]
    with pytest.raises(ValueError, match=r"no baseline response for prompt uid\(s\) \['d'\]"):
        baseline_per_row(np.array(["a", "d"], dtype=object), ["a"], torch.tensor([0.0]))


def test_merge_part_metrics_of_multi_turn_replicas():
    """Two rollout replicas' agent-loop figures: tool counts and call time add up, per-sample rates are
    weighted by the replicas' samples, maxima stay maxima, the tool rounds' wall time is the slower one."""
    from hybridrl.trainer.part_metrics import merge_part_metrics

    replicas = [
        {"tools/calls": 6.0, "tools/errors/timeout": 1.0, "tools/time_s": 0.5, "tools/time_s_max": 0.2,
         "multi_turn/turns_mean": 2.0, "multi_turn/tool_use_mean": 0.75, "multi_turn/turns_max": 3.0,
         "multi_turn/model_tokens": 300.0, "multi_turn/observation_tokens": 80.0, "multi_turn/tool_wall_s": 0.3},
        {"tools/calls": 2.0, "tools/errors/timeout": 0.0, "tools/time_s": 0.25, "tools/time_s_max": 0.4,
         "multi_turn/turns_mean": 1.0, "multi_turn/tool_use_mean": 0.25, "multi_turn/turns_max": 2.0,
         "multi_turn/model_tokens": 100.0, "multi_turn/observation_tokens": 20.0, "multi_turn/tool_wall_s": 0.6},
    ]
    merged = merge_part_metrics(replicas, [8, 8], concurrent=True)
    assert merged == pytest.approx({
        "tools/calls": 8.0, "tools/errors/timeout": 1.0, "tools/time_s": 0.75, "tools/time_s_max": 0.4,
        "multi_turn/turns_mean": 1.5, "multi_turn/tool_use_mean": 0.5, "multi_turn/turns_max": 3.0,
        "multi_turn/model_tokens": 400.0, "multi_turn/observation_tokens": 100.0, "multi_turn/tool_wall_s": 0.6,
    })


def test_per_turn_rewards_join_the_trajectory_score_and_compose_with_the_estimators():
    """Multi-turn rows: model turns (mask 1) with observations between them (mask 0). The trajectory score
    lands on the last model token, each turn's reward on that turn's last token (`turn_scores`); GRPO
    sees each sequence's total, REINFORCE++ the returns-to-go over model tokens. All hand-computed."""
    #              turn 0    obs   turn 1   pad
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0],
                         [1, 1, 1, 0, 0, 0, 0],   # one turn, no call
                         [1, 0, 0, 1, 0, 0, 0],   # turn 0 is one token
                         [1, 1, 0, 1, 1, 1, 0]])
    turn_scores = torch.zeros(4, 7)
    turn_scores[0, 1], turn_scores[0, 5] = -0.5, 0.25   # a failed call in turn 0; a bonus on the final turn
    turn_scores[2, 0], turn_scores[2, 3] = 1.0, 0.0
    turn_scores[3, 1] = 2.0
    turn_scores[1, 6] = 7.0                             # on padding: never counted
    scores = torch.tensor([1.0, 0.0, 3.0, 5.0])
    batch = Batch({"response_mask": mask, "turn_scores": turn_scores},
                  {"uid": np.array(["a", "a", "b", "b"], dtype=object)})
    token_scores, metrics = add_turn_scores(place_scores_on_last_token(scores, mask), batch)
    expected = torch.tensor([[0.0, -0.5, 0, 0, 0.0, 1.0 + 0.25, 0],
                             [0.0, 0.0, 0.0, 0, 0, 0, 0],
                             [1.0, 0, 0, 3.0, 0, 0, 0],
                             [0.0, 2.0, 0, 0.0, 0.0, 5.0, 0]])
    assert torch.equal(token_scores, expected)
    assert metrics == {"reward/turn_score_mean": pytest.approx((-0.25 + 0.0 + 1.0 + 2.0) / 4)}
    # no turn_scores column: the scores are left as they are, no metric
    plain = Batch({"response_mask": mask})
    assert add_turn_scores(expected, plain) == (expected, {})

    # GRPO: one advantage per sequence from its total (final score + its turn rewards)
    batch["token_level_rewards"] = token_scores
    compute_batch_advantages(batch, AdvantageSettings("grpo"))
    totals = torch.tensor([0.75, 0.0, 4.0, 7.0])     # a: 0.75 vs 0; b: 4 vs 7
    a, b = 0.375 / math.sqrt(0.75 ** 2 / 2), 1.5 / math.sqrt(4.5)
    assert totals.tolist() == [float(token_scores[r].sum()) for r in range(4)]
    for row, value in enumerate([a, -a, -b, b]):
        valid = mask[row].bool()
        assert torch.allclose(batch["advantages"][row][valid], torch.full((int(valid.sum()),), value), atol=1e-5)
        assert torch.all(batch["advantages"][row][~valid] == 0)

    # REINFORCE++ (gamma 0.5): returns-to-go over model tokens (observations skipped), then whitened
    compute_batch_advantages(batch, AdvantageSettings("reinforce_plus_plus", gamma=0.5))
    returns = torch.tensor([[0.5 * (-0.5 + 0.5 * (0.5 * 1.25)), -0.5 + 0.5 * (0.5 * 1.25), 0, 0, 0.5 * 1.25, 1.25, 0],
                            [0.0, 0.0, 0.0, 0, 0, 0, 0],
                            [1.0 + 0.5 * 3.0, 0, 0, 3.0, 0, 0, 0],
                            [0.5 * (2.0 + 0.5 * 0.25 * 5.0), 2.0 + 0.5 * 0.25 * 5.0, 0, 0.25 * 5.0, 0.5 * 5.0, 5.0, 0]])
    valid = mask.bool()
    whitened = (returns - returns[valid].mean()) / returns[valid].std()
    assert torch.allclose(batch["advantages"][valid], whitened[valid], atol=1e-5)


def test_distillation_never_distils_a_multi_turn_observation_token():
    # a conversation: model tokens, a tool's observation (mask 0), model tokens again, then padding
    student = torch.tensor([[-1.0, -2.0, -0.3, -0.2, -1.5, 0.0], [-0.5, -0.5, -4.0, 0.0, 0.0, 0.0]])
    teacher = torch.tensor([[-0.5, -2.5, -9.0, -9.0, -1.0, -3.0], [-1.5, -0.5, -1.0, -2.0, -2.0, -2.0]])
    mask = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 0]])
    batch = Batch({"old_log_probs": student, "teacher_log_probs": teacher, "response_mask": mask})
    metrics = add_distillation_advantages(batch, 2.0, with_task_reward=False)
    # -2 x (student - teacher) on model tokens, by hand; 0 on the observation and padding
    expected = torch.tensor([[1.0, -1.0, 0.0, 0.0, 1.0, 0.0], [-2.0, 0.0, 6.0, 0.0, 0.0, 0.0]])
    assert torch.equal(batch["advantages"], expected) and torch.equal(batch["returns"], expected)
    # reverse KL on the 6 model tokens: -0.5, 0.5, -0.5 | 1.0, 0.0, -3.0
    assert metrics["distillation/reverse_kl_per_token"] == pytest.approx(-2.5 / 6)
    assert metrics["distillation/reverse_kl_per_sequence"] == pytest.approx((-0.5 - 2.0) / 2)


def test_with_the_top_k_loss_the_reverse_kl_is_a_metric_and_the_advantage_carries_no_distillation():
    """top_k_forward_kl: the signal is the update's loss term; the sampled-token reverse KL is measured alone. With the
    task reward its advantages pass through unchanged; without one (pure distillation) they are zero."""
    student = torch.tensor([[-1.0, -2.0, 0.0]])
    teacher = torch.tensor([[-0.5, -2.5, -3.0]])
    mask = torch.tensor([[1, 1, 0]])
    task = torch.tensor([[0.7, 0.7, 0.0]])
    batch = Batch({"old_log_probs": student, "teacher_log_probs": teacher, "response_mask": mask,
                   "advantages": task.clone(), "returns": task.clone()})
    metrics = add_distillation_advantages(batch, 2.0, with_task_reward=True, in_advantage=False)
    assert torch.equal(batch["advantages"], task)
    assert metrics["distillation/reverse_kl_per_token"] == pytest.approx(0.0)  # (-0.5 + 0.5) / 2
    add_distillation_advantages(batch, 2.0, with_task_reward=False, in_advantage=False)
    assert torch.equal(batch["advantages"], torch.zeros(1, 3)) and torch.equal(batch["returns"], torch.zeros(1, 3))
