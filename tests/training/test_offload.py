"""Optimizer-state and grad-buffer offload of the actor between phases: same training, state really moved.

On CPU the store device equals the home device, but every offload and reload replaces each state tensor
by a copy and the grad buffers' storage is really freed (megatron's own resize to 0), so an optimizer
or DDP that kept references to the old tensors would train differently here.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.support.forked import run_ranks
from tests.support.training_fixtures import job_config, policy_model, rollout_batch

STEPS = 3


def _train_rank(rank: int, world: int, config: Any, batches: list[Any]) -> Any:
    from hybridrl.config.plan import build_plan
    from hybridrl.models.checkpoint import tensor_sha256
    from hybridrl.training.actor import MegatronActor
    from hybridrl.training.backend import MegatronBackend, role_spec
    from hybridrl.training.offload import inner_optimizers

    plan = build_plan(config)
    backend = MegatronBackend(role_spec(plan, "actor"))
    actor = MegatronActor(backend, plan)
    ctx = backend.ctx
    losses, observed = [], []
    for batch in batches:
        metrics = actor.update_policy(batch.split(ctx.dp)[ctx.dp_rank])
        losses.append(None if metrics is None else (metrics.pg_loss, metrics.grad_norm))
        # the tensors themselves are held (not only their ids, which Python reuses once they are freed)
        before = [v for inner in inner_optimizers(backend.optimizer)
                  for state in inner.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
        backend.offload_training_state()  # what the actor worker does after each update
        after = [v for inner in inner_optimizers(backend.optimizer)
                 for state in inner.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
        grad_storage = sum(b.grad_data.untyped_storage().size() for m in backend.models for b in m.buffers)
        replaced = not ({id(v) for v in before} & {id(v) for v in after})
        observed.append({"state_tensors": len(before), "replaced": replaced, "grad_storage_bytes": grad_storage})
        # a log-prob pass between updates, as in a real step (must not need the offloaded state)
        actor.compute_log_prob(batch.split(ctx.dp)[ctx.dp_rank])
    digests = {f"{i}.{n}": tensor_sha256(p.detach()) for i, c in enumerate(backend.chunks)
               for n, p in c.named_parameters()}
    return {"losses": losses, "observed": observed, "digests": digests}


def _with_and_without(tmp_path: Any, distributed: bool, rank_fn: Any, *options: str) -> dict[bool, list[Any]]:
    """`rank_fn` on DP2 over STEPS batches, with the actor's megatron `options` off, then on."""
    hf = policy_model(tmp_path / "hf")
    batches = [rollout_batch(8, seed=s) for s in range(STEPS)]
    runs = {}
    for offload in (False, True):
        config = job_config(hf, world=2, distributed_optimizer=distributed)
        for option in options:
            setattr(config.actor_rollout_ref.actor.megatron, option, offload)
        runs[offload] = run_ranks(rank_fn, 2, config, batches)
    return runs


@pytest.mark.parametrize("distributed", [False, True], ids=["plain-optimizer", "distributed-optimizer"])
def test_offload_trains_identically(tmp_path, distributed):
    runs = _with_and_without(tmp_path, distributed, _train_rank, "optimizer_offload", "grad_offload")
    for plain, offloaded in zip(runs[False], runs[True]):
        assert plain["losses"] == offloaded["losses"]          # bit-identical losses and grad norms
        assert plain["digests"] == offloaded["digests"]        # bit-identical weights after 3 updates
        for seen in offloaded["observed"]:
            assert seen["state_tensors"] > 0 and seen["replaced"]
            assert seen["grad_storage_bytes"] == 0
        for seen in plain["observed"]:
            assert not seen["replaced"] and seen["grad_storage_bytes"] > 0


def _param_offload_rank(rank: int, world: int, config: Any, batches: list[Any]) -> Any:
    """Update, then the actor's parameters off (as after each weight sync), then a log-prob pass and the next
    update: the backend brings them back itself."""
    from hybridrl.config.plan import build_plan
    from hybridrl.models.checkpoint import tensor_sha256
    from hybridrl.training.actor import MegatronActor
    from hybridrl.training.backend import MegatronBackend, role_spec

    plan = build_plan(config)
    backend = MegatronBackend(role_spec(plan, "actor"))
    actor = MegatronActor(backend, plan)
    ctx, freed, log_probs = backend.ctx, [], []
    params = [p for m in backend.models for p in m.parameters()]
    for batch in batches:
        actor.update_policy(batch.split(ctx.dp)[ctx.dp_rank])
        if plan.config.actor_rollout_ref.actor.megatron.param_offload:
            backend.offload_params()
        freed.append(all(p.untyped_storage().nbytes() == 0 for p in params))
        out = actor.compute_log_prob(batch.split(ctx.dp)[ctx.dp_rank])
        log_probs.append(None if out is None else out["old_log_probs"].clone())
    digests = {f"{i}.{n}": tensor_sha256(p.detach()) for i, c in enumerate(backend.chunks)
               for n, p in c.named_parameters()}
    return {"freed": freed, "log_probs": log_probs, "digests": digests}


@pytest.mark.parametrize("distributed", [False, True], ids=["plain-optimizer", "distributed-optimizer"])
def test_param_offload_of_the_actor_trains_identically(tmp_path, distributed):
    """verl's actor param_offload: every parameter storage (DDP's param buffer with the distributed optimizer)
    really freed between phases, and the log-probs and weights bit-identical to a run without it."""
    runs = _with_and_without(tmp_path, distributed, _param_offload_rank, "param_offload")
    for plain, offloaded in zip(runs[False], runs[True]):
        assert offloaded["freed"] == [True] * STEPS and plain["freed"] == [False] * STEPS
        assert plain["digests"] == offloaded["digests"]
        for a, b in zip(plain["log_probs"], offloaded["log_probs"]):
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b))


def test_param_offload_of_the_critic_is_refused(tmp_path):
    from hybridrl.config import ConfigError
    from hybridrl.config.plan import build_plan
    from tests.support.training_fixtures import sequence_classifier, with_critic

    config = with_critic(job_config(policy_model(tmp_path / "hf"), world=1), sequence_classifier(tmp_path / "c"))
    config.critic.megatron.param_offload = True
    with pytest.raises(ConfigError) as info:  # the plan refuses it before any process starts
        build_plan(config)
    (issue,) = [i for i in info.value.issues if i.field == "critic.megatron.param_offload"]
    assert "supported for the colocated actor and the frozen roles" in issue.rule
