"""The rules of the megatron sections at plan time: megatron-core's own settings passed through
(`override_transformer_config`, `override_optimizer_config`, `override_ddp_config`, recompute), which hybridrl sets
itself and which it cannot honour on a device, and context parallelism. Torch-free; called by `config.validate`."""
from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from typing import Any

from hybridrl.config.checker import Checker
from hybridrl.config.megatron_fields import (
    DDP_CONFIG_FIELDS,
    MEGATRON_CORE_VERSION,
    OPTIMIZER_CONFIG_FIELDS,
    TRANSFORMER_CONFIG_FIELDS,
)
from hybridrl.config.resolve import Resolved
from hybridrl.config.schema import JobConfig, MegatronConfig
from hybridrl.models.arch import ModelShape
from hybridrl.parallel.device_policy import CPU_LAYER_TRANSFORMER_SETTINGS, CUDA_KERNEL_TRANSFORMER_SETTINGS


def megatron_sections(config: JobConfig) -> list[tuple[str, MegatronConfig]]:
    """Every megatron layout the user can write, with its dotted path (ref's only when set)."""
    arr = config.actor_rollout_ref
    sections = [("actor_rollout_ref.actor.megatron", arr.actor.megatron)]
    if arr.ref.megatron is not None:
        sections.append(("actor_rollout_ref.ref.megatron", arr.ref.megatron))
    return [*sections, ("critic.megatron", config.critic.megatron),
            ("reward_model.megatron", config.reward_model.megatron), ("teacher.megatron", config.teacher.megatron)]


MEGATRON_SPLIT_FLAGS = ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")
# megatron TransformerConfig fields hybridrl sets itself (`models.bridge.transformer_config`, the training
# backend): an `override_transformer_config` of one is refused, naming where its value comes from.
TRANSFORMER_FIELDS_SET_BY = {
    "the model's config.json": (
        "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "kv_channels",
        "normalization", "layernorm_epsilon", "activation_func", "gated_linear_unit", "add_bias_linear",
        "add_qkv_bias", "qk_layernorm", "hidden_dropout", "attention_dropout", "num_moe_experts", "moe_router_topk",
        "moe_ffn_hidden_size", "moe_layer_freq", "moe_router_pre_softmax", "moe_router_score_function",
        # 1 / sqrt(head_dim), or YaRN's attention factor squared over it
        "softmax_scale"),
    "the role's megatron layout (hybridrl splits the layers itself)": (
        "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
        "context_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size",
        "pipeline_model_parallel_layout"),
    # read as num_layers_in_first/last_pipeline_stage where they give the same split (plan.megatron_pipeline_split);
    # still here they did not: PP 1, VPP, an uneven split set too, a layer count PP does not divide, no config.json
    "the role's megatron layout (as num_layers_in_first/last_pipeline_stage only at PP > 1 without VPP, neither set, "
    "and PP dividing the layers plus one for each flag)": MEGATRON_SPLIT_FLAGS,
    "the role's dtype and device": (
        "params_dtype", "pipeline_dtype", "bf16", "fp16", "perform_initialization", "use_cpu_initialization",
        "variable_seq_lengths"),
    # each micro-batch's loss comes scaled by the step's token count, micro-batches and DP size (loss_agg_mode);
    # megatron's per-token mode would then skip DDP's 1/DP and sum the DP replicas' gradients (measured: twice
    # the grad norm at DP2) and weight the MoE router losses per step instead of per micro-batch
    "the role's loss_agg_mode (hybridrl scales each micro-batch's loss itself)": ("calculate_per_token_loss",),
}


# megatron OptimizerConfig fields hybridrl sets itself (the training backend): refused in override_optimizer_config.
OPTIMIZER_FIELDS_SET_BY = {
    "the role's optim section": ("optimizer", "lr", "min_lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps",
                                 "clip_grad"),
    "the role's dtype": ("bf16", "fp16", "params_dtype"),
    "the role's megatron.use_distributed_optimizer": ("use_distributed_optimizer",),
}
# OptimizerConfig settings that need CUDA (megatron's HybridDeviceOptimizer moves states between GPU and host;
# the precision-aware optimizer is TransformerEngine's FusedAdam): off on cpu, where the states live on the host.
CUDA_OPTIMIZER_SETTINGS = {"optimizer_cpu_offload": False, "overlap_cpu_optimizer_d2h_h2d": False,
                           "use_precision_aware_optimizer": False, "pin_cpu_grads": True, "pin_cpu_params": True}


