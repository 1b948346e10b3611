"""Sampling temperature and the probe of every vLLM replica, on the hybrid engine's real ranks.

Two forked gloo ranks, training TP2 (rank 0 alone holds megatron's outputs) and two independent
vLLM replicas (rollout TP1):
- at T in {0.6, 1.0, 1.3}, vLLM's sampling log-probs (of the tempered distribution) equal the
  megatron actor's (fp32, <= 1e-4), and one PPO update on the policy's own fresh samples, with the
  old log-probs from the old-log-prob pass, sees a ratio of exactly 1: clipfrac 0 and approx_kl 0
  (an update that scored the logits at another temperature than the pass sees clipfrac > 0);
- the log-prob probe reads every replica: a copy that differs only on rank 1 (which holds no
  megatron output) is caught, and the error names that replica.
"""
import numpy as np
import pytest
import torch

from tests.support.forked import run_ranks

pytestmark = pytest.mark.slow

TEMPERATURES = (0.6, 1.0, 1.3)


def _sampling_rank(rank: int, world: int, model_dir: str) -> dict:
    from hybridrl.data.batch import Batch
    from hybridrl.rollout.sampling import RolloutSampling
    from hybridrl.workers.probe import WeightSyncError
    from tests.support.colocated_workers import colocated_worker, gather_first

    worker = colocated_worker(rank, world, model_dir, [
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.actor.old_log_prob=recompute",
        "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4"])
    plan = worker.plan
    setup = worker.setup(total_training_steps=len(TEMPERATURES))
    result: dict = {"setup_replica_gaps": dict(worker.replica_probe_gaps),
                    "setup_replicas": setup["reshard/probe_replicas"], "per_temperature": {}}
    n = plan.config.actor_rollout_ref.rollout.n
    for step, temperature in enumerate(TEMPERATURES):
        prompts = Batch({"input_ids": torch.zeros(2, 5, dtype=torch.long)},
                        {"raw_prompt_ids": [[1, 70, 71, 72], [1, 73, 74, 75, 76]], "uid": ["a", "b"]})
        sampling = RolloutSampling(n=n, max_tokens=8, temperature=temperature, seed=step)
        # rank 0's replica samples the step's batch (TP1 engines generate alone); both TP ranks train on it
        batch = gather_first(worker.generate_sequences(prompts, sampling) if rank == 0 else None, world)
        batch.meta["temperature"] = temperature
        old = gather_first(worker.compute_log_prob(batch), world)
        mask = batch["response_mask"].bool()
        gap = float((old["old_log_probs"] - batch["rollout_log_probs"])[mask].abs().max())
        batch["old_log_probs"] = old["old_log_probs"]
        advantages = torch.tensor(np.linspace(-1.0, 1.0, len(batch)), dtype=torch.float32)
        batch["advantages"] = advantages[:, None] * batch["response_mask"].float()
        update = gather_first(worker.update_actor(batch), world).as_dict()
        sync = worker.sync_weights()
        result["per_temperature"][temperature] = {
            "rollout_gap": gap, "clipfrac": update["actor/clipfrac"], "approx_kl": update["actor/approx_kl"],
            "grad_norm": update["actor/grad_norm"], "probe": sync["reshard/probe_max_abs_gap"]}

    # Corrupt rank 1's vLLM copy only: one weight of one layer, after a regular reshard.
    shards = list(worker.resharder.shards())
    if rank == 1:
        name, tensor = next((n, t) for n, t in shards if n.endswith("mlp.down_proj.weight"))
        tensor.add_(0.05)
    worker.rollout.update_weights(shards, weight_format="vllm_shard")
    try:  # raised on every rank, naming rank 1's replica
        worker.prove_by_probe()
    except WeightSyncError as exc:
        result["error"] = str(exc)
    result["corrupt_replica_gaps"] = dict(worker.replica_probe_gaps)
    return result


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tools.make_demo_model import build

    return str(build("configs/models/tiny-demo/config.json", tmp_path_factory.mktemp("tiny") / "model", seed=3))


def test_any_temperature_is_on_policy_and_every_replica_is_probed(model_dir):
    results = run_ranks(_sampling_rank, 2, model_dir, timeout_s=600)
    for r in results:
        assert r["setup_replicas"] == 2 and sorted(r["setup_replica_gaps"]) == [0, 1]
        assert max(r["setup_replica_gaps"].values()) < 1e-4
        for temperature, m in r["per_temperature"].items():
            assert m["rollout_gap"] < 1e-4, (temperature, m)     # vLLM's tempered log-probs = megatron's
            assert m["clipfrac"] == 0.0 and m["approx_kl"] == 0.0, (temperature, m)
            assert m["grad_norm"] > 0.0 and m["probe"] < 1e-4, (temperature, m)
        # rank 1's copy differs: the probe sees it on every rank, and knows which replica it is
        assert r["corrupt_replica_gaps"][1] > 1e-3 and r["corrupt_replica_gaps"][0] < 1e-4, r
        assert "replica led by rank 1 exceeds 0.0001" in r.get("error", ""), r
