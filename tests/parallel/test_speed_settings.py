"""megatron's fusions and overlaps on cuda (issue 47): the defaults, hand-listed per case; what the plan shows
and refuses; the DDP settings checked against megatron-core's own dataclass.

That the settings reach megatron's TransformerConfig and DistributedDataParallelConfig unchanged, and keep the
update's numbers, is tests/training/test_transformer_overrides.py (real megatron on gloo ranks).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from hybridrl.config.errors import ConfigError
from hybridrl.config.plan import plan_from_sources
from hybridrl.config.report import render_plan
from hybridrl.parallel.speed_settings import DDP_SPEED_FIELDS, TRANSFORMER_SPEED_FIELDS, speed_settings

ROOT = Path(__file__).resolve().parents[2]
SEED = ROOT / "configs/examples/seed_6gpu_grpo.yaml"  # cuda, qwen2.5-0.5b shape, actor DP 2 with TP 2
DDP = "actor_rollout_ref.actor.megatron.override_ddp_config"
TRANSFORMER = "actor_rollout_ref.actor.megatron.override_transformer_config"


def _on(settings) -> dict[str, bool]:
    return {s.name: s.on for s in settings}


def test_the_cuda_defaults_for_a_trained_role_with_te():
    settings = speed_settings(cuda=True, trainable=True, data_parallel=4, distributed_optimizer=True, te=True,
                              apex_wgrad=False)
    assert _on(settings) == {"bias_activation_fusion": True, "bias_dropout_fusion": True, "apply_rope_fusion": True,
                             "gradient_accumulation_fusion": False, "masked_softmax_fusion": False,
                             "persist_layer_norm": False, "overlap_grad_reduce": True, "overlap_param_gather": True}
    assert [s.name for s in settings] == [*TRANSFORMER_SPEED_FIELDS[:2], "apply_rope_fusion",
                                          "gradient_accumulation_fusion", "masked_softmax_fusion",
                                          "persist_layer_norm", *DDP_SPEED_FIELDS]
    assert all(s.why for s in settings)


@pytest.mark.parametrize("case, kwargs, changed", [
    ("apex imports", dict(apex_wgrad=True), {"gradient_accumulation_fusion": True}),
    ("no TE on the worker", dict(te=False), {"apply_rope_fusion": False}),
    ("no distributed optimizer", dict(distributed_optimizer=False), {"overlap_param_gather": False}),
    ("DP 1", dict(data_parallel=1), {"overlap_grad_reduce": False, "overlap_param_gather": False}),
    ("user turns the grad overlap off", dict(user_ddp={"overlap_grad_reduce": False}),
     {"overlap_grad_reduce": False, "overlap_param_gather": False}),
    ("user's TE activation", dict(user_transformer={"use_te_activation_func": True}),
     {"bias_activation_fusion": False}),
    ("user asks for the softmax fusion", dict(user_transformer={"masked_softmax_fusion": True}),
     {"masked_softmax_fusion": True}),
])
def test_each_condition_changes_only_its_setting(case, kwargs, changed):
    base = dict(cuda=True, trainable=True, data_parallel=4, distributed_optimizer=True, te=True, apex_wgrad=False)
    reference = _on(speed_settings(**base))
    assert _on(speed_settings(**{**base, **kwargs})) == {**reference, **changed}, case


def test_a_frozen_role_and_the_cpu():
    frozen = speed_settings(cuda=True, trainable=False, data_parallel=4, distributed_optimizer=True, te=True)
    assert _on(frozen) == {"bias_activation_fusion": True, "bias_dropout_fusion": True, "apply_rope_fusion": True,
                           "gradient_accumulation_fusion": False, "masked_softmax_fusion": False,
                           "persist_layer_norm": False}  # no DDP, no gradients
    assert speed_settings(cuda=False, trainable=True, data_parallel=4, distributed_optimizer=True) == ()


def test_the_plan_lists_them_per_role_and_why_any_is_off():
    plan = plan_from_sources(SEED, [f"{DDP}.overlap_grad_reduce=false"])
    text = render_plan(plan)
    section = text[text.index("Fusions and overlaps"):].split("\n\n")[0].splitlines()
    assert section[1] == "  actor: on bias_activation_fusion, bias_dropout_fusion, apply_rope_fusion"
    assert "    off overlap_grad_reduce: set by the job (the default: overlap_grad_reduce: on" in "\n".join(section)
    assert any(line.startswith("    off overlap_param_gather: goes with overlap_grad_reduce") for line in section)
    assert any(line.startswith("    off gradient_accumulation_fusion: megatron's own output layer needs Apex")
               for line in section)
    cpu = render_plan(plan_from_sources(ROOT / "configs/examples/cpu_tiny_grpo.yaml"))
    assert "Fusions and overlaps: none on trainer.device=cpu" in cpu


@pytest.mark.parametrize("override, field, rule", [
    ("overlap_grad_reduse=true", "overlap_grad_reduse", "is not a field of megatron-core 0.16.1's "
     "DistributedDataParallelConfig; did you mean 'overlap_grad_reduce'?"),
    ("bucket_size=big", "bucket_size", "is not a value this field takes (int, none)"),
    ("grad_reduce_in_fp32=false", "grad_reduce_in_fp32", "is set by hybridrl from its fp32 gradient reduction"),
    ("use_distributed_optimizer=false", "use_distributed_optimizer",
     "is set by hybridrl from the role's megatron.use_distributed_optimizer"),
    ("use_megatron_fsdp=true", "use_megatron_fsdp", "megatron's FSDP is not served"),
])
def test_a_bad_ddp_setting_is_refused_naming_it(override, field, rule):
    with pytest.raises(ConfigError) as info:
        plan_from_sources(SEED, [f"{DDP}.{override}"])
    (issue,) = [i for i in info.value.issues if i.field == f"{DDP}.{field}"]
    assert rule in issue.rule


def test_the_param_gather_overlap_needs_the_distributed_optimizer_and_the_grad_overlap():
    with pytest.raises(ConfigError) as info:
        plan_from_sources(SEED, [f"{DDP}.overlap_param_gather=true",
                                 "actor_rollout_ref.actor.megatron.use_distributed_optimizer=false"])
    assert "needs actor_rollout_ref.actor.megatron.use_distributed_optimizer=true" in str(info.value)
    with pytest.raises(ConfigError) as info:
        plan_from_sources(SEED, [f"{DDP}.overlap_param_gather=true", f"{DDP}.overlap_grad_reduce=false"])
    assert f"needs {DDP}.overlap_grad_reduce=true" in str(info.value)
    with pytest.raises(ConfigError) as info:
        plan_from_sources(SEED, ["reward_model.megatron.override_ddp_config.bucket_size=1000"])
    assert "which only a trained role (actor, critic) has" in str(info.value)


def test_verls_wgrad_fusion_on_cuda_is_warned_at_plan_time():
    plan = plan_from_sources(SEED, [f"{TRANSFORMER}.gradient_accumulation_fusion=true"])
    assert any("gradient_accumulation_fusion=true needs Apex's fused_weight_gradient_mlp_cuda on every worker" in w
               for w in plan.warnings)
