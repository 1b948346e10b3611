"""Workers on forked gloo ranks (no Ray): the actor's log-probs and PPO update against references."""
from __future__ import annotations

from typing import Any

import torch

from hybridrl.parallel.forked import run_ranks
from tests.test_workers_fixtures import hf_response_log_probs, job_config, policy_model, rollout_batch


def _log_prob_rank(rank: int, world: int, config: Any, batch: Any) -> Any:
    from hybridrl.config.plan import build_plan
    from hybridrl.workers.actor import MegatronActor
    from hybridrl.workers.megatron_role import MegatronRole, role_spec

    plan = build_plan(config)
    engine = MegatronRole(role_spec(plan, "actor"))
    actor = MegatronActor(engine, plan)
    out = actor.compute_log_prob(batch, with_entropy=True)
    return None if out is None else {k: v.clone() for k, v in out.tensors.items()}


def test_log_probs_tp2_pp2_equal_transformers(tmp_path):
    hf = policy_model(tmp_path / "hf")
    batch = rollout_batch(8)
    ref_lp, ref_ent = hf_response_log_probs(hf, batch)
    for tp, pp in ((1, 1), (2, 2)):
        results = run_ranks(_log_prob_rank, tp * pp, job_config(hf, world=tp * pp, tp=tp, pp=pp), batch)
        out = [r for r in results if r is not None]
        assert len(out) == 1
        lp, ent = out[0]["old_log_probs"], out[0]["entropys"]
        print(tp, pp, (lp - ref_lp).abs().max(), (ent - ref_ent).abs().max())
        assert torch.allclose(lp, ref_lp, atol=1e-5, rtol=0)
        assert torch.allclose(ent, ref_ent, atol=1e-5, rtol=0)


def _update_rank(rank: int, world: int, config: Any, batch: Any, out_dir: str) -> Any:
    from hybridrl.config.plan import build_plan
    from hybridrl.models.bridge import export_hf
    from hybridrl.models.checkpoint import tensor_sha256
    from hybridrl.workers.actor import MegatronActor
    from hybridrl.workers.megatron_role import MegatronRole, role_spec

    plan = build_plan(config)
    engine = MegatronRole(role_spec(plan, "actor"))
    actor = MegatronActor(engine, plan)
    ctx = engine.ctx
    chunk = batch.split(ctx.dp)[ctx.dp_rank]
    metrics = actor.update_policy(chunk)
    export_hf(engine.chunks, out_dir, force=True)
    digests = {f"{i}.{n}": tensor_sha256(p.detach())
               for i, c in enumerate(engine.chunks) for n, p in c.named_parameters()}
    return {"metrics": metrics, "coords": (ctx.tp_rank, ctx.pp_rank, ctx.dp_rank), "digests": digests}


def test_ppo_update_same_across_layouts(tmp_path):
    from tests.test_models_fixtures import safetensors_state

    hf = policy_model(tmp_path / "hf")
    batch = rollout_batch(8)
    runs = {}
    for tp, pp, dp in ((1, 1, 1), (2, 2, 1), (2, 1, 2), (1, 2, 2)):
        world = tp * pp * dp
        out = tmp_path / f"out_{tp}{pp}{dp}"
        config = job_config(hf, world=world, tp=tp, pp=pp, use_kl_loss=True, entropy_coeff=0.01)
        results = run_ranks(_update_rank, world, config, batch, str(out))
        metrics = [r["metrics"] for r in results if r["metrics"] is not None]
        assert len(metrics) == dp
        by_position: dict[Any, set] = {}
        for r in results:
            tp_rank, pp_rank, _ = r["coords"]
            by_position.setdefault((tp_rank, pp_rank), set()).add(tuple(sorted(r["digests"].items())))
        assert all(len(v) == 1 for v in by_position.values()), "DP replicas differ"
        runs[(tp, pp, dp)] = (metrics[0], safetensors_state(out))
    base_metrics, base_state = runs[(1, 1, 1)]
    initial = safetensors_state(hf)
    for key, (metrics, state) in runs.items():
        print(key, metrics.pg_loss, metrics.grad_norm, metrics.kl_loss, metrics.entropy)
        assert abs(metrics.pg_loss - base_metrics.pg_loss) < 1e-5
        assert abs(metrics.grad_norm - base_metrics.grad_norm) < 1e-5
        assert abs(metrics.kl_loss - base_metrics.kl_loss) < 1e-5
        for name, value in base_state.items():
            assert (state[name] - value).abs().max() < 1e-5, (key, name)
    assert max((base_state[n] - initial[n]).abs().max() for n in initial) > 1e-3  # the update moved weights
