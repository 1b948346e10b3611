"""The hybrid engine in one process per rank: megatron actor + vLLM rollout + resharder, proven syncs.

On real forked gloo ranks: the rollout's own log-probs equal the megatron actor's on the generated
tokens (fp32, ≤ 1e-4), a PPO update moves the policy, and the next sync carries the new weights
(vLLM's log-probs move with them and still match).
"""
import numpy as np
import pytest
import torch

from tests.support.forked import run_ranks

pytestmark = pytest.mark.slow



def _hybrid_rank(rank: int, world: int, model_dir: str, overrides: list[str]) -> dict:
    from hybridrl.config import plan_from_sources
    from hybridrl.controller.base_worker import RankContext
    from hybridrl.data.batch import Batch
    from hybridrl.parallel.cpu.matmul import onednn_fp32_is_exact
    from hybridrl.parallel.device import torch_threads_per_rank
    from hybridrl.rollout.sampling import RolloutSampling
    from hybridrl.workers.colocated import ColocatedPolicyWorker

    plan = plan_from_sources("configs/examples/cpu_tiny_grpo.yaml", [
        f"actor_rollout_ref.model.path={model_dir}", f"trainer.n_gpus_per_node={world}", *overrides])
    ctx = RankContext(group="actor_rollout_ref", rank=rank, world_size=world, node_rank=0, local_rank=rank,
                      local_world_size=world, use_gpu=False)
    worker = ColocatedPolicyWorker(ctx, plan)  # the KV cache the Plan sizes for one wave on CPU
    torch.set_num_threads(4)  # torch's default would be every core: the worker must share them out
    setup = worker.setup(total_training_steps=4)
    threads = torch.get_num_threads()

    def params_freed() -> bool:  # megatron.param_offload: every parameter storage resized to 0 on the device
        return all(p.untyped_storage().nbytes() == 0 for m in worker.actor.backend.models for p in m.parameters())

    freed_after_setup = params_freed()
    # A replica's whole step at full length (longest prompts, every response to the limit) must fit
    # the cache vLLM actually allocated from the Plan's size: one wave, no preemption.
    full = worker.rollout.generate_sequences(
        [[1] + [70] * (plan.config.data.max_prompt_length - 1)] * plan.prompts_per_rollout_replica,
        RolloutSampling(n=plan.config.actor_rollout_ref.rollout.n, max_tokens=plan.resolved.response_length,
                        ignore_eos=True))
    full_metrics = full.meta["metrics"]
    prompts = Batch({"input_ids": torch.zeros(2, 5, dtype=torch.long)},
                    {"raw_prompt_ids": [[1, 70, 71, 72], [1, 73, 74, 75, 76]], "uid": ["a", "b"],
                     "ground_truth": ["x", "y"]})
    sampling = RolloutSampling(n=plan.config.actor_rollout_ref.rollout.n, max_tokens=8, temperature=1.0)
    rollout = worker.generate_sequences(prompts, sampling)
    # every rank generated the same replica-independent prompts; score them on the actor
    # (each DP rank scores all rows here: the dispatch is the controller's job, tested elsewhere)
    batch = rollout if rollout is not None else None
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, batch)
    batch = next(b for b in gathered if b is not None)
    batch.meta["temperature"] = 1.0
    before = worker.compute_log_prob(batch)
    result = {"probe": setup["reshard/probe_max_abs_gap"], "tp_rank": setup["vllm_tp_rank"],
              "as_planned": setup["placement_as_planned"], "received": setup["reshard/bytes_received"],
              "bound": setup["reshard/exact_lower_bound_bytes"], "naive": setup["reshard/naive_gather_bytes"],
              "kv_usage": full_metrics["rollout/kv_cache_usage_bound"], "full_rows": len(full),
              "replica_rows": plan.sequences_per_rollout_replica,
              # megatron's fp32 matmuls keep the oneDNN route after vLLM was built (it resets it)
              "onednn_route_kept": torch.backends.mkldnn.matmul.fp32_precision == "bf16",
              "onednn_exact": onednn_fp32_is_exact(),
              "threads": threads, "threads_expected": torch_threads_per_rank(world)}
    if before is not None:
        mask = batch["response_mask"].bool()
        result["rollout_gap"] = float((before["old_log_probs"] - batch["rollout_log_probs"])[mask].abs().max())
    # one PPO update with made-up advantages, then a sync: weights move, vLLM follows
    batch["old_log_probs"] = gathered_log_probs(before, world)
    scores = torch.tensor(np.linspace(-1.0, 1.0, len(batch)), dtype=torch.float32)
    batch["advantages"] = scores[:, None] * batch["response_mask"].float()
    worker.update_actor(batch)
    sync = worker.sync_weights()
    after = worker.compute_log_prob(batch)
    result["probe_after_update"] = sync["reshard/probe_max_abs_gap"]
    result["params_freed"] = (freed_after_setup, params_freed())  # after a sync; after the log-prob pass
    result["memory"] = {k: v for k, v in sync.items() if k.startswith("memory/")}
    if after is not None:
        result["moved"] = float((after["old_log_probs"] - before["old_log_probs"]).abs().max())
    return result


