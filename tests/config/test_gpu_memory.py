"""The per-GPU memory plan counts every role colocated on a GPU, item by item, against sums written here.

The hybrid engine's GPUs hold the actor (+ reference, offloaded between its passes) and vLLM in one process,
and the critic and reward model in processes of their own: each phase of a step is what all of them hold
then. The figures per role come from the plan's own `training_memory` (tested against hand counts in
tests/config/test_offload_estimate.py); the overheads are the constants stated in `estimates.GpuOverheads`
(written again here: a change there must be a decision, seen in this test).
"""
import re
from pathlib import Path

import pytest

from hybridrl.config import ConfigError
from hybridrl.config.plan import plan_from_sources

ROOT = Path(__file__).resolve().parents[2]
PPO_70B = str(ROOT / "configs/examples/llama3_70b_ppo_16x8.yaml")
CONTEXT, COMMUNICATOR, MARGIN = 0.75, 0.5, 0.05


def _roles(plan):
    return {m.role: m for m in plan.training_memory}


def test_70b_ppo_phases_sum_every_colocated_role():
    plan = plan_from_sources(PPO_70B)
    roles = _roles(plan)
    actor, critic, ref = roles["actor"], roles["critic"], roles["ref"]
    # the example offloads both trained roles' grads and Adam moments between their updates: each keeps its
    # bf16 params and fp32 master weights (its 4-byte share of the 12 bytes of mixed-precision Adam)
    assert actor.master_params_gib == pytest.approx(actor.optimizer_gib / 3, rel=1e-2)
    held = actor.params_gib + actor.master_params_gib + critic.params_gib + critic.master_params_gib
    # NCCL: each training process (TP8 x PP4 x DP4) uses the world group, TP, PP, DP and TP x PP (grad
    # norm): 5; actor and critic: 10; vLLM's TP8 group: 11
    overheads = 2 * CONTEXT + 11 * COMMUNICATOR
    # vLLM asleep keeps its TP8 all-reduce workspaces: symmetric memory 128 MiB + FlashInfer 3 x 4 MiB x 8
    # peers (the custom all-reduce is off in hybridrl's engine)
    asleep = (128 + 3 * 4 * 8) / 1024
    expected = {
        "generation": 0.5 * 80 + held + overheads,
        "actor update": held + actor.grads_gib + actor.moments_gib + actor.activations_gib_in_flight
        + asleep + overheads,
        "critic update": held + critic.grads_gib + critic.moments_gib + critic.activations_gib_in_flight
        + asleep + overheads,
        "ref pass": held + ref.params_gib + ref.activations_gib_in_flight + asleep + overheads,
    }
    memory = plan.gpu_memory
    assert {p.name: p.total_gib for p in memory.phases} == pytest.approx(expected, abs=0.01)
    assert memory.peak.name == "generation" and memory.margin_gib == MARGIN * 80
    assert memory.peak_gib == pytest.approx(expected["generation"] + 4, abs=0.01) and memory.fits
    # vLLM's start-up check: the actor's process as built (grads offloaded at set-up, Adam's moments not
    # made yet) must leave 0.5 x 80 free
    startup = actor.params_gib + actor.master_params_gib + CONTEXT + 5 * COMMUNICATOR
    assert memory.startup.total_gib == pytest.approx(startup, abs=0.01) and memory.startup_limit_gib == 40


def test_the_colocated_critic_decides_whether_the_70b_job_fits():
    """Counting the actor and reference alone (the plan before this model), the job below fits with room
    to spare; with the critic's resident training state next to vLLM it does not, and the plan says which
    critic setting makes it fit."""
    overrides = ["critic.megatron.optimizer_offload=false", "critic.megatron.grad_offload=false",
                 "actor_rollout_ref.rollout.gpu_memory_utilization=0.6"]
    roomy = plan_from_sources(PPO_70B, [*overrides, "trainer.gpu_memory_gib=200"])
    roles = _roles(roomy)
    actor, critic = roles["actor"], roles["critic"]
    actor_and_ref_only = 0.6 * 80 + actor.params_gib + actor.master_params_gib
    assert actor_and_ref_only < 60
    critic_resident = critic.params_gib + critic.grads_gib + critic.optimizer_gib
    assert critic_resident > 18
    with pytest.raises(ConfigError) as refused:
        plan_from_sources(PPO_70B, overrides)
    message = str(refused.value)
    assert "generation" in message
    assert "critic.megatron.grad_offload=true and critic.megatron.optimizer_offload=true (" in message
    assert plan_from_sources(PPO_70B, overrides[2:]).gpu_memory.fits  # the named way fits


