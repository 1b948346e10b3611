"""Non-finite steps: a NaN loss/gradient on one rank skips the optimizer step on every rank.

TP2 x DP2 with the distributed optimizer and clipping on. The NaN enters through one DP rank's
advantages only, so the skip decision has to travel to the other replica. A control at the end
shows why the guard exists: megatron's own optimizer step applies the NaN gradients.
"""
from __future__ import annotations

from typing import Any

import torch

from tests.support.forked import run_ranks
from tests.support.training_fixtures import job_config, policy_model, rollout_batch


def _params(backend: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for c in backend.chunks for n, p in c.named_parameters()}


def _rank(rank: int, world: int, config: Any, good: Any, bad: Any) -> dict[str, Any]:
    from hybridrl.config.plan import build_plan
    from hybridrl.training.actor import MegatronActor
    from hybridrl.training.backend import MegatronBackend, role_spec

    plan = build_plan(config)
    backend = MegatronBackend(role_spec(plan, "actor"))
    actor = MegatronActor(backend, plan)
    ctx = backend.ctx
    before = _params(backend)
    skipped = actor.update_policy(bad.split(ctx.dp)[ctx.dp_rank])
    after_skip = _params(backend)
    unchanged = all(torch.equal(before[n], after_skip[n]) for n in before)
    steps_after_skip = backend.schedule.step_count
    applied = actor.update_policy(good.split(ctx.dp)[ctx.dp_rank])
    after_good = _params(backend)
    moved = any(not torch.equal(after_skip[n], after_good[n]) for n in before)
    finite = all(torch.isfinite(p).all() for p in after_good.values())
    # Control: the same NaN batch again, then megatron's optimizer step directly (no guard).
    for m in backend.models:
        m.zero_grad_buffer()
    backend.optimizer.zero_grad()
    from functools import partial

    from hybridrl.algorithms.aggregation import global_loss_normalizers
    mine = bad.split(ctx.dp)[ctx.dp_rank]
    micros = backend.micro_batches(mine.tensors, [list(range(len(mine)))], extra_keys=("old_log_probs", "advantages"))
    normalizers = global_loss_normalizers([m.response_mask for m in micros], ctx.dp_group)
    backend._run(micros, partial(actor._policy_loss, normalizers=normalizers, scale=ctx.dp, temperature=1.0),
                forward_only=False, response_tokens_only=True)  # the actor's loss reads response-token logits
    backend.optimizer.step()
    poisoned = any(not torch.isfinite(p).all() for p in _params(backend).values())
    return {"unchanged": unchanged, "moved": moved, "finite": finite, "poisoned": poisoned,
            "steps_after_skip": steps_after_skip, "skipped": skipped, "applied": applied}


def test_nan_advantage_skips_the_step_on_every_rank(tmp_path):
    hf = policy_model(tmp_path / "hf")
    config = job_config(hf, world=4, tp=2, distributed_optimizer=True)
    config.actor_rollout_ref.actor.optim.clip_grad = 1.0
    good = rollout_batch(8, seed=1)
    bad = rollout_batch(8, seed=1)
    advantages = bad["advantages"].clone()
    advantages[0] = float("nan")  # row 0 lands on DP rank 0 only
    bad["advantages"] = advantages
    results = run_ranks(_rank, 4, config, good, bad)
    for r in results:
        assert r["unchanged"], "a skipped step changed weights"
        assert r["steps_after_skip"] == 0, "the lr schedule advanced on a skipped step"
        assert r["moved"] and r["finite"], "the next finite step was not applied"
        assert r["poisoned"], "control: megatron's own step no longer applies NaN grads (guard may be moot)"
    outputs = [r for r in results if r["skipped"] is not None]
    assert outputs
    for r in outputs:
        assert r["skipped"].skipped_steps == 1 and r["skipped"].as_dict()["actor/skipped_steps"] == 1
        assert r["applied"].skipped_steps == 0


def test_all_finite_reads_a_sum_and_still_tells_overflow_from_non_finite():
    from hybridrl.training.nonfinite import _all_finite

    grad = torch.randn(1000)
    assert _all_finite(grad)
    for position in (0, 517, 999):
        for bad in (float("nan"), float("inf"), float("-inf")):
            broken = grad.clone()
            broken[position] = bad
            assert not _all_finite(broken), (position, bad)
    both = grad.clone()
    both[[3, 4]] = torch.tensor([float("inf"), float("-inf")])  # a NaN sum: still non-finite
    assert not _all_finite(both)
    huge = torch.full((4,), 3e38)  # every element finite, the sum overflows to inf
    assert not torch.isfinite(huge.sum()) and _all_finite(huge)