def gathered_log_probs(local, world):
    items = [None] * world
    torch.distributed.all_gather_object(items, None if local is None else local["old_log_probs"])
    return next(i for i in items if i is not None)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tools.make_demo_model import build

    return str(build("configs/models/tiny-demo/config.json", tmp_path_factory.mktemp("tiny") / "model", seed=3))


# TP2 training into infer_tp 2 (the shards already aligned) is synced into a live vLLM engine in
# tests/reshard/test_resharder.py (qwen2-tp2pp2-itp2); here the layouts where weights must move.
@pytest.mark.parametrize("world,layout", [
    (2, ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
         "actor_rollout_ref.rollout.tensor_model_parallel_size=1"]),
    # HybridFlow's strided generation groups ([0,2], [1,3]) built inside vLLM: each rank's vLLM
    # shard contains its training shard, so it receives only the other half of it
    (4, ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4",
         "actor_rollout_ref.rollout.tensor_model_parallel_size=2"]),
    # verl's actor param_offload: the actor's weights wait on the host while vLLM generates; the sync, the
    # log-prob passes and the update reload them (a reader that did not would fail or break the probe)
    (2, ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
         "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
         "actor_rollout_ref.actor.megatron.param_offload=true"]),
], ids=["tp2-to-infer1", "tp4-to-infer2-strided", "tp2-to-infer1-param-offload"])
def test_colocated_engine_syncs_and_follows_updates(model_dir, world, layout):
    micro = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "data.train_batch_size=2",
             "actor_rollout_ref.actor.ppo_mini_batch_size=2",
             "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8"]
    results = run_ranks(_hybrid_rank, world, model_dir, layout + micro, timeout_s=600)
    for r in results:
        assert r["probe"] < 1e-4 and r["probe_after_update"] < 1e-4
        assert r["as_planned"]                       # vLLM built the Plan's TP groups
        assert r["received"] <= 1.05 * r["bound"]    # HybridFlow's zero-redundancy bound
        assert r["received"] <= r["naive"]
        # the Plan's CPU KV cache holds a replica's step at full length, without waste
        assert r["full_rows"] == r["replica_rows"] and 0.5 < r["kv_usage"] <= 1.0, r
        assert r["onednn_route_kept"] == r["onednn_exact"]
        assert r["threads"] == r["threads_expected"]  # this node's cores shared among its ranks
        offload = "actor_rollout_ref.actor.megatron.param_offload=true" in layout
        assert r["params_freed"] == ((True, False) if offload else (False, False))
        if world == 4:
            assert 0 < r["bound"] < r["naive"]       # real traffic, well below gathering everything
        # memory per phase (process RSS on CPU), handed out with the sync that ends the step
        phases = ("gen_before", "gen_after", "update_before", "update_after", "sync_before", "sync_after")
        assert sorted(r["memory"]) == sorted(f"memory/{p}_{k}_gib" for p in phases for k in ("allocated", "reserved"))
        assert all(0.05 < v < 64 for v in r["memory"].values())
    outputs = [r for r in results if "rollout_gap" in r]
    assert outputs, results
    for r in outputs:
        assert r["rollout_gap"] < 1e-4      # vLLM's sampling log-probs = megatron's, same weights
        assert r["moved"] > 1e-3            # the update changed the policy, and vLLM followed (probe)


def _sync_leaving_out_rank(rank: int, world: int, model_dir: str, left_out: str) -> str:
    """A colocated worker whose resharder neither sends nor reports `left_out` (as a weight table that does not know
    a parameter would): what its setup's first sync says."""
    from hybridrl.reshard.resharder import Resharder
    from tests.support.colocated_workers import colocated_worker

    shards, report = Resharder.shards, Resharder.finished_report

    def fewer_shards(self):
        return ((name, tensor) for name, tensor in shards(self) if name != left_out)

    def fewer_checksums(self):
        finished = report(self)
        finished.checksums.pop(left_out)
        return finished

    Resharder.shards, Resharder.finished_report = fewer_shards, fewer_checksums
    worker = colocated_worker(rank, world, model_dir, [])
    try:
        worker.setup(total_training_steps=1)
    except Exception as exc:  # noqa: BLE001 - the error is what the test reads
        return f"{type(exc).__name__}: {exc}"
    return "set up"


def test_vllm_builds_on_dummy_weights_and_a_parameter_the_first_sync_leaves_out_is_named(model_dir):
    """The colocated engine reads nothing from the model folder (`load_format: dummy`, verl's default for its hybrid
    engine): the first sync writes every parameter vLLM holds, proven by its digests, so one it left out (random
    dummy values) stops the setup naming it. (With the digests' old `ignore_extra` the setup went on to the probe,
    which saw a 0.38 gap and named no tensor: the left-out norm held vLLM's dummy values, not the folder's.)"""
    (said,) = run_ranks(_sync_leaving_out_rank, 1, model_dir, "model.norm.weight", timeout_s=300)
    assert said.startswith("WeightSyncError: sync 0: weight sync checksum mismatch on 1 tensor(s): rank 0 "
                           "model.norm.weight: not produced by the resharder"), said
