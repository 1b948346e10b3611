"""`override_transformer_config` at plan time, against megatron-core itself.

The plan is torch-free, so it checks names and values against a table of megatron's TransformerConfig
fields (hybridrl/config/megatron_fields.py): the table must equal what the installed megatron-core's dataclass
says, and the plan's activation-recompute verdict must equal whether megatron's own TransformerConfig
accepts the same settings.
"""
from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from hybridrl.config.errors import ConfigError
from hybridrl.config.megatron_fields import TRANSFORMER_CONFIG_FIELDS
from hybridrl.config.megatron_rules import TRANSFORMER_FIELDS_SET_BY
from hybridrl.config.plan import plan_from_sources
from hybridrl.config.verl_keys import VERL_KEYS, Alias, Restates
from hybridrl.models.arch import ModelShape
from tools.megatron_fields import render

ROOT = Path(__file__).resolve().parents[2]
SEED = ROOT / "configs/examples/seed_6gpu_grpo.yaml"  # qwen2.5-0.5b shape, 24 layers, cuda
OVERRIDES = "actor_rollout_ref.actor.megatron.override_transformer_config"


def test_the_table_is_the_installed_megatron_cores():
    assert (ROOT / "hybridrl/config/megatron_fields.py").read_text() == render(), \
        "megatron-core changed: run python tools/megatron_fields.py"


def test_every_field_hybridrl_sets_from_the_model_is_refused_or_aliased():
    """What the bridge writes into TransformerConfig from a model's shape (dense and MoE) cannot be overridden:
    each such field is refused naming its source, or read as the role's own field of the same name."""
    aliased = {entry.key.rsplit(".", 1)[-1] for entry in VERL_KEYS  # read as a role field, or as what it restates
               if isinstance(entry, (Alias, Restates)) and ".override_transformer_config." in entry.key}
    owned = {name for names in TRANSFORMER_FIELDS_SET_BY.values() for name in names}
    for folder in ("qwen2.5-0.5b", "qwen3-30b-a3b"):
        shape = ModelShape.from_hf_dir(str(ROOT / "configs/models" / folder))
        written = set(shape.megatron_config_kwargs(1, 1, None, 1))
        assert written <= owned | aliased, sorted(written - owned - aliased)
    assert owned <= set(TRANSFORMER_CONFIG_FIELDS) and aliased <= set(TRANSFORMER_CONFIG_FIELDS)


def _plan_verdict(settings: dict) -> bool:
    overrides = [f"{OVERRIDES}.{k}={'null' if v is None else v}" for k, v in settings.items()]
    try:
        plan_from_sources(SEED, overrides)
        return True
    except ConfigError:
        return False


def _megatron_verdict(settings: dict) -> bool:
    from megatron.core.transformer import TransformerConfig

    shape = ModelShape.from_hf_dir(str(ROOT / "configs/models/qwen2.5-0.5b"))
    kwargs = shape.megatron_config_kwargs(1, 1, None, 1)
    kwargs.pop("activation_func")
    try:
        TransformerConfig(**kwargs, **{k: v for k, v in settings.items() if v is not None})
        return True
    except (ValueError, AssertionError):
        return False


COMBOS = [dict(zip(("recompute_granularity", "recompute_method", "recompute_num_layers"), values))
          for values in itertools.product((None, "full", "selective"), (None, "uniform", "block"), (None, 1, 4))]


@pytest.mark.parametrize("settings", COMBOS, ids=lambda s: "-".join(str(v) for v in s.values()))
def test_recompute_verdict_is_megatrons(settings):
    """megatron's verdict, except where megatron ignores a setting: a method or layer count without a
    granularity recomputes nothing there, and the plan refuses it rather than drop it."""
    dropped = settings["recompute_granularity"] is None and any(v is not None for v in settings.values())
    expected = False if dropped else _megatron_verdict(settings)
    if dropped:
        assert _megatron_verdict(settings)  # megatron takes it, and recomputes nothing
    assert _plan_verdict(settings) == expected, settings


@pytest.mark.parametrize("override, rule", [
    ("recompute_granularity=fulll", "is not a value this field takes (choice:full|selective, none)"),
    ("recompute_num_layer=1", "is not a field of megatron-core 0.16.1's TransformerConfig; did you mean "
                              "'recompute_num_layers'?"),
    ("num_layers=4", "is set by hybridrl from the model's config.json"),
    ("softmax_scale=0.5", "is set by hybridrl from the model's config.json"),  # head_dim, YaRN's attention factor
    ("tensor_model_parallel_size=2", "is set by hybridrl from the role's megatron layout"),
    ("params_dtype=bf16", "is set by hybridrl from the role's dtype and device"),
    ("calculate_per_token_loss=true", "is set by hybridrl from the role's loss_agg_mode"),
    ("apply_rope_fusion=maybe", "is not a value this field takes (bool)"),
])
def test_a_bad_override_is_refused_naming_it(override, rule):
    with pytest.raises(ConfigError) as info:
        plan_from_sources(SEED, [f"{OVERRIDES}.{override}"])
    name = override.split("=")[0]
    (issue,) = [i for i in info.value.issues if i.field == f"{OVERRIDES}.{name}"]
    assert rule in issue.rule


