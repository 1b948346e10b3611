"""bench/vs_trl.py --model real: hybridrl's side is a job the planner accepts, with the settings both
sides share (no process started: the Plan is built from the example config and the overrides)."""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import vs_trl  # noqa: E402

from hybridrl.config.plan import plan_from_sources  # noqa: E402


@pytest.mark.parametrize("layout, pp, dp", [("pp2", 2, 1), ("dp2", 1, 2)])
def test_real_case_overrides_plan_the_shared_settings(real_model, tmp_path, monkeypatch, layout, pp, dp):
    monkeypatch.chdir(ROOT)  # the example config's paths are relative to the repository
    run_dir = tmp_path / "run"
    plan = plan_from_sources(ROOT / vs_trl.REAL_CONFIG, vs_trl.real_overrides(layout, 8, 3, run_dir, seed=0))
    config = plan.config
    actor, rollout = config.actor_rollout_ref.actor, config.actor_rollout_ref.rollout
    assert (actor.megatron.pipeline_model_parallel_size, plan.layout("actor").mesh.dp) == (pp, dp)
    # one optimizer step per step on 8 prompts x n, as TRL's one generation batch
    assert config.data.train_batch_size == actor.ppo_mini_batch_size == 8
    assert (rollout.n, rollout.temperature, config.data.max_response_length) == (
        vs_trl.REAL["n"], vs_trl.REAL["temperature"], vs_trl.REAL["response"])
    assert (actor.ppo_micro_batch_size_per_gpu, actor.optim.lr) == (vs_trl.REAL["micro"], vs_trl.REAL["lr"])
    assert config.trainer.total_training_steps == 3 and config.trainer.run_dir == str(run_dir)
    assert not actor.use_kl_loss and not config.algorithm.use_kl_in_reward  # TRL runs at beta=0
    # hybridrl's update holds each prompt once for its n samples (the CPU default), whose micro-batches
    # are whole groups: n rows each
    assert plan.resolved.shared_prefix("actor") and actor.ppo_micro_batch_size_per_gpu % rollout.n == 0


def test_real_case_pp2_runs_the_plans_most_even_split(real_model, tmp_path, monkeypatch):
    """PP2 takes the plan's split (the last stage also holds the vocab head): the plan then has no
    imbalance to warn about; `even` keeps megatron's 15 + 15, which it does warn about."""
    monkeypatch.chdir(ROOT)
    balanced = plan_from_sources(ROOT / vs_trl.REAL_CONFIG, vs_trl.real_overrides("pp2", 8, 3, tmp_path, seed=0))
    even = plan_from_sources(ROOT / vs_trl.REAL_CONFIG,
                             vs_trl.real_overrides("pp2", 8, 3, tmp_path, seed=0, pp_split="even"))
    assert balanced.stage_balance[0].layers == (18, 12) and even.stage_balance[0].layers == (15, 15)
    assert not [w for w in balanced.warnings if "pipeline stages" in w]
    assert [w for w in even.warnings if "pipeline stages" in w]
