"""The hybrid engine's generation peak credits each part the actor offloads (optimizer, grads) on its own."""
from pathlib import Path

import pytest

from hybridrl.config import ConfigError
from hybridrl.config.plan import plan_from_sources

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs/examples/qwen2.5_32b_grpo_4x8.yaml")
MC = "actor_rollout_ref.actor.megatron"


def test_generation_peak_drops_by_what_is_offloaded():
    # on a roomy GPU every combination plans, so the peaks can be compared
    roomy = "trainer.gpu_memory_gib=1000"
    plans = {(opt, grad): plan_from_sources(CONFIG, [f"{MC}.optimizer_offload={opt}", f"{MC}.grad_offload={grad}",
                                                     roomy])
             for opt in (False, True) for grad in (False, True)}
    actor = next(m for m in plans[(True, True)].training_memory if m.role == "actor")
    gen = {k: p.phase_peaks.generation_gib for k, p in plans.items()}
    assert abs(gen[(False, False)] - gen[(True, False)] - actor.optimizer_gib) < 0.01
    assert abs(gen[(False, False)] - gen[(False, True)] - actor.grads_gib) < 0.01
    # on the example's 80 GB GPUs: fits with both offloaded, refused with nothing offloaded
    assert plan_from_sources(CONFIG, [f"{MC}.optimizer_offload=true", f"{MC}.grad_offload=true"]).phase_peaks.fits
    assert gen[(False, False)] > 80
    with pytest.raises(ConfigError, match="optimizer_offload=true"):
        plan_from_sources(CONFIG, [f"{MC}.optimizer_offload=false", f"{MC}.grad_offload=false"])
