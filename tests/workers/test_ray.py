"""The Ray-facing role workers in real worker groups (Ray actors + gloo + megatron-core).

One 4-rank PolicyWorker group (TP2 x PP2, actor + reference in the same processes) is
shared by the tests of this module; a 2-rank critic and reward-model group check the value roles.
References are independent: transformers on the same weights, and a single-rank forked run.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.forked import run_ranks
from tests.support.models_fixtures import safetensors_state
from tests.support.training_fixtures import (
    hf_response_log_probs,
    job_config,
    policy_model,
    rollout_batch,
    sequence_classifier,
    update_rank,
    with_critic,
    with_reward_model,
)

# One xdist worker for the module: its policy group (Ray actors, megatron, vLLM) is started once.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("workers_ray")]
TOL = 1e-5
PG_TIMEOUT_S = 180.0  # whole minutes (megatron's unit), and not megatron's own default of 30


def _group(worker_cls: Any, name: str, world: int, plan: Any, role: str) -> tuple[Any, Any]:
    from hybridrl.controller.resource_pool import ResourcePool
    from hybridrl.controller.worker_group import WorkerGroup

    pool = ResourcePool(name, nnodes=1, workers_per_node=world, cpus_per_worker=0.25).start(timeout_s=60)
    group = WorkerGroup(worker_cls, pool, name=role, worker_args=(plan,), process_group_timeout_s=PG_TIMEOUT_S,
                        call_timeout_s=300)
    return pool, group


def _metrics_by_dp(group: Any, method: Any, batch: Any) -> list[Any]:
    """Like the trainer: DP dispatch, results from the output ranks (non-Batch results)."""
    from hybridrl.controller.dispatch import RankCall, dispatch_by_dp, select_output_ranks

    mesh = group.require_mesh()
    refs = dispatch_by_dp(batch, mesh)
    return select_output_ranks(group.execute_all(method, [RankCall((ref,)) for ref in refs]), mesh)


def test_worker_calls_refuse_a_method_of_another_role_worker():
    from hybridrl.controller.worker_group import worker_method_name
    from hybridrl.workers.colocated import ColocatedPolicyWorker
    from hybridrl.workers.critic import CriticWorker
    from hybridrl.workers.policy import PolicyWorker

    # inherited: the colocated worker runs PolicyWorker's compute_log_prob itself
    assert worker_method_name(ColocatedPolicyWorker, PolicyWorker.compute_log_prob, "actor_rollout_ref") == \
        "compute_log_prob"
    # overridden: the colocated worker would run its own load_checkpoint (which also syncs vLLM), not the one named
    with pytest.raises(TypeError, match=r"not of ColocatedPolicyWorker .*: ColocatedPolicyWorker has its own "
                                        r"load_checkpoint, call ColocatedPolicyWorker\.load_checkpoint"):
        worker_method_name(ColocatedPolicyWorker, PolicyWorker.load_checkpoint, "actor_rollout_ref")
    with pytest.raises(TypeError, match=r"CriticWorker\.save_checkpoint is a method of CriticWorker, "
                                        r"not of ColocatedPolicyWorker \(the actor_rollout_ref group's"):
        worker_method_name(ColocatedPolicyWorker, CriticWorker.save_checkpoint, "actor_rollout_ref")
    with pytest.raises(TypeError, match="CriticWorker.update_critic is a method of CriticWorker, not of "
                                        "ColocatedPolicyWorker"):
        worker_method_name(ColocatedPolicyWorker, CriticWorker.update_critic, "actor_rollout_ref")


@pytest.fixture(scope="module")
def policy(ray_cluster, tmp_path_factory):
    from hybridrl.config.plan import build_plan
    from hybridrl.workers.policy import PolicyWorker

    root = tmp_path_factory.mktemp("workers_ray")
    hf = policy_model(root / "hf")
    config = job_config(hf, world=4, tp=2, pp=2, use_kl_loss=True)
    config.trainer.torch_threads_per_rank = 1
    pool, group = _group(PolicyWorker, "policy", 4, build_plan(config), "actor")
    group.call_all(PolicyWorker.init_model)
    group.learn_mesh()
    yield {"group": group, "hf": hf, "root": root}
    group.shutdown()
    pool.shutdown()


def test_mesh_of_the_policy_group(policy):
    from hybridrl.controller.dispatch import RankMesh

    assert policy["group"].require_mesh() == RankMesh.from_sizes(tp=2, pp=2, dp=1)


def test_the_group_timeout_reaches_every_process_group(policy):
    """What the trainer passes as `trainer.nccl_timeout_s` bounds the world group and megatron's groups."""
    from hybridrl.workers.policy import PolicyWorker

    for rank, timeouts in enumerate(policy["group"].call_all(PolicyWorker.process_group_timeouts)):
        assert set(timeouts) == {"world", "tp", "pp", "dp", "cp", "dp_cp", "model_parallel"}
        assert timeouts == dict.fromkeys(timeouts, PG_TIMEOUT_S), (rank, timeouts)