def test_cuda_kernels_are_refused_on_cpu_only():
    cuda = plan_from_sources(SEED, [f"{OVERRIDES}.gradient_accumulation_fusion=true",
                                    f"{OVERRIDES}.moe_permute_fusion=true", f"{OVERRIDES}.attention_backend=flash"])
    assert cuda.config.actor_rollout_ref.actor.megatron.override_transformer_config["attention_backend"] == "flash"
    with pytest.raises(ConfigError) as info:
        plan_from_sources(SEED, ["trainer.device=cpu", f"{OVERRIDES}.gradient_accumulation_fusion=true",
                                 f"{OVERRIDES}.attention_backend=flash", f"{OVERRIDES}.masked_softmax_fusion=false"])
    fields = sorted(i.field.rsplit(".", 1)[-1] for i in info.value.issues if "override_transformer_config" in i.field)
    assert fields == ["attention_backend", "gradient_accumulation_fusion"]  # false is what the CPU layer runs


def test_recompute_set_twice_is_refused_and_full_recompute_is_in_the_memory_estimate():
    with pytest.raises(ConfigError, match="both set activation recompute: keep one"):
        plan_from_sources(SEED, ["actor_rollout_ref.model.enable_gradient_checkpointing=true",
                                 f"{OVERRIDES}.recompute_granularity=full", f"{OVERRIDES}.recompute_method=uniform",
                                 f"{OVERRIDES}.recompute_num_layers=1"])
    plain = plan_from_sources(SEED)
    full = [f"{OVERRIDES}.recompute_granularity=full", f"{OVERRIDES}.recompute_method=uniform",
            f"{OVERRIDES}.recompute_num_layers=1"]
    recompute = plan_from_sources(SEED, full)
    switch = plan_from_sources(SEED, ["actor_rollout_ref.model.enable_gradient_checkpointing=true"])

    def activations(plan):
        return max(m.activations_gib_in_flight for m in plan.training_memory if m.role == "actor")

    assert activations(recompute) == activations(switch) < activations(plain)


OPTIMIZER = "actor_rollout_ref.actor.optim.override_optimizer_config"


@pytest.mark.parametrize("override, rule", [
    ("lr=0.1", "is set by hybridrl from the role's optim section"),
    ("use_distributed_optimizer=false", "is set by hybridrl from the role's megatron.use_distributed_optimizer"),
    ("optimizer_cpu_ofload=true", "is not a field of megatron-core 0.16.1's OptimizerConfig; did you mean "
                                  "'optimizer_cpu_offload'?"),
    ("optimizer_offload_fraction=all", "is not a value this field takes (float)"),
])
def test_a_bad_optimizer_override_is_refused_naming_it(override, rule):
    with pytest.raises(ConfigError) as info:
        plan_from_sources(SEED, [f"{OPTIMIZER}.{override}"])
    (issue,) = [i for i in info.value.issues if i.field == f"{OPTIMIZER}.{override.split('=')[0]}"]
    assert rule in issue.rule


def test_megatrons_host_optimizer_on_cuda_only_and_with_hybridrls_offload_a_no_op():
    verl = [f"{OPTIMIZER}.optimizer_cpu_offload=true", f"{OPTIMIZER}.optimizer_offload_fraction=1.0",
            f"{OPTIMIZER}.overlap_cpu_optimizer_d2h_h2d=true",
            "actor_rollout_ref.actor.megatron.optimizer_offload=true"]
    plan = plan_from_sources(SEED, verl)  # verl's 235B/671B scripts set all four
    assert plan.config.actor_rollout_ref.actor.optim.override_optimizer_config["optimizer_offload_fraction"] == 1.0
    assert any("optimizer_offload=true has nothing to move" in w for w in plan.warnings)
    with pytest.raises(ConfigError) as info:
        plan_from_sources(SEED, ["trainer.device=cpu", *verl[:3]])
    refused = sorted(i.field.rsplit(".", 1)[-1] for i in info.value.issues if "override_optimizer_config" in i.field)
    assert refused == ["optimizer_cpu_offload", "overlap_cpu_optimizer_d2h_h2d"]


