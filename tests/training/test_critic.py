"""Critic and reward model on forked gloo ranks against plain torch/transformers computations.

The critic starts from a sequence-classification checkpoint (backbone + `score.weight`), so the
reference is exact: HF's backbone hidden states times the score row, `value_loss` + backward + clip
+ AdamW in plain torch. The reward model is compared with HF's own sequence classifier.
"""
from __future__ import annotations

from typing import Any

import torch

from tests.support.forked import run_ranks
from tests.support.training_fixtures import (
    job_config,
    policy_model,
    rollout_batch,
    sequence_classifier,
    with_critic,
    with_reward_model,
)
from tests.support.value_models import critic_rank, reference_critic, reward_model_case, reward_rank

TOL = 1e-5


def test_critic_values_and_update_equal_torch(tmp_path):
    rm = sequence_classifier(tmp_path / "critic")
    hf = policy_model(tmp_path / "policy")
    batch = rollout_batch(8)
    ref = reference_critic(rm, batch)
    # TP2 with sequence parallelism: the final hidden states reach the value head split along the
    # sequence over TP (megatron's own SP code on gloo; the norms' CPU stand-in tags their weights)
    for tp, pp, dp, sp in ((1, 1, 1, False), (2, 2, 1, False), (2, 1, 2, False), (2, 1, 1, True)):
        world = tp * pp * dp
        config = with_critic(job_config(hf, world=world), rm, tp=tp, pp=pp)
        config.critic.megatron.sequence_parallel = sp
        outs = [o for o in run_ranks(critic_rank, world, config, batch) if o is not None]
        assert len(outs) == dp
        before = torch.cat([o["before"] for o in outs])
        after = torch.cat([o["after"] for o in outs])
        metrics = outs[0]["metrics"]
        assert all(all(o["fused"]) for o in outs)  # torch's fused AdamW ran (fuse_torch_adam), equal to plain AdamW
        assert all(o["state_at_setup"] for o in outs)  # ... from state made at setup, equal to lazy AdamW
        assert (before - ref["before"]).abs().max() < TOL, (tp, pp, dp)
        assert abs(metrics.vf_loss - ref["loss"]) < TOL, (tp, pp, dp, metrics.vf_loss, ref["loss"])
        assert abs(metrics.grad_norm - ref["grad_norm"]) < TOL, (tp, pp, dp, metrics.grad_norm, ref["grad_norm"])
        assert (after - ref["after"]).abs().max() < TOL, (tp, pp, dp)
    assert (ref["after"] - ref["before"]).abs().max() > 1e-3  # the update changed the values


def test_critic_on_shared_prompts_equals_torch(tmp_path):
    """issue 41 item 3: GRPO-like grouped rows (two prompts, four samples each), whose prompt the critic's
    micro-batches hold once (`critic.model.shared_prefix`, on by default on CPU): values and the update equal
    plain torch's over the unshared rows at TP1, TP2 and PP2, and the sharing happened."""
    rm = sequence_classifier(tmp_path / "critic")
    hf = policy_model(tmp_path / "policy")
    batch = rollout_batch(8, seed=4, groups=[4, 4])
    ref = reference_critic(rm, batch)
    for tp, pp in ((1, 1), (2, 1), (1, 2)):
        config = with_critic(job_config(hf, world=tp * pp, micro=4), rm, tp=tp, pp=pp)
        config.critic.ppo_micro_batch_size_per_gpu = 4
        outs = [o for o in run_ranks(critic_rank, tp * pp, config, batch) if o is not None]
        (out,) = outs
        assert out["shared_ratio"] > 0.1, (tp, pp, out["shared_ratio"])  # prompts held once per micro-batch
        assert (out["before"] - ref["before"]).abs().max() < TOL, (tp, pp)
        assert abs(out["metrics"].grad_norm - ref["grad_norm"]) < TOL, (tp, pp)
        assert (out["after"] - ref["after"]).abs().max() < TOL, (tp, pp)


def test_reward_model_scores_equal_transformers(tmp_path):
    rm, hf, batch, expected = reward_model_case(tmp_path)
    for tp, pp, sp in ((1, 1, False), (2, 2, False), (2, 1, True)):
        config = with_reward_model(job_config(hf, world=tp * pp), rm, tp=tp, pp=pp)
        config.reward_model.megatron.sequence_parallel = sp
        scores = [s for s in run_ranks(reward_rank, tp * pp, config, batch) if s is not None]
        assert len(scores) == 1
        assert (scores[0] - expected).abs().max() < TOL, (tp, pp, sp)


def _reward_shared_rank(rank: int, world: int, config: Any, batch: Any) -> Any:
    from hybridrl.config.plan import build_plan
    from hybridrl.training.backend import MegatronBackend, role_spec
    from hybridrl.training.reward_model import MegatronRewardModel

    plan = build_plan(config)
    backend = MegatronBackend(role_spec(plan, "reward_model"))
    out = MegatronRewardModel(backend, plan).compute_scores(batch)
    shared = backend.tokens_seen.ratios()[1]
    return None if out is None else (out["rm_scores"].clone(), shared)


def test_reward_model_scores_on_shared_prompts_equal_transformers(tmp_path):
    """issue 41 item 3: the reward model on grouped rows (its prompt held once per micro-batch by default on CPU)
    scores each row as transformers does on the unshared row, at TP1, TP2 and PP2."""
    import transformers

    rm = sequence_classifier(tmp_path / "rm")
    hf = policy_model(tmp_path / "policy")
    batch = rollout_batch(8, seed=6, groups=[3, 5])
    model = transformers.LlamaForSequenceClassification.from_pretrained(rm, dtype=torch.float32,
                                                                        attn_implementation="eager")
    with torch.no_grad():
        expected = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                         position_ids=batch["position_ids"]).logits.squeeze(-1)
    for tp, pp in ((1, 1), (2, 1), (1, 2)):
        config = with_reward_model(job_config(hf, world=tp * pp), rm, tp=tp, pp=pp)
        (out,) = [o for o in run_ranks(_reward_shared_rank, tp * pp, config, batch) if o is not None]
        scores, shared = out
        assert shared > 0.1, (tp, pp, shared)  # each group's prompt was held once
        assert (scores - expected).abs().max() < TOL, (tp, pp)


def _critic_values_rank(rank: int, world: int, config: Any, batch: Any) -> Any:
    from hybridrl.config.plan import build_plan
    from hybridrl.training.backend import MegatronBackend, role_spec
    from hybridrl.training.critic import MegatronCritic

    plan = build_plan(config)
    backend = MegatronBackend(role_spec(plan, "critic"))
    out = MegatronCritic(backend, plan).compute_values(batch)
    return None if out is None else (out["values"].clone(), backend.head_loaded)


def test_critic_from_a_causal_lm_gets_a_fresh_head_same_on_every_layout(tmp_path):
    """No score.weight in the policy's checkpoint: the seeded head is the same at TP1 and TP2 x PP2."""
    hf = policy_model(tmp_path / "policy")
    batch = rollout_batch(8)
    runs = []
    for tp, pp in ((1, 1), (2, 2)):
        config = with_critic(job_config(hf, world=tp * pp), hf, tp=tp, pp=pp)
        runs.append([o for o in run_ranks(_critic_values_rank, tp * pp, config, batch) if o is not None][0])
    (single, loaded_single), (sharded, loaded_sharded) = runs
    assert not loaded_single and not loaded_sharded
    assert single.abs().max() > 0
    assert (single - sharded).abs().max() < TOL
