"""Every rule a job config must satisfy, checked before any process or GPU is spent.

Each rule appends a `ConfigIssue` naming the dotted field, its value, the rule, and the nearest
valid values, and checking goes on: the user sees every problem at once. Rules that depend on a
failed one are skipped, so one mistake yields one message, not a cascade.
"""
from __future__ import annotations

import difflib
import math
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hybridrl.algorithms.names import (
    CRITIC_ADV_ESTIMATORS,
    GREEDY_BASELINE_ADV_ESTIMATORS,
    GROUP_ADV_ESTIMATORS,
)
from hybridrl.config.distillation_rules import check_distillation, check_teacher_placement, teacher_shape
from hybridrl.config.errors import ConfigError, ConfigIssue
from hybridrl.config.hardware import load_job_hardware
from hybridrl.config.megatron_fields import (
    DDP_CONFIG_FIELDS,
    MEGATRON_CORE_VERSION,
    OPTIMIZER_CONFIG_FIELDS,
    TRANSFORMER_CONFIG_FIELDS,
)
from hybridrl.config.refusals import LORA, check_refusals
from hybridrl.config.resolve import (
    MODEL_SECTIONS,
    Resolved,
    active_roles,
    needs_uniform_micro_batches,
    pass_batching,
    role_megatron,
    role_megatron_field,
)
from hybridrl.config.schema import (
    CHOICE_NAMES,
    REF_SHARES_WITH_ACTOR,
    JobConfig,
    MegatronConfig,
    MoEDispatcher,
    MoEDropPolicy,
    RolloutCorrectionConfig,
    closed_fields,
)
from hybridrl.models.arch import ModelShape
from hybridrl.models.layout import ParallelLayout
from hybridrl.models.lora_targets import TARGETS, VLLM_LORA_RANKS
from hybridrl.models.vllm_layout import vllm_padded_vocab
from hybridrl.names import Role
from hybridrl.parallel.device_policy import (
    CPU_LAYER_TRANSFORMER_SETTINGS,
    CUDA_KERNEL_TRANSFORMER_SETTINGS,
    DEVICE_POLICIES,
    WITHOUT_TE,
)

RESUME_MODES = ("auto", "disable")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0] if n > 0 else []


def nearest(value: Any, candidates: Iterable[int], k: int = 4) -> list[int]:
    """Up to k candidates closest to value, in increasing order."""
    pool = sorted(set(candidates))
    if not isinstance(value, (int, float)):
        return pool[:k]
    return sorted(sorted(pool, key=lambda c: (abs(c - value), c))[:k])


def nearest_satisfying(value: int, ok: Callable[[int], bool], k: int = 4, limit: int = 1 << 16) -> list[int]:
    """Up to k positive integers closest to value for which ok() holds (searching outwards)."""
    found: list[int] = []
    base = value if isinstance(value, int) and value > 0 else 1
    for step in range(limit):
        for candidate in {base - step, base + step}:
            if candidate > 0 and candidate not in found and ok(candidate):
                found.append(candidate)
        if len(found) >= k:
            break
    return sorted(found[:k])