def test_actor_and_reference_log_probs_equal_transformers(policy):
    from hybridrl.workers.policy import PolicyWorker

    group, hf = policy["group"], policy["hf"]
    batch = rollout_batch(8)
    expected_lp, expected_entropy = hf_response_log_probs(hf, batch)
    out = group.call_by_dp(PolicyWorker.compute_log_prob, batch, True)
    assert (out["old_log_probs"] - expected_lp).abs().max() < TOL
    assert (out["entropys"] - expected_entropy).abs().max() < TOL
    ref = group.call_by_dp(PolicyWorker.compute_ref_log_prob, batch)
    assert (ref["ref_log_probs"] - expected_lp).abs().max() < TOL


def test_update_matches_single_rank_then_checkpoint_round_trip(policy, tmp_path):
    from hybridrl.workers.policy import PolicyWorker

    group, hf, root = policy["group"], policy["hf"], policy["root"]
    batch = rollout_batch(8)
    single_dir = tmp_path / "single"
    single = run_ranks(update_rank, 1, job_config(hf, world=1, use_kl_loss=True), batch, str(single_dir))[0]
    (metrics,) = _metrics_by_dp(group, PolicyWorker.update_actor, batch)
    assert abs(metrics.pg_loss - single["metrics"].pg_loss) < TOL
    assert abs(metrics.grad_norm - single["metrics"].grad_norm) < TOL
    assert abs(metrics.kl_loss - single["metrics"].kl_loss) < TOL

    exported = Path(group.call_all(PolicyWorker.export_hf, str(tmp_path / "exported"))[0])
    ours, theirs = safetensors_state(exported), safetensors_state(single_dir)
    assert max(float((ours[n] - theirs[n]).abs().max()) for n in theirs) < TOL
    # The updated policy's log-probs are those of the exported weights under transformers.
    expected_lp, _ = hf_response_log_probs(exported, batch)
    updated = group.call_by_dp(PolicyWorker.compute_log_prob, batch)["old_log_probs"]
    assert (updated - expected_lp).abs().max() < TOL

    ckpt = str(root / "ckpt")
    group.call_all(PolicyWorker.save_checkpoint, ckpt)
    after_save = _metrics_by_dp(group, PolicyWorker.update_actor, rollout_batch(8, seed=5))[0]
    group.call_all(PolicyWorker.load_checkpoint, ckpt)
    after_load = _metrics_by_dp(group, PolicyWorker.update_actor, rollout_batch(8, seed=5))[0]
    assert after_load == after_save


def test_critic_and_reward_model_groups(ray_cluster, tmp_path):
    import transformers

    from hybridrl.config.plan import build_plan
    from hybridrl.workers.critic import CriticWorker
    from hybridrl.workers.frozen_roles import RewardModelWorker

    hf = policy_model(tmp_path / "hf")
    scorer = sequence_classifier(tmp_path / "scorer")
    batch = rollout_batch(8, seed=7)
    config = with_reward_model(with_critic(job_config(hf, world=2), scorer, tp=2), scorer, tp=1)
    config.trainer.torch_threads_per_rank = 1
    plan = build_plan(config)
    model = transformers.LlamaForSequenceClassification.from_pretrained(scorer, dtype=torch.float32,
                                                                        attn_implementation="eager")
    with torch.no_grad():
        scores = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits.squeeze(-1)
        hidden = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                             position_ids=batch["position_ids"]).last_hidden_state
    width, response = batch["input_ids"].shape[1], batch["responses"].shape[1]
    values = (hidden[:, width - response - 1: width - 1] @ model.score.weight.t()).squeeze(-1)
    values = values * batch["response_mask"]

    for worker_cls, role, method, key, expected in (
        (CriticWorker, "critic", CriticWorker.compute_values, "values", values),
        (RewardModelWorker, "reward_model", RewardModelWorker.compute_rm_score, "rm_scores", scores),
    ):
        pool, group = _group(worker_cls, role, 2, plan, role)
        try:
            group.call_all(worker_cls.init_model)
            group.learn_mesh()
            out = group.call_by_dp(method, batch)
            assert (out[key] - expected).abs().max() < TOL, role
            if role == "critic":
                (metrics,) = _metrics_by_dp(group, CriticWorker.update_critic, batch)
                assert metrics.optimizer_steps == 1 and metrics.grad_norm > 0
            else:
                # A malformed batch fails fast at the controller, naming role, rank and the cause.
                from hybridrl.controller.gather import WorkerGroupError

                bad = rollout_batch(8, seed=7)
                bad["attention_mask"] = torch.zeros_like(bad["attention_mask"])
                with pytest.raises(WorkerGroupError, match="reward_model rank") as failure:
                    group.call_by_dp(method, bad)
                assert "SequenceLayoutError" in failure.value.remote_traceback
        finally:
            group.shutdown()
            pool.shutdown()
