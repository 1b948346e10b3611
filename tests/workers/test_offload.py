"""The critic worker frees what it offloads between its updates, from set-up on, and trains the same.

The critic shares its GPUs with the hybrid engine (vLLM in another process), so the memory plan counts
only its params and fp32 master weights between its updates when `critic.megatron.grad_offload` /
`optimizer_offload` are set. On CPU the grad buffers' storage is really freed (megatron's own resize to 0)
and Adam's state tensors are replaced by copies, so a worker that skipped an offload shows here, and one
whose optimizer or DDP kept the old tensors would train differently from the run without offload.
"""
from __future__ import annotations

from typing import Any

import torch

from tests.support.forked import run_ranks
from tests.support.training_fixtures import job_config, policy_model, rollout_batch, sequence_classifier, with_critic


def _critic_worker_rank(rank: int, world: int, config: Any, batches: list[Any]) -> Any:
    from hybridrl.config.plan import build_plan
    from hybridrl.controller.base_worker import RankContext
    from hybridrl.training.offload import inner_optimizers
    from hybridrl.workers.critic import CriticWorker

    context = RankContext(group="critic", rank=rank, world_size=world, node_rank=0, local_rank=rank,
                          local_world_size=world, use_gpu=False)
    worker = CriticWorker(context, build_plan(config))
    worker.init_model(total_training_steps=len(batches))
    backend = worker.critic.backend

    def grad_bytes() -> int:
        return sum(b.grad_data.untyped_storage().size() for m in backend.models for b in m.buffers)

    def state() -> list[torch.Tensor]:
        return [v for inner in inner_optimizers(backend.optimizer) for s in inner.state.values()
                for v in s.values() if isinstance(v, torch.Tensor)]

    observed = {"grad_bytes_after_setup": grad_bytes(), "after_updates": []}
    values = []
    for batch in batches:
        chunk = batch.split(backend.ctx.dp)[backend.ctx.dp_rank]
        before = state()
        worker.update_critic(chunk)
        after = state()
        observed["after_updates"].append({"grad_bytes": grad_bytes(),
                                          "state_replaced": not ({id(v) for v in before} & {id(v) for v in after})})
        out = worker.compute_values(chunk)
        values.append(None if out is None else out["values"].clone())
    observed["values"] = values
    return observed


def test_critic_worker_offloads_from_setup_and_trains_the_same(tmp_path):
    critic, policy = sequence_classifier(tmp_path / "critic"), policy_model(tmp_path / "policy")
    batches = [rollout_batch(8, seed=3)] * 2  # the same batch twice: values move between the updates
    runs = {}
    for offload in (False, True):
        config = with_critic(job_config(policy, world=2), critic)
        config.critic.megatron.grad_offload = config.critic.megatron.optimizer_offload = offload
        runs[offload] = run_ranks(_critic_worker_rank, 2, config, batches)
    for rank in range(2):
        plain, offloaded = runs[False][rank], runs[True][rank]
        assert plain["grad_bytes_after_setup"] > 0 and offloaded["grad_bytes_after_setup"] == 0
        assert all(u["grad_bytes"] > 0 and not u["state_replaced"] for u in plain["after_updates"])
        assert all(u["grad_bytes"] == 0 and u["state_replaced"] for u in offloaded["after_updates"])
        for a, b in zip(plain["values"], offloaded["values"]):
            assert (a is None) == (b is None)
            if a is not None:
                assert torch.equal(a, b)
    # the second update moved the values on the same rows (equal values are evidence, not a frozen critic)
    first, second = next(r["values"] for r in runs[False] if r["values"][0] is not None)
    assert (first - second).abs().max() > 1e-4