def nearest_multiples(value: int, step: int, k: int = 4) -> list[int]:
    """`nearest_satisfying(value, lambda v: v % step == 0, k)` by arithmetic: a search over a 1,024-GPU job's layouts
    meets steps of hundreds, which the outward scan walks one by one."""
    base = value if isinstance(value, int) and value > 0 else 1
    below = [m for m in range(base // step * step, 0, -step)][:k]
    above = [base // step * step + step * i for i in range(1, k + 1)]
    return sorted(sorted(set(below + above), key=lambda m: (abs(m - base), m))[:k])


class _Checker:
    """Collects issues; helpers return whether the rule held so dependent rules can be skipped."""

    def __init__(self, issues: list[ConfigIssue], warnings: list[str]):
        self.issues = issues
        self.warnings = warnings

    def fail(self, field: str, value: Any, rule: str, valid: Sequence[Any] = ()) -> bool:
        self.issues.append(ConfigIssue(field, value, rule, tuple(valid)))
        return False

    def is_int_at_least(self, field: str, value: Any, low: int) -> bool:
        if isinstance(value, int) and not isinstance(value, bool) and value >= low:
            return True
        return self.fail(field, value, f"must be an integer >= {low}")

    def in_range(self, field: str, value: Any, low: float, high: float, *, low_open: bool = False,
                 high_open: bool = False) -> bool:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return self.fail(field, value, "must be a number")
        above = value > low if low_open else value >= low
        below = value < high if high_open else value <= high
        if above and below:
            return True
        left, right = "(" if low_open else "[", ")" if high_open else "]"
        return self.fail(field, value, f"must be in {left}{low:g}, {high:g}{right}")

    def one_of(self, field: str, value: Any, valid: Sequence[str], what: str = "value") -> bool:
        if value in valid:
            return True
        close = difflib.get_close_matches(str(value), list(valid), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        return self.fail(field, value, f"is not a known {what}{hint}", valid)


def validate(
    config: JobConfig, resolved: Resolved, model: ModelShape | None,
    issues: list[ConfigIssue], warnings: list[str],
) -> None:
    """Append every violated rule of `config` to `issues` (and soft concerns to `warnings`)."""
    check = _Checker(issues, warnings)
    world_ok = _check_trainer(check, config)
    world = resolved.world_size if world_ok else 0
    _check_names(check, config)
    _check_numbers(check, config, resolved)
    batch_ok = _check_batch_basics(check, config)


    role_fields = {role: role_megatron_field(config, role) for role in Role}
    teacher = teacher_shape(config, check.issues)  # the teacher's own layout rules read its own shape
    # the teacher's layout spans its own pool when it has one (teacher.mode=disaggregated)
    # (its placement checked whatever the training world's validity: every error at once)
    teacher_pool_ok = check_teacher_placement(config, check.issues)
    teacher_world = (resolved.teacher_world or world) if teacher_pool_ok else 0
    dp_of: dict[str, int] = {}
    for role in active_roles(config, resolved):
        if role == Role.REF and config.actor_rollout_ref.ref.megatron is None:
            if Role.ACTOR in dp_of:
                dp_of[Role.REF] = dp_of[Role.ACTOR]
            continue
        dp = _check_layout(check, role_fields[role], role_megatron(config, role),
                           teacher_world if role == Role.TEACHER else world,
                           teacher if role == Role.TEACHER else model, trainable=role in (Role.ACTOR, Role.CRITIC))
        if dp:
            dp_of[role] = dp
    rollout_world = _check_rollout_placement(check, config, resolved, world)
    infer_dp = _check_rollout_layout(check, config, rollout_world, model, pool=resolved.disaggregated)
    _check_unsupported(check, config, model)
    check_refusals(config, check.issues)  # settings one field decides, as one table (config/refusals.py)
    _check_shared_prefix(check, config, resolved, model)
    _check_moe_dispatch(check, config, model)
    _check_expert_tp_uses(check, config)
    _check_transformer_overrides(check, config, resolved, model)
    _check_optimizer_overrides(check, config, resolved)
    _check_ddp_overrides(check, config)
    _check_lora(check, config, model)
    if model is not None and model.is_moe and resolved.critic_enabled and not config.critic.model.path:
        # A value head on an MoE backbone (router losses, expert-parallel critic) is not built or tested.
        check.fail("critic.model.path", config.critic.model.path,
                   f"is empty, so the critic would be the actor's mixture-of-experts model "
                   f"({model.architecture}), which is not supported as a critic yet: name a dense critic model, "
                   "or use a critic-free estimator (algorithm.adv_estimator=grpo)")
    if batch_ok:
        _check_batch_arithmetic(check, config, resolved, dp_of, infer_dp)
    _check_lengths(check, config, resolved, model)
    _check_algorithm(check, config, resolved)
    check_distillation(config, model, teacher, resolved.critic_enabled, check.issues)


def _check_trainer(check: _Checker, config: JobConfig) -> bool:
    t = config.trainer
    ok = check.is_int_at_least("trainer.nnodes", t.nnodes, 1)
    ok &= check.is_int_at_least("trainer.n_gpus_per_node", t.n_gpus_per_node, 1)
    check.is_int_at_least("trainer.total_epochs", t.total_epochs, 1)
    if t.total_training_steps is not None:
        check.is_int_at_least("trainer.total_training_steps", t.total_training_steps, 1)
    for name in ("save_freq", "test_freq"):
        value = getattr(t, name)
        if not (isinstance(value, int) and (value == -1 or value >= 1)):
            check.fail(f"trainer.{name}", value, "must be -1 (never) or a positive number of steps")
    if t.keep_last_n is not None:
        check.is_int_at_least("trainer.keep_last_n", t.keep_last_n, 1)
    if t.torch_threads_per_rank is not None:
        check.is_int_at_least("trainer.torch_threads_per_rank", t.torch_threads_per_rank, 1)
    check.is_int_at_least("trainer.max_consecutive_nonfinite_steps", t.max_consecutive_nonfinite_steps, 0)
    check.is_int_at_least("trainer.max_restarts", t.max_restarts, 0)
    check.is_int_at_least("trainer.log_val_generations", t.log_val_generations, 0)
    check.in_range("trainer.restart_wait_s", t.restart_wait_s, 0, 7 * 86400, low_open=True)
    check.in_range("trainer.step_timeout_s", t.step_timeout_s, 0, 7 * 86400, low_open=True)
    check.in_range("trainer.gpu_memory_gib", t.gpu_memory_gib, 0, 1e6, low_open=True)
    if t.hardware is not None:
        try:
            load_job_hardware(t.hardware)
        except ConfigError as exc:
            check.issues.extend(exc.issues)
    # a week: anything longer is a unit mistake (minutes or ms), not a wait anyone wants
    check.in_range("trainer.nccl_timeout_s", t.nccl_timeout_s, 0, 7 * 86400, low_open=True)
    if t.resume_mode not in RESUME_MODES and not Path(str(t.resume_mode)).exists():
        check.fail("trainer.resume_mode", t.resume_mode, "must be auto, disable, or an existing checkpoint path",
                   RESUME_MODES)
    return bool(ok)


def _check_names(check: _Checker, config: JobConfig) -> None:
    """Every closed-vocabulary field (typed with a `Literal` in the schema) holds one of its values."""
    for path, literal, values, value in closed_fields(config):
        if value not in values:  # the name of what it holds only for the message (hashing a Literal is slow)
            check.one_of(path, value, values, CHOICE_NAMES.get(literal, "value"))


def _check_numbers(check: _Checker, config: JobConfig, resolved: Resolved) -> None:
    arr, alg = config.actor_rollout_ref, config.algorithm
    actor, rollout = arr.actor, arr.rollout
    for prefix, optim in (("actor_rollout_ref.actor.optim", actor.optim), ("critic.optim", config.critic.optim)):
        if check.in_range(f"{prefix}.lr", optim.lr, 0.0, 1.0, low_open=True, high_open=True):
            check.in_range(f"{prefix}.min_lr", optim.min_lr, 0.0, optim.lr)
        check.in_range(f"{prefix}.weight_decay", optim.weight_decay, 0.0, 1.0)
        check.in_range(f"{prefix}.clip_grad", optim.clip_grad, 0.0, 1e9)
        check.in_range(f"{prefix}.lr_warmup_steps_ratio", optim.lr_warmup_steps_ratio, 0.0, 1.0)
        if not (isinstance(optim.lr_warmup_steps, int) and optim.lr_warmup_steps >= -1):
            check.fail(f"{prefix}.lr_warmup_steps", optim.lr_warmup_steps, "must be -1 (use the ratio) or >= 0")
        if len(optim.betas) != 2 or not all(isinstance(b, float) and 0.0 <= b < 1.0 for b in optim.betas):
            check.fail(f"{prefix}.betas", optim.betas, "must be two numbers in [0, 1)")
        check.in_range(f"{prefix}.eps", optim.eps, 0.0, 1.0, low_open=True)
    a = "actor_rollout_ref.actor"
    check.in_range(f"{a}.clip_ratio", actor.clip_ratio, 0.0, 1.0, low_open=True, high_open=True)
    if actor.clip_ratio_low is not None:
        check.in_range(f"{a}.clip_ratio_low", actor.clip_ratio_low, 0.0, 1.0, low_open=True, high_open=True)
    if actor.clip_ratio_high is not None:
        check.in_range(f"{a}.clip_ratio_high", actor.clip_ratio_high, 0.0, 10.0, low_open=True)
    if actor.clip_ratio_c is not None:
        check.in_range(f"{a}.clip_ratio_c", actor.clip_ratio_c, 1.0, 1e6, low_open=True)
    check.in_range(f"{a}.entropy_coeff", actor.entropy_coeff, 0.0, 1e3)
    check.in_range(f"{a}.kl_loss_coef", actor.kl_loss_coef, 0.0, 1e3)
    check.is_int_at_least(f"{a}.ppo_epochs", actor.ppo_epochs, 1)
    check.in_range("critic.cliprange_value", config.critic.cliprange_value, 0.0, 1e6, low_open=True)
    if config.critic.ppo_epochs is not None:
        check.is_int_at_least("critic.ppo_epochs", config.critic.ppo_epochs, 1)
    check.in_range("algorithm.gamma", alg.gamma, 0.0, 1.0)
    check.in_range("algorithm.lam", alg.lam, 0.0, 1.0)
    check.in_range("algorithm.kl_ctrl.kl_coef", alg.kl_ctrl.kl_coef, 0.0, 1e3)
    if alg.kl_ctrl.type == "adaptive":
        check.in_range("algorithm.kl_ctrl.target_kl", alg.kl_ctrl.target_kl, 0.0, 1e3, low_open=True)
        check.is_int_at_least("algorithm.kl_ctrl.horizon", alg.kl_ctrl.horizon, 1)
    r = "actor_rollout_ref.rollout"
    check.is_int_at_least(f"{r}.n", rollout.n, 1)
    check.in_range(f"{r}.temperature", rollout.temperature, 0.0, 100.0)
    check.in_range(f"{r}.top_p", rollout.top_p, 0.0, 1.0, low_open=True)
    if not (isinstance(rollout.top_k, int) and (rollout.top_k in (-1, 0) or rollout.top_k >= 1)):
        check.fail(f"{r}.top_k", rollout.top_k, "must be -1 (off) or a positive integer")
    check.in_range(f"{r}.gpu_memory_utilization", rollout.gpu_memory_utilization, 0.0, 1.0, low_open=True)
    if rollout.cpu_kv_cache_gib is not None:
        check.in_range(f"{r}.cpu_kv_cache_gib", rollout.cpu_kv_cache_gib, 0.0, 4096.0, low_open=True)
    check.is_int_at_least(f"{r}.update_weights_bucket_megabytes", rollout.update_weights_bucket_megabytes, 1)
    if rollout.probe_tolerance is not None:
        check.in_range(f"{r}.probe_tolerance", rollout.probe_tolerance, 0.0, 100.0, low_open=True)
    check.is_int_at_least(f"{r}.max_num_batched_tokens", rollout.max_num_batched_tokens, 1)
    check.is_int_at_least(f"{r}.max_num_seqs", rollout.max_num_seqs, 1)
    vk = rollout.val_kwargs
    check.is_int_at_least(f"{r}.val_kwargs.n", vk.n, 1)
    check.in_range(f"{r}.val_kwargs.temperature", vk.temperature, 0.0, 100.0)
    check.in_range(f"{r}.val_kwargs.top_p", vk.top_p, 0.0, 1.0, low_open=True)


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
        "moe_ffn_hidden_size", "moe_layer_freq", "moe_router_pre_softmax", "moe_router_score_function"),
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


def _check_megatron_settings(check: _Checker, where: str, settings: dict[str, Any], class_name: str,
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


def _check_optimizer_overrides(check: _Checker, config: JobConfig, resolved: Resolved) -> None:
    """`optim.override_optimizer_config` (verl's key) of each trained role: names and values of megatron's
    OptimizerConfig, none that hybridrl sets, no CUDA-only setting on cpu, and one way of offloading states."""
    set_by = {name: source for source, names in OPTIMIZER_FIELDS_SET_BY.items() for name in names}
    cpu = resolved.device == "cpu"
    for prefix, optim, megatron in (("actor_rollout_ref.actor", config.actor_rollout_ref.actor.optim,
                                     config.actor_rollout_ref.actor.megatron),
                                    ("critic", config.critic.optim, config.critic.megatron)):
        where = f"{prefix}.optim.override_optimizer_config"
        _check_megatron_settings(check, where, optim.override_optimizer_config, "OptimizerConfig",
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


def _check_ddp_overrides(check: _Checker, config: JobConfig) -> None:
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
        _check_megatron_settings(check, where, mc.override_ddp_config, "DistributedDataParallelConfig",
                                 DDP_CONFIG_FIELDS, set_by, {}, "")
        if mc.override_ddp_config.get("overlap_param_gather") is True:
            if not mc.use_distributed_optimizer:
                check.fail(f"{where}.overlap_param_gather", True, f"needs {prefix}.use_distributed_optimizer=true "
                           "(the parameter all-gather is the distributed optimizer's)", [False])
            elif mc.override_ddp_config.get("overlap_grad_reduce") is False:
                check.fail(f"{where}.overlap_param_gather", True, f"needs {where}.overlap_grad_reduce=true "
                           "(Megatron-LM refuses one without the other)", [False])


def _check_transformer_overrides(check: _Checker, config: JobConfig, resolved: Resolved,
                                 model: ModelShape | None) -> None:
    """`override_transformer_config` (verl's key): each name a field of megatron's TransformerConfig that hybridrl
    does not set itself, each value of that field's type, on cpu no CUDA kernel, and activation recompute as
    megatron's TransformerConfig accepts it (the same rules; tests/test_config_megatron_fields.py holds them
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
        _check_megatron_settings(check, where, settings, "TransformerConfig", TRANSFORMER_CONFIG_FIELDS, set_by,
                                 device_settings, "needs CUDA kernels: on trainer.device=cpu the CPU layer runs "
                                                  "without them")
        _check_recompute(check, config, prefix, mc, model)
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


def _check_recompute(check: _Checker, config: JobConfig, prefix: str, mc: MegatronConfig,
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
    model_field, model_section = _model_section(config, prefix)
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


def _model_section(config: JobConfig, megatron_prefix: str) -> tuple[str, Any]:
    """The model section (dotted path, section) whose weights a megatron section lays out."""
    if megatron_prefix.startswith("critic"):
        return "critic.model", config.critic.model
    if megatron_prefix.startswith("reward_model"):
        return "reward_model.model", config.reward_model.model
    if megatron_prefix.startswith("teacher"):
        return "teacher.model", config.teacher.model
    return "actor_rollout_ref.model", config.actor_rollout_ref.model


def _check_context_parallel(check: _Checker, config: JobConfig, prefix: str, mc: MegatronConfig, cp: int,
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
        # unreachable while CP runs on CPU only (no SP there); kept for when the GPU path is wired
        check.fail(field, cp, "with sequence_parallel=true is not implemented yet (the last stage gathers "
                   "hidden states over CP along the sequence, which SP splits over TP); use 1", [1])


def _check_router_replay(check: _Checker, config: JobConfig, model: ModelShape | None) -> None:
    mode = config.actor_rollout_ref.actor.router_replay
    if mode != "rollout":
        return  # "none", or an unknown value (reported by _check_names)
    field = "actor_rollout_ref.actor.router_replay"
    if model is not None and not model.is_moe:
        check.fail(field, mode, f"needs a mixture-of-experts model; {model.architecture} is dense: use none",
                   ["none"])
        return
    # What is built: vLLM's routing per token as the `routed_experts` column (DevicePolicy.vllm_routed_experts),
    # replayed in the actor's forwards (hybridrl/training/router_replay.py). Refused below: what the replay
    # could not do exactly, or what no test has measured yet.
    arr = config.actor_rollout_ref
    mc = arr.actor.megatron
    fail = f"with {field}={mode}: "
    if arr.rollout.multi_turn.enable is True:
        check.fail("actor_rollout_ref.rollout.multi_turn.enable", True,
                   fail + "not available with multi-turn rollouts yet (a conversation's routing would be its "
                   "turns' pieces joined); use a single-turn rollout or router_replay none", [False])
    tp = mc.tensor_model_parallel_size
    if mc.sequence_parallel and isinstance(tp, int) and tp > 1:
        check.fail("actor_rollout_ref.actor.megatron.sequence_parallel", True,
                   fail + "cannot replay under sequence parallelism: each TP rank routes only its chunk of the "
                   "sequence; use tensor_model_parallel_size 1 (an MoE model trains at TP > 1 only with it)",
                   [False])
    cp = mc.context_parallel_size
    if isinstance(cp, int) and cp > 1:
        check.fail("actor_rollout_ref.actor.megatron.context_parallel_size", cp,
                   fail + "cannot replay under context parallelism yet (each CP rank routes only its columns)", [1])
    recompute = arr.actor.megatron.override_transformer_config.get("recompute_granularity")
    for field, value in (("actor_rollout_ref.model.enable_gradient_checkpointing",
                          arr.model.enable_gradient_checkpointing),
                         ("actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity",
                          recompute)):
        if value:
            check.fail(field, value, fail + "cannot replay with activation recompute: the recomputed forward runs in "
                       "the backward, outside the replayed forward, and would route afresh", [False])
    policy = DEVICE_POLICIES.get(config.trainer.device)
    if policy is not None and policy.vllm_honours_enforce_eager and arr.rollout.enforce_eager is not True:
        # the routing is recorded by a hook on vLLM's V1 runner, bound after the engine captured its CUDA
        # graphs: a decode step replayed from a graph would not record (rollout/vllm_patches.py, 5.)
        check.fail("actor_rollout_ref.rollout.enforce_eager", arr.rollout.enforce_eager,
                   fail + f"needs true on {policy.name}: vLLM's routing is recorded by a hook on its model runner, "
                   "which CUDA graphs captured at start-up would bypass", [True])


def _check_lora(check: _Checker, config: JobConfig, model: ModelShape | None) -> None:
    """LoRA adapters on the actor (`hybridrl.models.lora`): verl's settings, and what is not built yet refused."""
    lora = config.actor_rollout_ref.model.lora
    if not check.is_int_at_least(f"{LORA}.rank", lora.rank, 0) or lora.rank == 0:
        return
    check.in_range(f"{LORA}.alpha", lora.alpha, 0.0, float("inf"), low_open=True)
    check.in_range(f"{LORA}.dropout", lora.dropout, 0.0, 1.0, high_open=True)
    valid = list(TARGETS.get(lora.type, {}))
    if valid:
        for field, names in ((f"{LORA}.target_modules", lora.target_modules),
                             (f"{LORA}.exclude_modules", lora.exclude_modules)):
            for name in names:
                if "*" in str(name) or "." in str(name):
                    check.fail(field, name, "per-layer patterns are not supported yet: name whole layer kinds", valid)
                else:
                    check.one_of(field, name, valid, f"{lora.type} target")
        if lora.exclude_modules and lora.target_modules:
            check.fail(f"{LORA}.exclude_modules", lora.exclude_modules,
                       "needs target_modules empty (adapt every layer kind but these), as in verl", [])
        elif not lora.target_modules and set(lora.exclude_modules) >= set(valid):
            check.fail(f"{LORA}.target_modules", lora.target_modules, "adapts nothing: name the layers to adapt",
                       valid)
    if model is not None and model.is_moe:
        check.fail(f"{LORA}.rank", lora.rank, f"adapters on a mixture-of-experts model ({model.architecture}: its "
                   "experts) are not built yet; set 0 to train the whole model", [0])
    if config.trainer.device == "cuda":
        check.fail(f"{LORA}.rank", lora.rank, "adapters on cuda are not built yet: TransformerEngine's layers fuse "
                   "the norm into linear_qkv and linear_fc1, whose adapters need the normed input; set 0", [0])
    ref = config.actor_rollout_ref.ref.megatron
    if ref is not None and ref.param_offload:
        check.fail("actor_rollout_ref.ref.megatron.param_offload", True, f"with {LORA}.rank > 0 the reference is the "
                   "actor's own frozen base with the adapters off: it has no weights of its own to offload", [False])
    if lora.merge is False:
        if isinstance(lora.rank, int) and lora.rank > VLLM_LORA_RANKS[-1]:
            check.fail(f"{LORA}.rank", lora.rank, f"vLLM serves adapters of rank <= {VLLM_LORA_RANKS[-1]}; with a "
                       f"higher rank set {LORA}.merge true (merged syncs)", [VLLM_LORA_RANKS[-1]])


def _check_shared_prefix(check: _Checker, config: JobConfig, resolved: Resolved, model: ModelShape | None) -> None:
    """`model.shared_prefix: true` where a shared prompt's tree cannot be honoured: refused, never ignored."""
    policy = DEVICE_POLICIES.get(config.trainer.device)
    for section, roles in MODEL_SECTIONS.items():
        if getattr(config, section).model.shared_prefix is not True:
            continue
        role = roles[0]
        field = f"{section}.model.shared_prefix"
        cp = role_megatron(config, role).context_parallel_size
        if not resolved.packed(role):
            check.fail(field, True, f"needs packed micro-batches, and {section}.model.use_remove_padding resolves to "
                       "false: a padded row holds its own prompt; set use_remove_padding true or this false", [False])
        elif policy is not None and not policy.shared_prefix_attention:
            check.fail(field, True, f"is served by the CPU layer's attention stand-in only: {policy.name}'s packed "
                       "attention (TransformerEngine's) has no mask for a prompt shared by several responses; "
                       "use false", [False])
        elif isinstance(cp, int) and cp > 1:
            check.fail(field, True, f"with context_parallel_size={cp} is not served: a shared segment is not one "
                       "causal run that CP could cut into 2 x CP chunks; use false, or context_parallel_size 1",
                       [False])
        elif role == Role.ACTOR and model is not None and model.is_moe:
            check.fail(field, True, f"with a mixture-of-experts model ({model.architecture}) is not served: the "
                       "router's load-balancing loss, token counts, expert capacity and routing replay would see a "
                       "shared prompt once instead of once per row; use false", [False])


def _check_unsupported(check: _Checker, config: JobConfig, model: ModelShape | None = None) -> None:
    """Settings the workers would not honour: refused here, so none is silently dropped."""
    arr = config.actor_rollout_ref
    # None for an unknown trainer.device (reported by _check_trainer): the device checks are skipped
    policy = DEVICE_POLICIES.get(config.trainer.device)
    _check_router_replay(check, config, model)
    for prefix, mc in megatron_sections(config):
        tp = mc.tensor_model_parallel_size
        if mc.sequence_parallel and isinstance(tp, int) and tp > 1 and policy is not None \
                and policy.transformer_engine_possible:
            # on CPU the CPU layer's norm stand-in serves it (hybridrl/parallel/cpu/norm.py)
            check.warnings.append(f"{prefix}.sequence_parallel=true needs Transformer Engine on the workers: "
                                  f"{WITHOUT_TE}")
        cp = mc.context_parallel_size
        if isinstance(cp, int) and not isinstance(cp, bool) and cp > 1:
            _check_context_parallel(check, config, prefix, mc, cp, policy)
    if arr.ref.megatron is not None:
        actor = arr.actor.megatron
        for name in REF_SHARES_WITH_ACTOR:
            mine, theirs = getattr(arr.ref.megatron, name), getattr(actor, name)
            if name == "virtual_pipeline_model_parallel_size":  # 1 and null both mean no interleaving
                mine, theirs = mine if mine != 1 else None, theirs if theirs != 1 else None
            # a ref CP > 1 refused above (device, packing) is one mistake, one message
            reported = name == "context_parallel_size" and any(
                i.field == f"actor_rollout_ref.ref.megatron.{name}" for i in check.issues)
            if mine != theirs and not reported:
                check.fail(f"actor_rollout_ref.ref.megatron.{name}", getattr(arr.ref.megatron, name),
                           f"must equal actor_rollout_ref.actor.megatron.{name}={theirs}: the reference policy "
                           "runs in the actor's processes, which hold one megatron parallel state; leave "
                           "actor_rollout_ref.ref.megatron unset to use the actor's layout", [theirs])
    if arr.rollout.multi_turn.enable is True:
        _check_multi_turn(check, config)
    elif arr.rollout.multi_turn.enable is not False:
        check.fail("actor_rollout_ref.rollout.multi_turn.enable", arr.rollout.multi_turn.enable, "must be a boolean",
                   [True, False])
    if policy is not None and not policy.vllm_chunked_prefill:
        budget, lengths = arr.rollout.max_num_batched_tokens, (config.data.max_prompt_length,
                                                               config.data.max_response_length)
        sequence = sum(lengths) if all(type(n) is int for n in lengths) else None  # bad lengths: reported above
        if type(budget) is int and sequence is not None and budget < sequence:
            check.fail("actor_rollout_ref.rollout.max_num_batched_tokens", budget,
                       f"must hold a whole sequence on trainer.device={config.trainer.device}, where vLLM prefills "
                       f"each prompt in one step: at least data.max_prompt_length + data.max_response_length = "
                       f"{sequence}")
    _check_validation_sampling(check, config)


def _check_multi_turn(check: _Checker, config: JobConfig) -> None:
    """`rollout.multi_turn` when enabled: tools that exist, a known parser, limits that are positive."""
    from hybridrl.tools import BUILTIN_TOOLS, available_parsers

    rollout = config.actor_rollout_ref.rollout
    mt, prefix = rollout.multi_turn, "actor_rollout_ref.rollout.multi_turn"
    check.is_int_at_least(f"{prefix}.max_turns", mt.max_turns, 1)
    check.is_int_at_least(f"{prefix}.max_observation_chars", mt.max_observation_chars, 1)
    tools = mt.tools if isinstance(mt.tools, list) else None
    if not tools or not all(isinstance(t, str) and t for t in tools):
        check.fail(f"{prefix}.tools", mt.tools, "must list at least one tool name (the model has nothing to call "
                   f"otherwise): built in {list(BUILTIN_TOOLS)} or defined in tools_file", list(BUILTIN_TOOLS))
    elif len(set(tools)) != len(tools):
        check.fail(f"{prefix}.tools", mt.tools, "names a tool twice")
    else:
        user = [t for t in tools if t not in BUILTIN_TOOLS]
        if mt.tools_file is None and user:
            check.fail(f"{prefix}.tools", mt.tools, f"names {user}, which are not built in; set {prefix}.tools_file "
                       "to the Python file that defines them", list(BUILTIN_TOOLS))
    if mt.tools_file is not None and not Path(str(mt.tools_file)).is_file():
        check.fail(f"{prefix}.tools_file", mt.tools_file, "is not a file (a Python file defining TOOL_SCHEMAS and "
                   "their functions)")
    # a tools file may define the parser (its TOOL_PARSERS): checked when the trainer loads the file,
    # before any worker starts
    if mt.tool_parser not in available_parsers() and mt.tools_file is None:
        check.fail(f"{prefix}.tool_parser", mt.tool_parser, "is not a registered tool-call parser",
                   available_parsers())
    if mt.tool_timeout_s is not None:
        check.in_range(f"{prefix}.tool_timeout_s", mt.tool_timeout_s, 0, 86400, low_open=True)
    if mt.sandbox.isolation == "none" and "python" in (tools or ()):
        check.warnings.append(f"{prefix}.sandbox.isolation=none: the python tool runs model-written code as a plain "
                              "subprocess with limits and a Python audit hook, which is not a boundary against "
                              "hostile code (it can read what the trainer can); use namespaces where the kernel "
                              "allows user namespaces")
    for name in ("wall_time_s", "cpu_time_s", "memory_mb", "max_file_mb", "max_output_bytes"):
        value = getattr(mt.sandbox, name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            check.fail(f"{prefix}.sandbox.{name}", value, "must be a positive number")
    tr = mt.turn_reward
    penalty = tr.tool_error_penalty
    if not isinstance(penalty, (int, float)) or isinstance(penalty, bool) or not math.isfinite(penalty) or penalty < 0:
        check.fail(f"{prefix}.turn_reward.tool_error_penalty", penalty,
                   "must be a finite number >= 0 (it is subtracted per failed tool call)", [0.0, 0.1])
    if tr.path is not None and not Path(str(tr.path)).is_file():
        check.fail(f"{prefix}.turn_reward.path", tr.path, "is not a file (a Python file defining the per-turn "
                   f"reward function {tr.name!r})")
    if not isinstance(tr.name, str) or not tr.name.isidentifier():
        check.fail(f"{prefix}.turn_reward.name", tr.name, "must be a Python function name")


def _check_validation_sampling(check: _Checker, config: JobConfig) -> None:
    """Greedy validation (do_sample false or temperature 0) decodes one sample per prompt, so
    sampling knobs set next to it would be dropped."""
    vk, r = config.actor_rollout_ref.rollout.val_kwargs, "actor_rollout_ref.rollout.val_kwargs"
    if vk.do_sample:
        if vk.temperature == 0:
            check.fail(f"{r}.temperature", vk.temperature,
                       f"must be > 0 when {r}.do_sample=true (temperature 0 decodes greedily)", [0.6, 1.0])
        return
    knobs = (("temperature", vk.temperature, 0.0), ("n", vk.n, 1), ("top_p", vk.top_p, 1.0))
    for name, value, greedy in knobs:
        if value != greedy:
            check.fail(f"{r}.{name}", value, f"has no effect while {r}.do_sample=false (greedy, one sample per "
                       f"prompt): set do_sample=true to sample, or leave it at {greedy:g}", [greedy])
    if vk.top_k not in (-1, 0):
        check.fail(f"{r}.top_k", vk.top_k, f"has no effect while {r}.do_sample=false (greedy): set "
                   "do_sample=true to sample, or leave it at -1", [-1])


def _check_batch_basics(check: _Checker, config: JobConfig) -> bool:
    arr = config.actor_rollout_ref
    fields = [
        ("data.train_batch_size", config.data.train_batch_size),
        ("actor_rollout_ref.actor.ppo_mini_batch_size", arr.actor.ppo_mini_batch_size),
        ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", arr.actor.ppo_micro_batch_size_per_gpu),
        ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", arr.rollout.log_prob_micro_batch_size_per_gpu),
        ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", arr.ref.log_prob_micro_batch_size_per_gpu),
        ("critic.ppo_micro_batch_size_per_gpu", config.critic.ppo_micro_batch_size_per_gpu),
        ("reward_model.micro_batch_size_per_gpu", config.reward_model.micro_batch_size_per_gpu),
        ("teacher.log_prob_micro_batch_size_per_gpu", config.teacher.log_prob_micro_batch_size_per_gpu),
        ("actor_rollout_ref.rollout.n", arr.rollout.n),
    ]
    if config.critic.ppo_mini_batch_size is not None:
        fields.append(("critic.ppo_mini_batch_size", config.critic.ppo_mini_batch_size))
    ok = True
    for field, value in fields:
        if field == "actor_rollout_ref.rollout.n":  # already reported by _check_numbers
            ok &= isinstance(value, int) and value >= 1
        else:
            ok &= check.is_int_at_least(field, value, 1)
    if arr.actor.use_dynamic_bsz:
        ok &= check.is_int_at_least("actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
                                    arr.actor.ppo_max_token_len_per_gpu, 1)
    for section, prefix in ((arr.rollout, "actor_rollout_ref.rollout"), (arr.ref, "actor_rollout_ref.ref"),
                            (config.teacher, "teacher")):
        if section.log_prob_max_token_len_per_gpu is not None:
            ok &= check.is_int_at_least(f"{prefix}.log_prob_max_token_len_per_gpu",
                                        section.log_prob_max_token_len_per_gpu, 1)
    return bool(ok)


def _check_layout(check: _Checker, prefix: str, mc: MegatronConfig, world: int, model: ModelShape | None,
                  trainable: bool = True) -> int:
    """Training layout rules for one role; returns its data-parallel size (0 when invalid)."""
    tp, pp, cp, vpp = (mc.tensor_model_parallel_size, mc.pipeline_model_parallel_size,
                       mc.context_parallel_size, mc.virtual_pipeline_model_parallel_size)
    ok = check.is_int_at_least(f"{prefix}.tensor_model_parallel_size", tp, 1)
    ok &= check.is_int_at_least(f"{prefix}.pipeline_model_parallel_size", pp, 1)
    ok &= check.is_int_at_least(f"{prefix}.context_parallel_size", cp, 1)  # what CP > 1 serves: _check_unsupported
    if vpp is not None:
        if check.is_int_at_least(f"{prefix}.virtual_pipeline_model_parallel_size", vpp, 1) and ok and pp < 2:
            ok = check.fail(f"{prefix}.virtual_pipeline_model_parallel_size", vpp,
                            f"needs pipeline_model_parallel_size > 1 (it is {pp}); use null without PP")
        elif ok and trainable and pp == 2 and vpp > 1:
            # With two stages the previous and next stage are one peer: the interleaved schedule's
            # batched sends/receives to that peer can pair the wrong messages (Megatron-LM refuses it too).
            ok = check.fail(f"{prefix}.virtual_pipeline_model_parallel_size", vpp,
                            "needs pipeline_model_parallel_size > 2 for a trained role (it is 2); use null or PP >= 3",
                            [1])
    sizes_ok = ok
    for name in STAGE_SPLIT_FIELDS:
        value = getattr(mc, name)
        if value is None:
            continue
        if not check.is_int_at_least(f"{prefix}.{name}", value, 1):
            ok = False
        elif sizes_ok and pp < 2:
            ok = check.fail(f"{prefix}.{name}", value,
                            f"needs pipeline_model_parallel_size > 1 (it is {pp}): it sets an uneven split of the "
                            "layers over pipeline stages; use null without PP", [None])
    if not ok:
        return 0
    if trainable and mc.param_offload and not prefix.startswith("actor_rollout_ref."):
        # the colocated actor's parameters are idle while vLLM generates (training/offload.py); the critic's
        # phases follow one another with no idle stretch to pay for the copies
        check.fail(f"{prefix}.param_offload", True,
                   "is supported for the colocated actor and the frozen roles (ref, reward model); for the critic "
                   "use optimizer_offload and grad_offload", [False])
    if mc.sequence_parallel and tp == 1:
        check.warnings.append(f"{prefix}.sequence_parallel=true has no effect with tensor_model_parallel_size=1")
    dp = 0
    if world:
        gpus = f"the {world} GPUs"
        if world % tp:
            check.fail(f"{prefix}.tensor_model_parallel_size", tp, f"must divide {gpus}", divisors(world))
        elif (world // tp) % pp:
            check.fail(f"{prefix}.pipeline_model_parallel_size", pp,
                       f"× tensor_model_parallel_size={tp} must divide {gpus}", divisors(world // tp))
        elif (world // (tp * pp)) % cp:
            check.fail(f"{prefix}.context_parallel_size", cp,
                       f"× tensor_model_parallel_size={tp} × pipeline_model_parallel_size={pp} must divide {gpus} "
                       "(CP × TP × PP × DP = world)", divisors(world // (tp * pp)))
        else:
            dp = world // (tp * pp * cp)
    if model is not None:
        heads, kv = model.num_attention_heads, model.num_kv_heads
        if heads % tp:
            check.fail(f"{prefix}.tensor_model_parallel_size", tp,
                       f"must divide the model's {heads} attention heads", divisors(heads))
        elif kv % tp and tp % kv:
            check.fail(f"{prefix}.tensor_model_parallel_size", tp,
                       f"must divide the model's {kv} KV heads or be a multiple of them (KV heads are "
                       f"replicated when TP > KV heads)",
                       [d for d in divisors(heads) if kv % d == 0 or d % kv == 0])
        elif model.ffn_hidden_size % tp:
            check.fail(f"{prefix}.tensor_model_parallel_size", tp,
                       f"must divide the model's intermediate_size={model.ffn_hidden_size}",
                       [d for d in divisors(heads) if model.ffn_hidden_size % d == 0])
        if model.is_moe and trainable and tp > 1 and not mc.sequence_parallel:
            # megatron-core 0.16.1 MoELayer.forward raises in training with TP > 1 and no SP
            check.fail(f"{prefix}.sequence_parallel", False,
                       f"must be true to train a mixture-of-experts model at tensor_model_parallel_size={tp}: "
                       "megatron's MoE layer refuses TP without sequence parallelism in training", [True])
        if model.is_moe and mc.expert_tensor_parallel_size in (None, tp) and model.moe_ffn_hidden_size % tp:
            check.fail(f"{prefix}.tensor_model_parallel_size", tp,
                       f"must divide the experts' intermediate size {model.moe_ffn_hidden_size} (each expert is "
                       "split over TP like the dense MLP)", [d for d in divisors(heads)
                                                             if model.moe_ffn_hidden_size % d == 0])
        chunks = pp * (vpp or 1)
        uneven = mc.num_layers_in_first_pipeline_stage is not None or mc.num_layers_in_last_pipeline_stage is not None
        if uneven:
            _check_stage_split(check, prefix, mc, model)
        elif model.num_layers % chunks:
            field = "virtual_pipeline_model_parallel_size" if vpp else "pipeline_model_parallel_size"
            value = vpp if vpp else pp
            valid = ([v for v in divisors(model.num_layers // pp) if model.num_layers % (pp * v) == 0]
                     if vpp and model.num_layers % pp == 0 else divisors(model.num_layers))
            check.fail(f"{prefix}.{field}", value,
                       f"(PP×VPP={chunks}) must divide the model's {model.num_layers} layers", valid)
    if not _check_experts(check, prefix, mc, tp, cp, dp, model):
        return 0
    return dp


STAGE_SPLIT_FIELDS = ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage")


def _check_stage_split(check: _Checker, prefix: str, mc: MegatronConfig, model: ModelShape) -> None:
    """An uneven pipeline split (sizes already checked: PP > 1, each set count >= 1) against the model's
    layers, by the layout's own rule (`ParallelLayout.split_errors`, megatron's). The issue names the
    first stage's field when it is set (else the last's), with the values that work given the other."""
    first, last = mc.num_layers_in_first_pipeline_stage, mc.num_layers_in_last_pipeline_stage
    vpp = mc.virtual_pipeline_model_parallel_size

    def errors(f: int | None, la: int | None) -> list[str]:
        return ParallelLayout(pp=mc.pipeline_model_parallel_size, vpp=vpp, first_stage_layers=f,
                              last_stage_layers=la).split_errors(model.num_layers, STAGE_SPLIT_FIELDS)

    found = errors(first, last)
    if not found:
        return
    if first is not None:
        name, value = STAGE_SPLIT_FIELDS[0], first
        valid = [n for n in range(1, model.num_layers) if not errors(n, last)]
    else:
        name, value = STAGE_SPLIT_FIELDS[1], last
        valid = [n for n in range(1, model.num_layers) if not errors(first, n)]
    check.fail(f"{prefix}.{name}", value,
               f"does not split the model's {model.num_layers} layers over pipeline_model_parallel_size="
               f"{mc.pipeline_model_parallel_size} stages: " + "; ".join(found),
               valid if len(valid) <= 16 else nearest(value, valid, 8))


def _check_experts(check: _Checker, prefix: str, mc: MegatronConfig, tp: int, cp: int, dp: int,
                   model: ModelShape | None) -> bool:
    """Expert-parallel rules (MoE models): megatron's expert mesh, EP × expert TP, tiles the DP × CP × TP
    ranks of a pipeline stage (an expert TP other than TP: experts split over fewer ranks than the dense
    layers, e.g. TP 4 × ETP 1 as verl's MoE scripts run, or over DP ranks of the dense layers at TP 1)."""
    ep, etp = mc.expert_model_parallel_size, mc.expert_tensor_parallel_size
    check.in_range(f"{prefix}.moe_aux_loss_coeff", mc.moe_aux_loss_coeff, 0.0, 1e3)
    if mc.moe_z_loss_coeff is not None:
        check.in_range(f"{prefix}.moe_z_loss_coeff", mc.moe_z_loss_coeff, 0.0, 1e3)
    if mc.moe_aux_loss_coeff and mc.moe_router_load_balancing_type == "none":
        check.fail(f"{prefix}.moe_aux_loss_coeff", mc.moe_aux_loss_coeff,
                   "has no effect with moe_router_load_balancing_type=none: set the type to aux_loss or "
                   "seq_aux_loss, or the coefficient to 0", [0.0])
    ok = check.is_int_at_least(f"{prefix}.expert_model_parallel_size", ep, 1)
    field = f"{prefix}.expert_tensor_parallel_size"
    if etp is not None and not check.is_int_at_least(field, etp, 1):
        ok = False
    if not ok:
        return False
    if model is not None and ep > 1 and not model.is_moe:
        return check.fail(f"{prefix}.expert_model_parallel_size", ep,
                          f"needs a mixture-of-experts model; {model.architecture} is dense: use 1", [1])
    if etp is not None and etp != tp:
        if model is not None and not model.is_moe:
            return check.fail(field, etp, f"needs a mixture-of-experts model; {model.architecture} is dense: use null",
                              [None])
        if model is not None and model.moe_ffn_hidden_size % etp:
            ok = check.fail(field, etp, f"must divide the experts' intermediate size {model.moe_ffn_hidden_size} "
                            "(each expert is split over the expert TP ranks like the dense MLP over TP)",
                            [d for d in divisors(model.moe_ffn_hidden_size) if d <= 64])
    if model is not None and model.is_moe and model.num_experts % ep:
        ok = check.fail(f"{prefix}.expert_model_parallel_size", ep,
                        f"must divide the model's {model.num_experts} experts", divisors(model.num_experts))
    # megatron's expert mesh (etp-ep-edp-pp) must tile the same ranks as the dense one: EP x ETP
    # within DP x CP x TP (with ETP = TP: EP dividing DP x CP).
    x = tp if etp is None else etp
    if dp and (dp * cp * tp) % (ep * x):
        valid = divisors(dp * cp * tp // x) if (dp * cp * tp) % x == 0 else []
        ok = check.fail(f"{prefix}.expert_model_parallel_size", ep,
                        f"× expert_tensor_parallel_size={x} must divide DP × CP × TP = {dp}×{cp}×{tp} "
                        f"(megatron's expert mesh tiles a pipeline stage's ranks)", valid)
    return ok


# the MoE dispatch fields of a megatron section and their defaults (each acts on MoE models only)
MOE_DISPATCH_DEFAULTS = {"moe_token_dispatcher_type": "alltoall", "moe_expert_capacity_factor": None,
                         "moe_token_drop_policy": "probs", "moe_pad_expert_input_to_capacity": False}


def _check_moe_dispatch(check: _Checker, config: JobConfig, model: ModelShape | None) -> None:
    """The token dispatcher and the expert capacity of each megatron section (megatron-core 0.16.1's
    rules first, then what the workers can feed them)."""
    for prefix, mc in megatron_sections(config):
        known = (mc.moe_token_dispatcher_type in typing.get_args(MoEDispatcher)
                 and mc.moe_token_drop_policy in typing.get_args(MoEDropPolicy))
        if not known:
            continue  # an unknown name: reported by _check_names
        changed = {name: getattr(mc, name) for name, default in MOE_DISPATCH_DEFAULTS.items()
                   if getattr(mc, name) != default}
        if model is not None and not model.is_moe:
            for name, value in changed.items():
                check.fail(f"{prefix}.{name}", value, f"acts on mixture-of-experts models only; {model.architecture} "
                           "is dense: remove it", [MOE_DISPATCH_DEFAULTS[name]])
            continue
        capacity = mc.moe_expert_capacity_factor
        if capacity is not None:
            # megatron turns a negative factor into "no capacity" without a word: refused here instead
            check.in_range(f"{prefix}.moe_expert_capacity_factor", capacity, 0.0, 1e3, low_open=True)
        else:
            for name in ("moe_token_drop_policy", "moe_pad_expert_input_to_capacity"):
                if name in changed:
                    check.fail(f"{prefix}.{name}", changed[name], f"needs {prefix}.moe_expert_capacity_factor (it "
                               "is null: no expert has a capacity, so no token is dropped or padded); set the factor "
                               "or remove this", [MOE_DISPATCH_DEFAULTS[name]])
        allgather = mc.moe_token_dispatcher_type == "allgather"
        tp, pp = mc.tensor_model_parallel_size, mc.pipeline_model_parallel_size
        ep, etp = mc.expert_model_parallel_size, mc.expert_tensor_parallel_size
        if allgather and isinstance(pp, int) and pp > 1:
            check.fail(f"{prefix}.moe_token_dispatcher_type", "allgather",
                       f"needs pipeline_model_parallel_size=1 (it is {pp}): megatron's allgather dispatcher refuses "
                       "variable_seq_lengths, which pipeline stages need to pass micro-batches of different shapes; "
                       "use alltoall", ["alltoall"])
        if not needs_uniform_micro_batches(mc):
            continue  # (invalid sizes are reported by the layout's own rules)
        # every rank of megatron's expert TP x EP group must bring the same number of tokens (allgather
        # gathers equal shares; drop-and-pad sizes its all-to-all from its own token count)
        field, value = ((f"{prefix}.moe_token_dispatcher_type", "allgather") if allgather
                        else (f"{prefix}.moe_pad_expert_input_to_capacity", True))
        why = (f"{field}={value} with expert_model_parallel_size={ep} × expert TP {etp or tp} spanning DP ranks "
               "needs the same micro-batch shape on every rank of megatron's expert TP × EP group")
        if config.actor_rollout_ref.actor.use_dynamic_bsz:
            check.fail("actor_rollout_ref.actor.use_dynamic_bsz", True,
                       f"{why}; token-budget micro-batches differ in rows between DP ranks: use false, or "
                       "moe_token_dispatcher_type=alltoall without moe_pad_expert_input_to_capacity", [False])
        model_prefix, model_section = _model_section(config, prefix)
        if model_section.use_remove_padding:
            check.fail(f"{model_prefix}.use_remove_padding", True,
                       f"{why}; packed micro-batches differ in length between DP ranks: use false, or "
                       "moe_token_dispatcher_type=alltoall without moe_pad_expert_input_to_capacity", [False])
    mc = config.actor_rollout_ref.actor.megatron
    capacity = mc.moe_expert_capacity_factor
    if capacity is None or (model is not None and not model.is_moe):
        return
    field = "actor_rollout_ref.actor.megatron.moe_expert_capacity_factor"
    if config.actor_rollout_ref.actor.router_replay == "rollout":
        check.fail(field, capacity, "with actor_rollout_ref.actor.router_replay=rollout: the replayed routing would "
                   "still lose the tokens over an expert's capacity, which vLLM (no capacity) kept; use null, or "
                   "router_replay none", [None])
    else:
        check.warnings.append(
            f"{field}={capacity:g}: megatron drops the tokens over an expert's capacity in every trainer forward "
            "(old log-probs, reference, update), vLLM never does, so the trainer's log-probs differ from the "
            "rollout's where tokens drop (rollout/log_prob_abs_diff_*, actor/moe_dropped_token_fraction); the "
            "weight sync's probe runs without capacity")


def _check_expert_tp_uses(check: _Checker, config: JobConfig) -> None:
    """What an actor whose expert TP differs from its TP cannot do yet (not built, or never run)."""
    arr = config.actor_rollout_ref
    mc = arr.actor.megatron
    etp = mc.expert_tensor_parallel_size
    if etp is None or etp == mc.tensor_model_parallel_size:
        return
    field = "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size"
    if arr.actor.router_replay == "rollout":
        check.fail(field, etp, f"other than tensor_model_parallel_size={mc.tensor_model_parallel_size} with "
                   "actor_rollout_ref.actor.router_replay=rollout has not been tested yet; use null, or router_replay "
                   "none", [None])
    if arr.rollout.mode == "disaggregated":
        check.fail(field, etp, f"other than tensor_model_parallel_size={mc.tensor_model_parallel_size} with "
                   "actor_rollout_ref.rollout.mode=disaggregated is not built yet (the cross-pool weight sync places "
                   "experts by EP alone); use null, or mode colocated", [None])


def _check_rollout_placement(check: _Checker, config: JobConfig, resolved: Resolved, world: int) -> int:
    """rollout.mode, its pool and rollout.async_mode; returns the ranks vLLM runs on (0 when invalid)."""
    arr = config.actor_rollout_ref
    rollout = arr.rollout
    r = "actor_rollout_ref.rollout"
    if resolved.disaggregated and arr.actor.megatron.param_offload:
        check.fail("actor_rollout_ref.actor.megatron.param_offload", True,
                   f"frees the actor's GPUs for a colocated vLLM; with {r}.mode=disaggregated vLLM runs on its own "
                   "GPUs and the actor's have nothing to make room for", [False])
    fully_async_fields = {"max_staleness": rollout.max_staleness, "stale_samples": rollout.stale_samples,
                          "partial_rollout": rollout.partial_rollout}
    if rollout.async_mode in ("sync", "one_step_off"):  # an unknown mode: reported by _check_names
        for name, value in fully_async_fields.items():
            if value is not None:
                check.fail(f"{r}.{name}", value, f"applies to {r}.async_mode=fully_async only (it is "
                           f"{rollout.async_mode}); remove it", [])
    elif rollout.max_staleness is not None:
        check.is_int_at_least(f"{r}.max_staleness", rollout.max_staleness, 1)
    if rollout.mode != "disaggregated":
        if rollout.mode != "colocated":
            return 0  # an unknown mode: reported by _check_names
        for name, value, default in (("nnodes", rollout.nnodes, 1), ("n_gpus_per_node", rollout.n_gpus_per_node, None)):
            if value != default:
                check.fail(f"{r}.{name}", value, f"sizes a disaggregated rollout pool; with {r}.mode=colocated vLLM "
                           "runs on the training ranks (trainer.nnodes × trainer.n_gpus_per_node): remove it, or set "
                           "mode=disaggregated", [default])
        if rollout.async_mode in ("one_step_off", "fully_async"):
            check.fail(f"{r}.async_mode", rollout.async_mode, f"needs {r}.mode=disaggregated: colocated, generation "
                       "and training take turns on the same GPUs, so neither can run ahead", ["sync"])
        return world
    ok = check.is_int_at_least(f"{r}.nnodes", rollout.nnodes, 1)
    if rollout.n_gpus_per_node is None:
        ok = check.fail(f"{r}.n_gpus_per_node", None, f"is required with {r}.mode=disaggregated: the rollout "
                        "pool's ranks per machine (vLLM's GPUs, apart from the trainer's)")
    else:
        ok &= check.is_int_at_least(f"{r}.n_gpus_per_node", rollout.n_gpus_per_node, 1)
    if rollout.free_cache_engine is not None:
        check.fail(f"{r}.free_cache_engine", rollout.free_cache_engine, f"applies to {r}.mode=colocated only: a "
                   "disaggregated rollout has its GPUs to itself and never sleeps; remove it", [])
    if rollout.async_mode in ("one_step_off", "fully_async"):
        behind = f"with {r}.async_mode={rollout.async_mode}"
        alg = config.algorithm
        if alg.adv_estimator in GREEDY_BASELINE_ADV_ESTIMATORS:
            check.fail("algorithm.adv_estimator", alg.adv_estimator, f"{behind}: its greedy baseline would be a "
                       "second generation of the step's prompts while the rollout pool runs ahead (not built); use "
                       "grpo, rloo, reinforce_plus_plus or gae, or async_mode=sync", ["grpo", "rloo"])
        if alg.filter_groups.enable:
            check.fail("algorithm.filter_groups.enable", True, f"{behind}: dynamic sampling's extra generation "
                       "rounds are not built for a rollout that runs ahead; use async_mode=sync", [False])
    if rollout.async_mode == "fully_async":
        behind = f"with {r}.async_mode=fully_async"
        if rollout.multi_turn.enable is True:
            check.fail(f"{r}.multi_turn.enable", True, f"{behind}: a conversation paused at a weight sync would "
                       "have to resume mid-turn (not built); use async_mode=one_step_off or sync", [False])
        if arr.actor.router_replay == "rollout":
            check.fail("actor_rollout_ref.actor.router_replay", "rollout", f"{behind}: a partial rollout re-reads "
                       "its prefix under new weights, whose routing would not be the one the tokens were sampled "
                       "with; use async_mode=one_step_off or sync", ["none"])
    return resolved.rollout_world if ok else 0


def _check_rollout_layout(check: _Checker, config: JobConfig, world: int, model: ModelShape | None,
                          pool: bool = False) -> int:
    """vLLM layout rules on its `world` ranks (`pool`: a disaggregated rollout pool's); returns the number
    of rollout replicas (0 when invalid)."""
    field = "actor_rollout_ref.rollout.tensor_model_parallel_size"
    itp = config.actor_rollout_ref.rollout.tensor_model_parallel_size
    if not check.is_int_at_least(field, itp, 1):
        return 0
    ok = True
    if world and world % itp:
        where = "rollout pool's " if pool else ""
        ok = check.fail(field, itp, f"must divide the {where}{world} GPUs", divisors(world))
    if model is not None:
        heads, kv = model.num_attention_heads, model.num_kv_heads
        padded_vocab = vllm_padded_vocab(model.vocab_size)
        if heads % itp:
            ok = check.fail(field, itp, f"must divide the model's {heads} attention heads", divisors(heads))
        elif kv % itp and itp % kv:
            ok = check.fail(field, itp, f"must divide the model's {kv} KV heads or be a multiple of them",
                            [d for d in divisors(heads) if kv % d == 0 or d % kv == 0])
        elif padded_vocab % itp:
            ok = check.fail(field, itp,
                            f"must divide the vocabulary as vLLM pads it ({model.vocab_size} -> {padded_vocab})",
                            [d for d in divisors(heads) if padded_vocab % d == 0])
        elif model.is_moe and model.moe_ffn_hidden_size % itp:
            # vLLM splits each expert's width over its TP ranks (no expert parallelism in vLLM here)
            ok = check.fail(field, itp, f"must divide the experts' intermediate size {model.moe_ffn_hidden_size}: "
                            "vLLM splits each expert over its TP ranks",
                            [d for d in divisors(heads) if model.moe_ffn_hidden_size % d == 0])
    return world // itp if (ok and world) else 0


def _check_batch_arithmetic(
    check: _Checker, config: JobConfig, resolved: Resolved, dp_of: dict[str, int], infer_dp: int,
) -> None:
    arr = config.actor_rollout_ref
    batch, n = config.data.train_batch_size, arr.rollout.n
    batch_refused = bool(infer_dp and batch % infer_dp)  # said once: every pass that splits it would repeat it
    if batch_refused:
        check.fail("data.train_batch_size", batch,
                   f"must split evenly over the {infer_dp} rollout replicas "
                   f"(GPUs ÷ rollout tensor_model_parallel_size)",
                   nearest_multiples(batch, infer_dp))

    def check_updates(prefix: str, mini: int, micro: int, dp: int, mini_field: str) -> None:
        if mini > batch or batch % mini:
            check.fail(mini_field, mini, f"must divide data.train_batch_size={batch} (mini-batches per step)",
                       nearest(mini, divisors(batch)))
            return
        if not dp:
            return
        if (mini * n) % dp:
            check.fail(mini_field, mini,
                       f"× rollout.n={n} sequences must split evenly over the {dp} data-parallel ranks",
                       nearest(mini, [d for d in divisors(batch) if (d * n) % dp == 0]))
            return
        per_rank = mini * n // dp
        if not arr.actor.use_dynamic_bsz and per_rank % micro:
            check.fail(f"{prefix}.ppo_micro_batch_size_per_gpu", micro,
                       f"must divide the {per_rank} sequences per GPU per mini-batch "
                       f"({mini_field.rsplit('.', 1)[-1]}={mini} × n={n} ÷ DP={dp})",
                       nearest(micro, divisors(per_rank)))

    def check_forward(field: str, micro: int, dp: int, pass_name: str) -> None:
        nonlocal batch_refused
        if not dp:
            return
        if (batch * n) % dp:
            if batch_refused:
                return
            batch_refused = True
            check.fail("data.train_batch_size", batch,
                       f"× rollout.n={n} sequences must split evenly over the {dp} data-parallel ranks",
                       nearest_satisfying(batch, lambda b: (b * n) % dp == 0))
            return
        per_rank = batch * n // dp
        if not pass_batching(config, pass_name).dynamic and per_rank % micro:
            check.fail(field, micro,
                       f"must divide the {per_rank} sequences per GPU (train_batch_size={batch} × n={n} ÷ DP={dp})",
                       nearest(micro, divisors(per_rank)))

    actor_dp = dp_of.get(Role.ACTOR, 0)
    check_updates("actor_rollout_ref.actor", arr.actor.ppo_mini_batch_size, arr.actor.ppo_micro_batch_size_per_gpu,
                  actor_dp, "actor_rollout_ref.actor.ppo_mini_batch_size")
    check_forward("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
                  arr.rollout.log_prob_micro_batch_size_per_gpu, actor_dp, "old_log_prob")
    if Role.REF in dp_of:
        check_forward("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
                      arr.ref.log_prob_micro_batch_size_per_gpu, dp_of[Role.REF], "ref_log_prob")
    if Role.CRITIC in dp_of:
        mini_field = ("critic.ppo_mini_batch_size" if config.critic.ppo_mini_batch_size is not None
                      else "actor_rollout_ref.actor.ppo_mini_batch_size")
        check_updates("critic", resolved.critic_mini_batch_size, config.critic.ppo_micro_batch_size_per_gpu,
                      dp_of[Role.CRITIC], mini_field)
        check_forward("critic.ppo_micro_batch_size_per_gpu", config.critic.ppo_micro_batch_size_per_gpu,
                      dp_of[Role.CRITIC], "values")
    if Role.REWARD_MODEL in dp_of:
        check_forward("reward_model.micro_batch_size_per_gpu", config.reward_model.micro_batch_size_per_gpu,
                      dp_of[Role.REWARD_MODEL], "reward_scores")
    if Role.TEACHER in dp_of:
        check_forward("teacher.log_prob_micro_batch_size_per_gpu", config.teacher.log_prob_micro_batch_size_per_gpu,
                      dp_of[Role.TEACHER], "teacher_log_prob")


def _check_lengths(check: _Checker, config: JobConfig, resolved: Resolved, model: ModelShape | None) -> None:
    data, rollout = config.data, config.actor_rollout_ref.rollout
    ok = check.is_int_at_least("data.max_prompt_length", data.max_prompt_length, 1)
    ok &= check.is_int_at_least("data.max_response_length", data.max_response_length, 1)
    if rollout.response_length is not None:
        if check.is_int_at_least("actor_rollout_ref.rollout.response_length", rollout.response_length, 1) and ok \
                and rollout.response_length > data.max_response_length:
            check.fail("actor_rollout_ref.rollout.response_length", rollout.response_length,
                       f"must not exceed data.max_response_length={data.max_response_length}",
                       [data.max_response_length])
    if ok and model is not None and resolved.max_sequence_length > model.max_exact_sequence_length:
        limit = model.max_exact_sequence_length
        # A sliding-window model (Mistral) is only exact up to its window: megatron's layers have none.
        what = (f"max_position_embeddings={limit}" if limit == model.max_position_embeddings
                else f"sliding_window={limit} (longer sequences would differ from the HF model)")
        room = limit - data.max_prompt_length
        turns = (" (with multi-turn rollouts the response holds every model turn and tool answer)"
                 if rollout.multi_turn.enable is True else "")
        check.fail("data.max_response_length", data.max_response_length,
                   f"+ max_prompt_length={data.max_prompt_length} exceeds the model's {what}{turns}",
                   [room] if room > 0 else [])
    actor = config.actor_rollout_ref.actor
    if ok and actor.use_dynamic_bsz and isinstance(actor.ppo_max_token_len_per_gpu, int) \
            and actor.ppo_max_token_len_per_gpu < resolved.max_sequence_length:
        check.fail("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", actor.ppo_max_token_len_per_gpu,
                   f"must hold one full sequence (max_prompt_length + response length = "
                   f"{resolved.max_sequence_length} tokens)", [resolved.max_sequence_length])


def _check_algorithm(check: _Checker, config: JobConfig, resolved: Resolved) -> None:
    estimator, n = config.algorithm.adv_estimator, config.actor_rollout_ref.rollout.n
    if estimator in GROUP_ADV_ESTIMATORS and isinstance(n, int) and n < 2:
        check.fail("actor_rollout_ref.rollout.n", n,
                   f"must be >= 2 for algorithm.adv_estimator={estimator} (it compares samples of one prompt; "
                   "a group of one has advantage 0)", [2, 4, 8, 16])
    if estimator in CRITIC_ADV_ESTIMATORS and config.critic.enable is False:
        check.fail("critic.enable", False, f"must be true (or null) for algorithm.adv_estimator={estimator}",
                   [True])
    ob = config.algorithm.overlong_buffer
    if ob.max_response_length is not None:
        check.is_int_at_least("algorithm.overlong_buffer.max_response_length", ob.max_response_length, 1)
    end = ob.max_response_length or config.data.max_response_length
    end_field = "algorithm.overlong_buffer.max_response_length" if ob.max_response_length else \
        "data.max_response_length"
    if ob.enable and isinstance(ob.len, int) and isinstance(end, int) and not 0 < ob.len <= end:
        check.fail("algorithm.overlong_buffer.len", ob.len, f"must be in (0, {end_field}={end}]")
    if config.algorithm.filter_groups.enable:
        check.is_int_at_least("algorithm.filter_groups.max_num_gen_batches",
                              config.algorithm.filter_groups.max_num_gen_batches, 1)
        if estimator not in GROUP_ADV_ESTIMATORS:
            check.fail("algorithm.filter_groups.enable", True,
                       f"needs a group estimator (grpo, dr_grpo, rloo), not adv_estimator={estimator}")
    _check_rollout_correction(check, config)
    if config.reward_model.enable and not config.reward_model.model.path:
        check.fail("reward_model.model.path", "", "must name a reward model folder when reward_model.enable=true")
    if config.actor_rollout_ref.actor.use_kl_loss and config.algorithm.use_kl_in_reward:
        check.warnings.append("KL is applied twice: both actor.use_kl_loss and algorithm.use_kl_in_reward are on")
    if not config.data.train_files:
        check.warnings.append("data.train_files is empty: `hybridrl train` needs training prompts")


def _check_rollout_correction(check: _Checker, config: JobConfig) -> None:
    """`algorithm.rollout_correction`: the numbers of an active level in range; a knob of a level that
    is off, or `match_truncation` without a correction or a truncation, refused rather than dropped; a
    correction of a top-k/top-p rollout refused unless the target is computed under that truncation."""
    rc, f = config.algorithm.rollout_correction, "algorithm.rollout_correction"
    default = RolloutCorrectionConfig()
    if rc.is_level != "none":
        check.in_range(f"{f}.is_cap", rc.is_cap, 1.0, 1e6)
    elif rc.is_cap != default.is_cap:
        check.fail(f"{f}.is_cap", rc.is_cap, f"has no effect while {f}.is_level=none: set is_level to token or "
                   f"sequence, or leave it at {default.is_cap:g}", [default.is_cap])
    if rc.mask_level != "none":
        check.in_range(f"{f}.mask_low", rc.mask_low, 0.0, 1.0, high_open=True)
        check.in_range(f"{f}.mask_high", rc.mask_high, 1.0, 1e6, low_open=True)
    else:
        for name in ("mask_low", "mask_high"):
            value, fallback = getattr(rc, name), getattr(default, name)
            if value != fallback:
                check.fail(f"{f}.{name}", value, f"has no effect while {f}.mask_level=none: set mask_level to "
                           f"token, sequence or geometric, or leave it at {fallback:g}", [fallback])
    rollout = config.actor_rollout_ref.rollout
    truncated = (isinstance(rollout.top_p, (int, float)) and rollout.top_p < 1.0) or \
        (isinstance(rollout.top_k, int) and rollout.top_k > 0)
    correcting = rc.is_level != "none" or rc.mask_level != "none"
    sampling = f"actor_rollout_ref.rollout.top_p={rollout.top_p}, top_k={rollout.top_k}"
    if rc.match_truncation:
        if not correcting:
            check.fail(f"{f}.match_truncation", True, f"has no effect while {f}.is_level and mask_level are none: "
                       "set one of them, or leave it at false", [False])
        elif not truncated:
            check.fail(f"{f}.match_truncation", True, f"has no effect: the rollout samples without truncation "
                       f"({sampling}), so the trainer's old log-probs already are of vLLM's distribution; "
                       "leave it at false", [False])
    elif correcting and truncated:
        # Refused, not warned: vLLM's log-probs are of the truncated, renormalized distribution and the
        # trainer's of the whole vocabulary, so every ratio sits below 1 by the kept mass; measured at
        # top_k=4 on the demo, the IS weight mean was 0.065 and the mask dropped every token (no learning).
        level = f"{f}.is_level" if rc.is_level != "none" else f"{f}.mask_level"
        check.fail(level, getattr(rc, level.rsplit(".", 1)[1]),
                   f"cannot correct a rollout sampled with {sampling} against the trainer's whole-vocabulary "
                   "log-probs: vLLM's log-probs are of the truncated, renormalized distribution, so every ratio "
                   f"pi_old / rollout sits below 1 by the kept mass; set {f}.match_truncation=true (the target "
                   "computed under the same truncation), sample with top_p=1 and top_k=-1, or set is_level and "
                   "mask_level to none", ["none"])
