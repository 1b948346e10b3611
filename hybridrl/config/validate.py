"""Every rule a job config must satisfy, checked before any process or GPU is spent.

Each rule appends a `ConfigIssue` naming the dotted field, its value, the rule, and the nearest
valid values, and checking goes on: the user sees every problem at once. Rules that depend on a
failed one are skipped, so one mistake yields one message, not a cascade.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

from hybridrl.algorithms.names import CRITIC_ADV_ESTIMATORS, GREEDY_BASELINE_ADV_ESTIMATORS, GROUP_ADV_ESTIMATORS
from hybridrl.config.checker import Checker, divisors, nearest, nearest_multiples, nearest_satisfying
from hybridrl.config.distillation_rules import check_distillation, check_teacher_placement, teacher_shape
from hybridrl.config.errors import ConfigError, ConfigIssue
from hybridrl.config.hardware import load_job_hardware
from hybridrl.config.lora_rules import check_lora
from hybridrl.config.megatron_rules import (
    check_context_parallel,
    check_ddp_overrides,
    check_optimizer_overrides,
    check_transformer_overrides,
    megatron_sections,
)
from hybridrl.config.model_shapes import own_model_shape
from hybridrl.config.moe_rules import check_expert_tp_uses, check_experts, check_moe_dispatch, check_router_replay
from hybridrl.config.refusals import check_refusals
from hybridrl.config.resolve import (
    MODEL_SECTIONS,
    Resolved,
    active_roles,
    pass_batching,
    role_megatron,
    role_megatron_field,
)
from hybridrl.config.rollout_rules import (
    check_multi_turn,
    check_rollout_layout,
    check_rollout_placement,
    check_stop_tokens,
    check_validation_sampling,
)
from hybridrl.config.schema import (
    CHOICE_NAMES,
    CUSTOM_REWARD_NAME,
    REF_SHARES_WITH_ACTOR,
    SEED_RANGE,
    JobConfig,
    MegatronConfig,
    RolloutCorrectionConfig,
    closed_fields,
)
from hybridrl.config.verl_keys import RESUME_PATH_POINTER
from hybridrl.models.arch import ModelShape
from hybridrl.models.layout import ParallelLayout
from hybridrl.names import Role
from hybridrl.parallel.device import usable_cores
from hybridrl.parallel.device_policy import DEVICE_POLICIES
from hybridrl.persistence import nearest_existing, write_problem
from hybridrl.rewards.registry import AUTO

RESUME_MODES = ("auto", "disable")
REWARD_WORKERS_MAX = 1024  # algorithm.custom_reward_function.num_workers
VERL_RESUME_PATH = "resume_path"  # verl's resume_mode for its resume_from_path


def validate(
    config: JobConfig, resolved: Resolved, model: ModelShape | None,
    issues: list[ConfigIssue], warnings: list[str],
) -> None:
    """Append every violated rule of `config` to `issues` (and soft concerns to `warnings`)."""
    check = Checker(issues, warnings)
    world_ok = _check_trainer(check, config)
    world = resolved.world_size if world_ok else 0
    _check_names(check, config)
    _check_numbers(check, config, resolved)
    batch_ok = _check_batch_basics(check, config)


    role_fields = {role: role_megatron_field(config, role) for role in Role}
    teacher = teacher_shape(config, check.issues)  # the teacher's own layout rules read its own shape
    roles = active_roles(config, resolved)
    # a value model's own folder (critic, reward model): its layout rules read its shape; one hybridrl cannot build
    # is refused here, naming the role's field (the plan would otherwise size the actor's model in its place)
    own_shapes: dict[Role, ModelShape | None] = {
        role: own_model_shape(config, role, check.issues) for role in (Role.CRITIC, Role.REWARD_MODEL) if role in roles}
    # the teacher's layout spans its own pool when it has one (teacher.mode=disaggregated)
    # (its placement checked whatever the training world's validity: every error at once)
    teacher_pool_ok = check_teacher_placement(config, check.issues)
    teacher_world = (resolved.teacher_world or world) if teacher_pool_ok else 0
    dp_of: dict[str, int] = {}
    for role in roles:
        if role == Role.REF and config.actor_rollout_ref.ref.megatron is None:
            if Role.ACTOR in dp_of:
                dp_of[Role.REF] = dp_of[Role.ACTOR]
            continue
        dp = _check_layout(check, role_fields[Role(role)], role_megatron(config, role),
                           teacher_world if role == Role.TEACHER else world,
                           teacher if role == Role.TEACHER else own_shapes.get(role) or model,
                           trainable=role in (Role.ACTOR, Role.CRITIC))
        if dp:
            dp_of[role] = dp
    rollout_world = check_rollout_placement(check, config, resolved, world)
    infer_dp = check_rollout_layout(check, config, rollout_world, model, pool=resolved.disaggregated)
    check_stop_tokens(check, config, model)
    _check_unsupported(check, config, model)
    check_refusals(config, check.issues)  # settings one field decides, as one table (config/refusals.py)
    _check_shared_prefix(check, config, resolved, model)
    check_moe_dispatch(check, config, model)
    check_expert_tp_uses(check, config)
    check_transformer_overrides(check, config, resolved, model)
    check_optimizer_overrides(check, config, resolved)
    check_ddp_overrides(check, config)
    check_lora(check, config, model)
    if model is not None and model.is_moe and resolved.critic_enabled and not config.critic.model.path:
        # A value head on an MoE backbone (router losses, expert-parallel critic) is not built or tested.
        check.fail("critic.model.path", config.critic.model.path,
                   f"is empty, so the critic would be the actor's mixture-of-experts model "
                   f"({model.architecture}), which is not supported as a critic yet: name a dense critic model, "
                   "or use a critic-free estimator (algorithm.adv_estimator=grpo)")
    if batch_ok:
        _check_batch_arithmetic(check, config, resolved, dp_of, infer_dp)
    _check_lengths(check, config, resolved, model)
    if model is not None and model.attention_dropout:
        check.warnings.append(
            f"the model's config.json has attention_dropout={model.attention_dropout:g}: hybridrl trains without "
            "dropout (every forward, the update's too, is the deterministic model vLLM samples from), where "
            "transformers' train mode would drop attention probabilities")
    _check_algorithm(check, config, resolved)
    check_distillation(config, model, teacher, resolved.critic_enabled, check.issues)


def _check_trainer(check: Checker, config: JobConfig) -> bool:
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
    if not config.data.val_files:  # validation reads data.val_files alone: without it these would do nothing
        if isinstance(t.test_freq, int) and t.test_freq >= 1:
            check.fail("trainer.test_freq", t.test_freq, "validates on data.val_files, which is empty: set "
                       "data.val_files, or test_freq=-1", [-1])
        if t.val_before_train is True:
            check.fail("trainer.val_before_train", True, "validates on data.val_files, which is empty: set "
                       "data.val_files, or val_before_train=false", [False])
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
    if t.resume_mode == VERL_RESUME_PATH and not Path(VERL_RESUME_PATH).exists():
        check.fail("trainer.resume_mode", t.resume_mode, f"is verl's mode that resumes from its "
                   f"trainer.resume_from_path; {RESUME_PATH_POINTER}", RESUME_MODES)
    elif t.resume_mode not in RESUME_MODES and not Path(str(t.resume_mode)).exists():
        check.fail("trainer.resume_mode", t.resume_mode, "must be auto, disable, or an existing checkpoint path",
                   RESUME_MODES)
    _check_output_folders(check, config)
    return bool(ok)


def _check_output_folders(check: Checker, config: JobConfig) -> None:
    """The folders `train` creates and writes into: refused when one, or a folder above it, exists as a file, or
    when the folder it would be made in (or the folder itself) may not be written: a read-only file system, another
    user's folder (train would fail at its first write: the first checkpoint, the first step's rollout dump, or at
    start, after Ray and the workers). The checkpoint root only when the run saves (a run with save_freq=-1 may resume
    from checkpoints it may only read)."""
    t = config.trainer
    if not all(isinstance(name, str) for name in (t.project_name, t.experiment_name, t.default_local_dir)) \
            or not isinstance(t.run_dir, (str, type(None))):
        return  # the schema's refusal
    saves = not isinstance(t.save_freq, int) or t.save_freq > 0
    outputs = [("trainer.default_local_dir", t.default_local_dir, t.checkpoint_root, "checkpoints", saves),
               ("trainer.run_dir", t.run_dir, t.run_folder, "logs, metrics and failure.log", True)]
    if t.rollout_data_dir:
        outputs.append(("trainer.rollout_data_dir", t.rollout_data_dir, Path(str(t.rollout_data_dir)),
                        "each step's rollout samples", True))
    for field, value, folder, what, written in outputs:
        path = nearest_existing(folder)  # a folder to create the rest in, or a file in the way
        if not os.path.isdir(path):
            where = ("is a file" if path == Path(os.path.abspath(folder))
                     else f"needs the folder {folder}, but {path} is a file")
            check.fail(field, value, f"{where}, not a folder: train writes {what} there (and would fail at its "
                                     "first write); name a folder, or remove the file")
        elif written and (problem := write_problem(path)):
            check.fail(field, value, f"cannot be written: {problem}; train writes {what} there (and would fail at "
                                     "its first write); name a folder this user may write in")


def _check_names(check: Checker, config: JobConfig) -> None:
    """Every closed-vocabulary field (typed with a `Literal` in the schema) holds one of its values."""
    for path, literal, values, value in closed_fields(config):
        if value not in values:  # the name of what it holds only for the message (hashing a Literal is slow)
            check.one_of(path, value, values, CHOICE_NAMES.get(literal, "value"))


def _check_reward_choice(check: Checker, config: JobConfig) -> None:
    """One scorer: a custom reward function scores every row, so a scorer named in algorithm.reward_fn beside it would
    be ignored; a function name without its file names nothing."""
    custom, reward_fn = config.algorithm.custom_reward_function, config.algorithm.reward_fn
    if custom.path and reward_fn != AUTO:
        check.fail("algorithm.reward_fn", reward_fn, f"names a scorer while algorithm.custom_reward_function.path="
                   f"{custom.path} scores every row: keep one (reward_fn={AUTO} beside a custom function)", [AUTO])
    if not custom.path and custom.name != CUSTOM_REWARD_NAME:
        check.fail("algorithm.custom_reward_function.name", custom.name, "names a function, but "
                   "algorithm.custom_reward_function.path (the file defining it) is unset: set the path, or leave "
                   f"the name at {CUSTOM_REWARD_NAME}", [CUSTOM_REWARD_NAME])
    if custom.timeout_s is not None:  # a week: longer is no deadline (null is none)
        check.in_range("algorithm.custom_reward_function.timeout_s", custom.timeout_s, 0.0, 7 * 86400.0,
                       low_open=True)
    _check_reward_workers(check, custom.num_workers, custom.timeout_s)
    if custom.fallback_score is not None and not (isinstance(custom.fallback_score, (int, float))
                                                  and math.isfinite(custom.fallback_score)):
        check.fail("algorithm.custom_reward_function.fallback_score", custom.fallback_score,
                   "must be a finite number (the score a failed or timed-out sample gets), or null to stop the run")
    if not custom.path and custom.reward_kwargs:
        check.fail("algorithm.custom_reward_function.reward_kwargs", custom.reward_kwargs, "are keyword arguments of "
                   "a custom reward function, but algorithm.custom_reward_function.path (the file defining it) is "
                   "unset: set the path, or remove them (the rule scorers take none)")


def _check_reward_workers(check: Checker, workers: object, timeout_s: object) -> None:
    """algorithm.custom_reward_function.num_workers: the reward processes that score a batch's calls at once. At most
    REWARD_WORKERS_MAX (the trainer holds a pipe to each: a default open-file limit of 1024 would fail before);
    above the cores of this machine a warning (a CPU-bound function's calls then share cores, each slower towards its
    deadline); more than one needs the deadline's processes (timeout_s null calls in the trainer's process)."""
    field = "algorithm.custom_reward_function.num_workers"
    if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= REWARD_WORKERS_MAX:
        check.fail(field, workers, f"must be an integer in [1, {REWARD_WORKERS_MAX}]: the reward processes that "
                   "score a batch's calls at once (1: one after another; the trainer holds a pipe to each)",
                   sorted({1, min(usable_cores(), REWARD_WORKERS_MAX)}))
    elif workers > 1 and timeout_s is None:
        check.fail(field, workers, "runs the reward calls in processes of their own, each under "
                   "algorithm.custom_reward_function.timeout_s, but timeout_s=null calls them in the trainer's "
                   "process, one after another: set timeout_s (verl's reward_manager=prime gives each call 300 s), or "
                   "num_workers=1", [1])
    elif workers > (cores := usable_cores()):
        check.warnings.append(
            f"{field}={workers} is more reward processes than the {cores} cores this machine gives the trainer: a "
            "CPU-bound reward function's calls share them, each slower towards timeout_s (more processes than "
            "cores help a function that waits: on a sandbox service, a judge)")


def _check_seeds(check: Checker, config: JobConfig) -> None:
    """Every seed in [0, 2**31): numpy's generators (which megatron's and vLLM's seeding reach) take [0, 2**32), and
    hybridrl derives per-request and per-layer seeds from them (`schema.SEED_RANGE`)."""
    arr = config.actor_rollout_ref
    seeds = {"trainer.seed": config.trainer.seed, "actor_rollout_ref.rollout.seed": arr.rollout.seed}
    for role in Role:
        megatron = role_megatron(config, role)
        if megatron is not None:
            seeds[f"{role_megatron_field(config, role)}.seed"] = megatron.seed
    for field, seed in seeds.items():
        if isinstance(seed, int) and not isinstance(seed, bool) and not 0 <= seed < SEED_RANGE:
            check.fail(field, seed, "must be in [0, 2**31) (numpy, megatron and vLLM are seeded with it)")


def _check_numbers(check: Checker, config: JobConfig, resolved: Resolved) -> None:
    _check_seeds(check, config)
    arr, alg = config.actor_rollout_ref, config.algorithm
    actor, rollout = arr.actor, arr.rollout
    for prefix, optim in (("actor_rollout_ref.actor.optim", actor.optim), ("critic.optim", config.critic.optim)):
        if check.in_range(f"{prefix}.lr", optim.lr, 0.0, 1.0, low_open=True, high_open=True):
            check.in_range(f"{prefix}.min_lr", optim.min_lr, 0.0, optim.lr)
        check.in_range(f"{prefix}.weight_decay", optim.weight_decay, 0.0, 1.0)
        check.in_range(f"{prefix}.clip_grad", optim.clip_grad, 0.0, 1e9)
        check.in_range(f"{prefix}.lr_warmup_steps_ratio", optim.lr_warmup_steps_ratio, 0.0, 1.0)
        if isinstance(optim.lr, float) and optim.lr > 0:
            check.in_range(f"{prefix}.lr_warmup_init", optim.lr_warmup_init, 0.0, optim.lr)
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


def _check_shared_prefix(check: Checker, config: JobConfig, resolved: Resolved, model: ModelShape | None) -> None:
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


def _check_unsupported(check: Checker, config: JobConfig, model: ModelShape | None = None) -> None:
    """Settings the workers would not honour: refused here, so none is silently dropped."""
    arr = config.actor_rollout_ref
    # None for an unknown trainer.device (reported by _check_trainer): the device checks are skipped
    policy = DEVICE_POLICIES.get(config.trainer.device)
    check_router_replay(check, config, model)
    for prefix, mc in megatron_sections(config):
        cp = mc.context_parallel_size
        if isinstance(cp, int) and not isinstance(cp, bool) and cp > 1:
            check_context_parallel(check, config, prefix, mc, cp, policy)
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
    multi_turn = arr.rollout.multi_turn
    if multi_turn.enable is True:
        check_multi_turn(check, config)
    elif multi_turn.enable is not False:
        check.fail("actor_rollout_ref.rollout.multi_turn.enable", multi_turn.enable, "must be a boolean",
                   [True, False])
    else:  # tools offered to a rollout that never runs them: the user's setting would do nothing
        for name in ("tools", "tools_file"):
            if getattr(multi_turn, name):
                check.fail(f"actor_rollout_ref.rollout.multi_turn.{name}", getattr(multi_turn, name),
                           "offers tools while actor_rollout_ref.rollout.multi_turn.enable=false, so no rollout "
                           "would call them: set multi_turn.enable=true, or remove it")
    _check_reward_choice(check, config)
    if policy is not None and not policy.vllm_chunked_prefill:
        budget, lengths = arr.rollout.max_num_batched_tokens, (config.data.max_prompt_length,
                                                               config.data.max_response_length)
        sequence = sum(lengths) if all(type(n) is int for n in lengths) else None  # bad lengths: reported above
        if type(budget) is int and sequence is not None and budget < sequence:
            check.fail("actor_rollout_ref.rollout.max_num_batched_tokens", budget,
                       f"must hold a whole sequence on trainer.device={config.trainer.device}, where vLLM prefills "
                       f"each prompt in one step: at least data.max_prompt_length + data.max_response_length = "
                       f"{sequence}")
    check_validation_sampling(check, config)


def _check_batch_basics(check: Checker, config: JobConfig) -> bool:
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


def _check_layout(check: Checker, prefix: str, mc: MegatronConfig, world: int, model: ModelShape | None,
                  trainable: bool = True) -> int:
    """Training layout rules for one role; returns its data-parallel size (0 when invalid)."""
    if not _check_parallel_sizes(check, prefix, mc, trainable):
        return 0
    _check_role_savers(check, prefix, mc, trainable)
    dp = _data_parallel_size(check, prefix, mc, world) if world else 0
    if model is not None:
        _check_model_splits(check, prefix, mc, model, trainable)
    if not check_experts(check, prefix, mc, mc.tensor_model_parallel_size, mc.context_parallel_size, dp, model):
        return 0
    return dp


def _check_parallel_sizes(check: Checker, prefix: str, mc: MegatronConfig, trainable: bool) -> bool:
    """TP, PP, CP and VPP are whole numbers >= 1, and VPP and an uneven stage split only with a pipeline."""
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
    return ok


def _check_role_savers(check: Checker, prefix: str, mc: MegatronConfig, trainable: bool) -> None:
    """param_offload where a role has an idle stretch to pay for it; sequence parallelism where TP splits."""
    if trainable and mc.param_offload and not prefix.startswith("actor_rollout_ref."):
        # the colocated actor's parameters are idle while vLLM generates (training/offload.py); the critic's
        # phases follow one another with no idle stretch to pay for the copies
        check.fail(f"{prefix}.param_offload", True,
                   "is supported for the colocated actor and the frozen roles (ref, reward model); for the critic "
                   "use optimizer_offload and grad_offload", [False])
    if mc.sequence_parallel and mc.tensor_model_parallel_size == 1:
        check.warnings.append(f"{prefix}.sequence_parallel=true has no effect with tensor_model_parallel_size=1")


def _data_parallel_size(check: Checker, prefix: str, mc: MegatronConfig, world: int) -> int:
    """world / (TP x PP x CP), or 0 with the first of them that does not divide what is left of the world."""
    tp, pp, cp = mc.tensor_model_parallel_size, mc.pipeline_model_parallel_size, mc.context_parallel_size
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
        return world // (tp * pp * cp)
    return 0


def _check_model_splits(check: Checker, prefix: str, mc: MegatronConfig, model: ModelShape, trainable: bool) -> None:
    """TP divides the model's heads, KV heads and FFN (an MoE model's experts' too, with sequence parallelism to
    train); PP x VPP divides its layers (or the uneven split adds up)."""
    tp, pp = mc.tensor_model_parallel_size, mc.pipeline_model_parallel_size
    vpp = mc.virtual_pipeline_model_parallel_size
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


STAGE_SPLIT_FIELDS = ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage")


def _check_stage_split(check: Checker, prefix: str, mc: MegatronConfig, model: ModelShape) -> None:
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


def _check_batch_arithmetic(
    check: Checker, config: JobConfig, resolved: Resolved, dp_of: dict[str, int], infer_dp: int,
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


def _check_lengths(check: Checker, config: JobConfig, resolved: Resolved, model: ModelShape | None) -> None:
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
        # A sliding-window model (Mistral; Qwen with use_sliding_window) is only exact up to its window: megatron's
        # layers have none.
        if limit == model.max_position_embeddings:
            what = f"max_position_embeddings={limit}"
        elif limit == model.sliding_window:
            what = (f"sliding_window={limit} (vLLM attends within this window and megatron's layers have none: "
                    "longer sequences would differ)")
        else:
            what = (f"YaRN table of {limit} positions (original_max_position_embeddings="
                    f"{model.rope_yarn_original_max_position_embeddings} x factor {model.rope_yarn_factor:g}: vLLM "
                    "0.32 holds cos and sin up to there)")
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


def _check_algorithm(check: Checker, config: JobConfig, resolved: Resolved) -> None:
    estimator, n = config.algorithm.adv_estimator, config.actor_rollout_ref.rollout.n
    if estimator in GROUP_ADV_ESTIMATORS and isinstance(n, int) and n < 2:
        check.fail("actor_rollout_ref.rollout.n", n,
                   f"must be >= 2 for algorithm.adv_estimator={estimator} (it compares samples of one prompt; "
                   "a group of one has advantage 0)", [2, 4, 8, 16])
    rollout, distill = config.actor_rollout_ref.rollout, config.algorithm.distillation
    trains_the_reward = not (distill.enable is True and distill.task_reward is False)
    if estimator in (*GROUP_ADV_ESTIMATORS, *GREEDY_BASELINE_ADV_ESTIMATORS) and trains_the_reward:
        # greedy sampling: the n samples of a prompt are its one greedy answer (remax: its greedy baseline too)
        same_as = ("what the prompt's greedy baseline scores" if estimator in GREEDY_BASELINE_ADV_ESTIMATORS
                   else "what the other samples of its prompt score")
        greedy_settings = (("temperature", rollout.temperature, 0, 1.0), ("top_k", rollout.top_k, 1, -1))
        for field, value, greedy, valid in greedy_settings:
            if value == greedy and not isinstance(value, bool):
                check.fail(f"actor_rollout_ref.rollout.{field}", value,
                           f"decodes greedily: every sample of a prompt is the same answer, so with "
                           f"algorithm.adv_estimator={estimator} each scores {same_as}: every advantage is 0 "
                           "and nothing trains; sample (temperature > 0, top_k -1 or > 1)", [valid])
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
        rounds = config.algorithm.filter_groups.max_num_gen_batches
        if isinstance(rounds, int) and not isinstance(rounds, bool) and rounds <= 0:
            # verl's default (0: no upper limit) generates until the batch is full, forever where the reward gives
            # most prompts' samples one score: hybridrl bounds the rounds and fills with zero-spread groups after them
            check.fail("algorithm.filter_groups.max_num_gen_batches", rounds,
                       "is verl's 'no upper limit', which hybridrl does not offer (a reward that scores most groups "
                       "alike would generate forever); give the generation rounds a step may take, an integer >= 1 "
                       "(hybridrl's default 4; after them groups without spread fill the batch, their advantage 0)")
        else:
            check.is_int_at_least("algorithm.filter_groups.max_num_gen_batches", rounds, 1)
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


def _check_rollout_correction(check: Checker, config: JobConfig) -> None:
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