@pytest.mark.parametrize("pp, embedding, loss", [(2, True, True), (13, True, True), (5, True, False),
                                                  (5, False, True)])
def test_megatrons_split_flags_give_megatrons_layer_counts(pp, embedding, loss):
    """account_for_embedding/loss_in_pipeline_split (verl's 235B script sets both) are read as hybridrl's uneven
    split: each stage's decoder layers equal megatron's own get_num_layers_to_build with the flags (24 layers)."""
    import torch
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    from hybridrl.models.layout import ParallelLayout

    flags = [f"{OVERRIDES}.account_for_embedding_in_pipeline_split={str(embedding).lower()}",
             f"{OVERRIDES}.account_for_loss_in_pipeline_split={str(loss).lower()}"]
    layout = [f"actor_rollout_ref.actor.megatron.pipeline_model_parallel_size={pp}", f"trainer.n_gpus_per_node={pp}",
              "actor_rollout_ref.rollout.tensor_model_parallel_size=1", f"data.train_batch_size={2 * pp}",
              f"actor_rollout_ref.actor.ppo_mini_batch_size={2 * pp}"]
    plan = plan_from_sources(SEED, [*layout, *flags])
    megatron = plan.layout("actor").megatron
    ours = ParallelLayout(pp=pp, first_stage_layers=megatron.num_layers_in_first_pipeline_stage,
                          last_stage_layers=megatron.num_layers_in_last_pipeline_stage).stage_layers(24)
    reference = TransformerConfig(num_layers=24, hidden_size=64, num_attention_heads=4, pipeline_model_parallel_size=pp,
                                  account_for_embedding_in_pipeline_split=embedding,
                                  account_for_loss_in_pipeline_split=loss, pipeline_dtype=torch.float32)
    assert ours == tuple(get_num_layers_to_build(reference, pp_rank=r) for r in range(pp))
    assert not set(megatron.override_transformer_config) & {"account_for_embedding_in_pipeline_split",
                                                            "account_for_loss_in_pipeline_split"}


@pytest.mark.parametrize("settings, megatron_says", [
    # names and values the field table accepts, combinations megatron-core's TransformerConfig refuses
    ({"recompute_granularity": "selective", "recompute_modules": "[mla_up_proj]"}, "multi_latent_attention"),
    ({"recompute_granularity": "selective", "recompute_modules": "[attention_everywhere]"},
     "Invalid choices for recompute_modules"),
    ({"cpu_offloading": "true", "cpu_offloading_num_layers": 40}, "layers less than 24"),
    ({"fp8_param": "true"}, "fp8_param must be used together with fp8 mode"),
])
def test_what_megatron_refuses_is_refused_at_plan_in_its_words(settings, megatron_says):
    """megatron's __post_init__ holds rules the plan's table cannot (combinations): the plan builds each role's
    TransformerConfig as its workers do, and a refusal is a problem of the section instead of a worker's
    traceback at start-up."""
    overrides = [f"{OVERRIDES}.{name}={value}" for name, value in settings.items()]
    with pytest.raises(ConfigError) as info:
        plan_from_sources(SEED, overrides)
    (issue,) = info.value.issues
    assert issue.field == OVERRIDES and "refused by megatron-core's TransformerConfig" in issue.rule
    assert megatron_says in issue.rule, issue.rule
    assert not _megatron_verdict({k: v if not isinstance(v, str) or not v.startswith("[") else v[1:-1].split(",")
                                  for k, v in ((k, {"true": True}.get(v, v)) for k, v in settings.items())})


def test_megatrons_check_builds_the_role_as_its_workers_do():
    """The same settings pass where the role makes them valid: cpu offloading of fewer layers than the model
    has; selective recompute of megatron's own modules (and the check leaves no CPU stand-in behind)."""
    from megatron.core.models.common.embeddings import rope_utils

    before = rope_utils.fused_apply_rotary_pos_emb if hasattr(rope_utils, "fused_apply_rotary_pos_emb") else None
    plan = plan_from_sources(SEED, [f"{OVERRIDES}.recompute_granularity=selective",
                                    f"{OVERRIDES}.recompute_modules=[core_attn,mlp]"])
    assert plan.config.actor_rollout_ref.actor.megatron.override_transformer_config["recompute_modules"] == \
        ["core_attn", "mlp"]
    plan_from_sources(SEED, ["trainer.device=cpu", f"{OVERRIDES}.cpu_offloading=true",
                             f"{OVERRIDES}.cpu_offloading_num_layers=2"])
    after = rope_utils.fused_apply_rotary_pos_emb if hasattr(rope_utils, "fused_apply_rotary_pos_emb") else None
    assert before is after
