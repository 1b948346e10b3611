"""A mixture-of-experts actor update on forked gloo ranks (no Ray): expert parallelism changes
where the experts live and how their gradients are reduced, not the step.

At EP2 each rank holds half the experts and megatron's alltoall dispatcher sends it the tokens of
both DP ranks routed to them; the expert gradients then reduce over the expert-data-parallel group
(size 1 here) while the dense ones reduce over DP. Loss, grad norm and the updated weights must equal
the single-rank step's and the EP1 step's at the same DP.
"""
from __future__ import annotations

from typing import Any

import pytest

from hybridrl.parallel.forked import run_ranks
from tests.test_models_fixtures import make_hf_model, safetensors_state
from tests.test_training_fixtures import job_config, rollout_batch
from tests.test_training_ranks import _update_rank

# (world, ep); the first is the single-rank reference
MOE_LAYOUTS = ((1, 1), (2, 1), (2, 2))


@pytest.mark.slow
def test_moe_update_at_ep2_equals_ep1(tmp_path):
    hf = make_hf_model(tmp_path / "hf", "qwen3_moe", seed=7)
    batch = rollout_batch(8)
    runs: dict[tuple[int, int], tuple[Any, dict]] = {}
    for world, ep in MOE_LAYOUTS:
        out = tmp_path / f"out_w{world}ep{ep}"
        config = job_config(hf, world=world, use_kl_loss=True, entropy_coeff=0.01)
        config.actor_rollout_ref.actor.megatron.expert_model_parallel_size = ep
        results = run_ranks(_update_rank, world, config, batch, str(out), timeout_s=400)
        metrics = [r["metrics"] for r in results if r["metrics"] is not None]
        assert len(metrics) == world  # one output rank per DP replica
        runs[world, ep] = (metrics[0], safetensors_state(out))
    base_metrics, base_state = runs[MOE_LAYOUTS[0]]
    initial = safetensors_state(hf)
    for key, (metrics, state) in runs.items():
        assert abs(metrics.pg_loss - base_metrics.pg_loss) < 1e-5, key
        assert abs(metrics.grad_norm - base_metrics.grad_norm) < 1e-5, key
        assert abs(metrics.kl_loss - base_metrics.kl_loss) < 1e-5, key
        assert sorted(state) == sorted(base_state)
        for name, value in base_state.items():
            assert (state[name] - value).abs().max() <= 1e-5, (key, name)
    experts = [n for n in initial if ".experts." in n]
    assert experts and max((base_state[n] - initial[n]).abs().max() for n in experts) > 1e-3  # experts moved