def check_megatron_settings(check: Checker, where: str, settings: dict[str, Any], class_name: str,
                             fields: dict[str, tuple[str, ...]], set_by: dict[str, str],
                             device_settings: Mapping[str, object], device_rule: str) -> None:
    """One megatron config dataclass's user settings (`where`.<name>): each a field of `class_name` (`fields`,
    generated from megatron-core), not one hybridrl sets (`set_by`: name -> where from), of a value its type
    takes, and on this device the value `device_settings` holds where it holds one."""
    for name, value in settings.items():
        field = f"{where}.{name}"
        forms = fields.get(name)
        if forms is None:
            close = difflib.get_close_matches(name, list(fields), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            check.fail(field, value, f"is not a field of megatron-core {MEGATRON_CORE_VERSION}'s {class_name}{hint}")
        elif name in set_by:
            check.fail(field, value, f"is set by hybridrl from {set_by[name]}")
        elif not _takes_form(value, forms):
            check.fail(field, value, f"is not a value this field takes ({', '.join(forms)})")
        elif name in device_settings and value != device_settings[name]:
            check.fail(field, value, device_rule, [device_settings[name]])


def check_optimizer_overrides(check: Checker, config: JobConfig, resolved: Resolved) -> None:
    """`optim.override_optimizer_config` (verl's key) of each trained role: names and values of megatron's
    OptimizerConfig, none that hybridrl sets, no CUDA-only setting on cpu, and one way of offloading states."""
    set_by = {name: source for source, names in OPTIMIZER_FIELDS_SET_BY.items() for name in names}
    cpu = resolved.device == "cpu"
    for prefix, optim, megatron in (("actor_rollout_ref.actor", config.actor_rollout_ref.actor.optim,
                                     config.actor_rollout_ref.actor.megatron),
                                    ("critic", config.critic.optim, config.critic.megatron)):
        where = f"{prefix}.optim.override_optimizer_config"
        check_megatron_settings(check, where, optim.override_optimizer_config, "OptimizerConfig",
                                 OPTIMIZER_CONFIG_FIELDS, set_by, CUDA_OPTIMIZER_SETTINGS if cpu else {},
                                 "needs CUDA: on trainer.device=cpu the optimizer states live on the host")
        if optim.override_optimizer_config.get("optimizer_cpu_offload") and megatron.optimizer_offload:
            check.warnings.append(f"{prefix}.megatron.optimizer_offload=true has nothing to move: with "
                                  f"{where}.optimizer_cpu_offload=true megatron keeps the optimizer states on the "
                                  "host and steps there (verl's scripts set both)")


# megatron DistributedDataParallelConfig fields hybridrl sets itself (the training backend): refused in
# override_ddp_config, naming where the value comes from.
DDP_FIELDS_SET_BY = {
    "the role's megatron.use_distributed_optimizer": ("use_distributed_optimizer",),
    "its fp32 gradient reduction (the reference the tests hold the update to)": ("grad_reduce_in_fp32",),
    "its DDP wrapper (megatron's FSDP is not served)": ("use_megatron_fsdp", "use_custom_fsdp"),
}
TRAINED_SECTIONS = ("actor_rollout_ref.actor.megatron", "critic.megatron")


def check_ddp_overrides(check: Checker, config: JobConfig) -> None:
    """`override_ddp_config` (verl's key) of each trained role: names and values of megatron's
    DistributedDataParallelConfig, none that hybridrl sets, the parameter-gather overlap only with the
    distributed optimizer (megatron's rule); a frozen role's section has no DDP to configure."""
    set_by = {name: source for source, names in DDP_FIELDS_SET_BY.items() for name in names}
    for prefix, mc in megatron_sections(config):
        where = f"{prefix}.override_ddp_config"
        if prefix not in TRAINED_SECTIONS:
            if mc.override_ddp_config:
                check.fail(where, mc.override_ddp_config, "configures megatron's DDP, which only a trained role "
                           "(actor, critic) has")
            continue
        check_megatron_settings(check, where, mc.override_ddp_config, "DistributedDataParallelConfig",
                                 DDP_CONFIG_FIELDS, set_by, {}, "")
        if mc.override_ddp_config.get("overlap_param_gather") is True:
            if not mc.use_distributed_optimizer:
                check.fail(f"{where}.overlap_param_gather", True, f"needs {prefix}.use_distributed_optimizer=true "
                           "(the parameter all-gather is the distributed optimizer's)", [False])
            elif mc.override_ddp_config.get("overlap_grad_reduce") is False:
                check.fail(f"{where}.overlap_param_gather", True, f"needs {where}.overlap_grad_reduce=true "
                           "(Megatron-LM refuses one without the other)", [False])


def check_transformer_overrides(check: Checker, config: JobConfig, resolved: Resolved,
                                 model: ModelShape | None) -> None:
    """`override_transformer_config` (verl's key): each name a field of megatron's TransformerConfig that hybridrl
    does not set itself, each value of that field's type, on cpu no CUDA kernel, and activation recompute as
    megatron's TransformerConfig accepts it (the same rules; tests/config/test_megatron_fields.py holds them
    equal to megatron's own)."""
    set_by = {name: source for source, names in TRANSFORMER_FIELDS_SET_BY.items() for name in names}
    cpu = resolved.device == "cpu"
    # on cpu: no fused CUDA kernels, and the CPU layer's own attention (megatron's auto backend) serves every pass
    device_settings = {**CPU_LAYER_TRANSFORMER_SETTINGS, **CUDA_KERNEL_TRANSFORMER_SETTINGS,
                       "attention_backend": "auto"} if cpu else {}
    for prefix, mc in megatron_sections(config):
        overrides = mc.override_transformer_config
        where = f"{prefix}.override_transformer_config"
        # False restates megatron's default of the pipeline-split flags (true is read as the split it makes)
        settings = {name: value for name, value in overrides.items()
                    if not (name in MEGATRON_SPLIT_FLAGS and value is False)}
        check_megatron_settings(check, where, settings, "TransformerConfig", TRANSFORMER_CONFIG_FIELDS, set_by,
                                 device_settings, "needs CUDA kernels: on trainer.device=cpu the CPU layer runs "
                                                  "without them")
        check_recompute(check, config, prefix, mc, model)
        if not cpu and prefix in TRAINED_SECTIONS and overrides.get("gradient_accumulation_fusion") is True:
            check.warnings.append(
                f"{where}.gradient_accumulation_fusion=true needs Apex's fused_weight_gradient_mlp_cuda on every "
                "worker (megatron's own output layer uses it even under TransformerEngine's spec), which hybridrl's "
                "GPU stack does not install: the workers stop at start-up without it (hybridrl turns it on by itself "
                "where Apex imports)")


def _takes_form(value: Any, forms: Sequence[str]) -> bool:
    for form in forms:
        if form == "other":
            continue
        if form == "none" and value is None or form == "bool" and isinstance(value, bool):
            return True
        if form == "int" and isinstance(value, int) and not isinstance(value, bool):
            return True
        if form == "float" and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
        if form == "str" and isinstance(value, str):
            return True
        choices = form.rsplit(":", 1)[1].split("|") if form.startswith(("choice:", "enum:")) else ()
        if isinstance(value, str) and value in choices:
            return True
        if form.startswith("list[") and isinstance(value, list):
            inner = form[5:-1]
            return all(_takes_form(item, (inner,)) for item in value)
    return False


def check_recompute(check: Checker, config: JobConfig, prefix: str, mc: MegatronConfig,
                     model: ModelShape | None) -> None:
    """megatron's activation-recompute rules (`TransformerConfig.__post_init__`), at plan time."""
    overrides = mc.override_transformer_config
    names = ("recompute_granularity", "recompute_method", "recompute_num_layers")
    granularity, method, layers = (overrides.get(name) for name in names)
    where = f"{prefix}.override_transformer_config"
    if granularity is None:
        if method is not None or layers is not None:
            check.fail(f"{where}.recompute_granularity", granularity,
                       "must be full or selective when recompute_method or recompute_num_layers is set",
                       ["full", "selective"])
        return
    model_field, model_section = model_section_beside(config, prefix)
    if model_section.enable_gradient_checkpointing:
        check.fail(f"{model_field}.enable_gradient_checkpointing", True,
                   f"and {where}.recompute_granularity={granularity} both set activation recompute: keep one")
    if granularity == "full":
        if method is None:
            check.fail(f"{where}.recompute_method", method, "must be set with recompute_granularity=full",
                       ["uniform", "block"])
        per_stage = model.num_layers // mc.pipeline_model_parallel_size if model is not None \
            and isinstance(mc.pipeline_model_parallel_size, int) and mc.pipeline_model_parallel_size > 0 else None
        if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1 or \
                (per_stage is not None and layers > per_stage):
            check.fail(f"{where}.recompute_num_layers", layers,
                       "must be set with recompute_granularity=full: layers per recompute group (uniform) or "
                       f"recomputed layers per stage (block), 1 to {per_stage or 'the layers per stage'}")
    elif granularity == "selective" and layers is not None:
        check.fail(f"{where}.recompute_num_layers", layers, "must be unset with recompute_granularity=selective",
                   [None])


def model_section_beside(config: JobConfig, megatron_prefix: str) -> tuple[str, Any]:
    """The model section (dotted path, section) whose weights a megatron section lays out."""
    if megatron_prefix.startswith("critic"):
        return "critic.model", config.critic.model
    if megatron_prefix.startswith("reward_model"):
        return "reward_model.model", config.reward_model.model
    if megatron_prefix.startswith("teacher"):
        return "teacher.model", config.teacher.model
    return "actor_rollout_ref.model", config.actor_rollout_ref.model


def check_context_parallel(check: Checker, config: JobConfig, prefix: str, mc: MegatronConfig, cp: int,
                            policy: Any) -> None:
    """context_parallel_size > 1: what the workers serve so far (CPU, padded or packed), the rest refused.

    Sequence lengths need no rule: the training backend pads each micro-batch (packed: each row's
    segment) to a multiple of 2 × CP (megatron's load-balanced split), and the memory estimate divides
    activations by CP."""
    field = f"{prefix}.context_parallel_size"
    # one message per field: the first rule that fails
    if policy is not None and not policy.megatron_cpu_layer:
        check.fail(field, cp, f"is implemented on trainer.device=cpu only so far (the CPU attention stand-in "
                   f"all-gathers keys and values); on {config.trainer.device} TransformerEngine's ring attention "
                   "is not wired yet; use 1", [1])
    elif mc.sequence_parallel and mc.tensor_model_parallel_size != 1:
        check.fail(field, cp, "with sequence_parallel=true is not implemented yet (the last stage gathers "
                   "hidden states over CP along the sequence, which SP splits over TP); use 1", [1])