@pytest.mark.parametrize("example", ["llama3_70b_ppo_16x8", "qwen2.5_32b_grpo_4x8", "qwen2.5_7b_grpo_8gpu",
                                     "qwen3_30b_a3b_grpo_4x8"])
def test_shipped_gpu_examples_fit_with_every_share_listed(example):
    from hybridrl.config.report import render_plan

    plan = plan_from_sources(str(ROOT / f"configs/examples/{example}.yaml"))
    assert plan.gpu_memory.fits and plan.gpu_memory.startup_fits
    text = render_plan(plan)
    for item in ("vLLM (gpu_memory_utilization", "CUDA contexts", "NCCL (", "actor params", "peak:",
                 "vLLM start-up check"):
        assert item in text, (example, item)
    if "critic" in {m.role for m in plan.training_memory}:
        assert "critic update" in text and "critic params" in text


QWEN_7B = str(ROOT / "configs/examples/qwen2.5_7b_grpo_8gpu.yaml")


def _advice(overrides):
    with pytest.raises(ConfigError) as refused:
        plan_from_sources(QWEN_7B, overrides)
    (issue,) = refused.value.issues
    assert issue.field == "trainer.gpu_memory_gib"
    return issue.rule


@pytest.mark.parametrize(("overrides", "advised"), [
    # on 40 GiB GPUs the reference's pass peaks; doubling the actor's TP or PP (the reference's with it) fits
    (["trainer.gpu_memory_gib=40"], ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4",
                                     "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2"]),
    # two GPUs at TP1: TP2 fits; PP2 (77.9 + 4 GiB) does not, and is not offered
    (["trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
      "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1"],
     ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"]),
])
def test_each_change_a_memory_refusal_advises_plans_and_fits_at_the_peak_it_names(overrides, advised):
    """Each TP/PP/recompute/micro-batch change the refusal offers is planned with it through the loader here, and fits
    at the peak it names; it said 'more TP/PP for the actor or critic' and 'a smaller ppo_micro_batch_size_per_gpu'
    unchecked, where the heaviest phase was the reference's pass and no smaller actor micro-batch fitted."""
    rule = _advice(overrides)
    offered = re.findall(r"(\S+=\S+) \(peak ([\d.]+) GiB\)", rule)
    assert [change for change, _ in offered] == advised, rule
    for change, peak in offered:
        memory = plan_from_sources(QWEN_7B, [*overrides, change]).gpu_memory
        assert memory.fits and f"{memory.peak_gib:.1f}" == peak


def test_a_job_no_single_change_fits_is_sent_to_the_search_which_finds_one():
    """7B GRPO on 24 GiB GPUs: no single change fits, which the refusal says, naming `--search`; the search finds a
    layout with its memory savers that plans."""
    from hybridrl.config.search import search_from_sources

    rule = _advice(["trainer.gpu_memory_gib=24"])
    assert "no single change" in rule and "`hybridrl plan --search`" in rule and "(peak" not in rule
    for change in ("actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4",
                   "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
                   "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8"):
        with pytest.raises(ConfigError):  # what the guessed advice would have led to: still refused
            plan_from_sources(QWEN_7B, ["trainer.gpu_memory_gib=24", change])
    found = search_from_sources(QWEN_7B, ["trainer.gpu_memory_gib=24", "trainer.hardware=h100-sxm"]).ranked
    assert found and plan_from_sources(QWEN_7B, ["trainer.gpu_memory_gib=24", *found[0].overrides()]).gpu_memory.fits
