"""The Plan: every number derived from a job config, computed once, checked, immutable.

`build_plan(config)` validates the whole config (all errors at once, see `validate.py`) and returns
a frozen `Plan`: meshes, batch arithmetic per role, memory estimates, the resharding plan. Workers
and the controller read sizes from the Plan and never re-derive them, and the user's `JobConfig`
is never mutated (resolved defaults such as clip_ratio_low live in `Plan.resolved`).
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import json
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridrl.config.checker import Checker
from hybridrl.config.errors import ConfigError, ConfigIssue
from hybridrl.config.estimates import (
    GIB,
    CrossPoolTraffic,
    GpuMemoryPlan,
    ReshardTraffic,
    RoleOnGpu,
    RolloutMemory,
    StageBalance,
    TrainingMemory,
    cross_pool_traffic,
    forward_flops,
    gpu_memory_plan,
    kv_cache_bytes_needed,
    nccl_communicators,
    reshard_traffic,
    rollout_memory,
    shares_text,
    split_text,
    stage_balance,
    training_memory,
)
from hybridrl.config.inputs import LAYOUT_ONLY_HINT, check_inputs, resolve_hub_ids
from hybridrl.config.loader import CONFIG_FILE, config_from_dict, config_to_dict, load_config_collecting
from hybridrl.config.megatron_rules import MEGATRON_SPLIT_FLAGS, megatron_sections
from hybridrl.config.megatron_verdict import megatron_refusal, role_transformer_settings
from hybridrl.config.meshes import (
    ReshardGroups,
    TrainingMesh,
    build_pool_groups,
    build_reshard_groups,
    build_training_mesh,
)
from hybridrl.config.model_shapes import load_model_shape, role_model_shape
from hybridrl.config.resolve import (
    Resolved,
    active_roles,
    model_section_of,
    pass_batching,
    resolve,
    role_megatron,
    role_megatron_field,
)
from hybridrl.config.resume import ResumePoint, schedule_notes
from hybridrl.config.rollout_rules import check_rollout_head_dim
from hybridrl.config.schema import JobConfig, LoraConfig, MegatronConfig
from hybridrl.config.validate import validate
from hybridrl.config.verl_defaults import VerlDefaults
from hybridrl.models.arch import ModelShape
from hybridrl.models.lora_targets import adapter_elements_per_layer
from hybridrl.names import Phase, Role
from hybridrl.parallel.device_policy import DevicePolicy
from hybridrl.parallel.speed_settings import SpeedSetting, speed_settings


@dataclass(frozen=True)
class UpdatePlan:
    """Batch arithmetic of one role's optimizer updates within a training step."""

    role: str
    mini_batch_prompts: int
    mini_batch_sequences: int
    mini_batches_per_step: int
    sequences_per_rank_per_mini_batch: int
    micro_batch_size: int
    grad_accum_steps: int            # micro-batches per rank per mini-batch; 0 with dynamic batching
    ppo_epochs: int
    optimizer_steps_per_step: int
    dynamic_batching: bool


@dataclass(frozen=True)
class ForwardPlan:
    """Batch arithmetic of one forward-only pass (old log-probs, ref log-probs, values, rewards)."""

    role: str
    pass_name: str
    sequences_per_rank: int
    micro_batch_size: int
    micro_batches_per_rank: int       # with dynamic batching: the count if every sequence were full length
    dynamic_batching: bool = False    # micro-batches by token count (`config.resolve.pass_batching`)
    max_tokens_per_micro_batch: int = 0


@dataclass(frozen=True)
class TokenBudget:
    """What bounds one sequence's tokens. The response is everything after the prompt: with multi-turn
    rollouts (`rollout.multi_turn`) that is the whole conversation, the model's turns and the tool
    observations between them, so `sequence_tokens` (prompt + every turn) is what the model's length,
    the KV cache, every training pass and the memory estimates cover. Observation tokens are computed in
    every pass like the model's own and carry `response_mask` 0 (no loss, KL or entropy)."""

    prompt_tokens: int            # data.max_prompt_length
    response_tokens: int          # rollout.response_length, else data.max_response_length
    sequence_tokens: int          # prompt_tokens + response_tokens
    multi_turn: bool
    max_turns: int                # model turns per sample (1 without multi-turn; max_turns null: response_tokens)
    max_tool_rounds: int          # tool answers a sample can read: max_turns - 1 (the last turn's calls are not run)
    max_model_tokens: int         # the whole response (a sample that calls no tool)
    max_observation_tokens: int   # response_tokens - 1 (a model turn writes >= 1 token); 0 without tool rounds
    max_observation_chars: int    # one tool answer is cut to this many characters (0 without multi-turn)


def token_budget(config: JobConfig, resolved: Resolved) -> TokenBudget:
    """The `TokenBudget` of a validated config."""
    multi_turn = config.actor_rollout_ref.rollout.multi_turn
    response = resolved.response_length
    # max_turns null: no limit but the response budget, and a model turn writes >= 1 token
    turns = (multi_turn.max_turns if multi_turn.max_turns is not None else response) if multi_turn.enable else 1
    rounds = turns - 1
    return TokenBudget(
        prompt_tokens=config.data.max_prompt_length, response_tokens=response,
        sequence_tokens=resolved.max_sequence_length, multi_turn=bool(multi_turn.enable), max_turns=turns,
        max_tool_rounds=rounds, max_model_tokens=response, max_observation_tokens=response - 1 if rounds else 0,
        max_observation_chars=multi_turn.max_observation_chars if multi_turn.enable else 0)


@dataclass(frozen=True)
class RoleLayout:
    role: str
    megatron: MegatronConfig
    mesh: TrainingMesh


@dataclass(frozen=True)
class ReshardPlan:
    # colocated: the HybridFlow groups over the training ranks; disaggregated: the rollout pool's replicas
    # (ranks numbered within the pool, strategy "cross_pool")
    groups: ReshardGroups
    traffic: ReshardTraffic | None  # colocated
    dtype: str
    cross_pool: CrossPoolTraffic | None = None  # disaggregated


TRAINED_ROLES = (Role.ACTOR, Role.CRITIC)  # the roles with gradients, an optimizer and megatron's DDP


@dataclass(frozen=True)
class Plan:
    config: JobConfig
    resolved: Resolved
    # every cuda/cpu difference of the run, for `resolved.device` (code reads its fields, never the name)
    device_policy: DevicePolicy
    model: ModelShape | None
    layouts: tuple[RoleLayout, ...]
    prompts_per_step: int
    sequences_per_step: int
    prompts_per_rollout_replica: int
    sequences_per_rollout_replica: int
    updates: tuple[UpdatePlan, ...]
    forwards: tuple[ForwardPlan, ...]
    reshard: ReshardPlan
    training_memory: tuple[TrainingMemory, ...]
    rollout_memory: RolloutMemory | None
    # every phase of a step on one training GPU, every colocated role counted (`estimates.gpu_memory_plan`)
    gpu_memory: GpuMemoryPlan | None
    # one GPU of the teacher's own pool (teacher.mode=disaggregated; None: colocated, counted in gpu_memory)
    teacher_gpu_memory: GpuMemoryPlan | None
    token_budget: TokenBudget
    warnings: tuple[str, ...]
    # each pipelined role's FLOPs per stage and the split that evens them (`estimates.stage_balance`)
    stage_balance: tuple[StageBalance, ...] = ()
    # (phase, matmul FLOPs) of a step, the whole job's (`_step_flops`): where the compute goes, e.g. a teacher's share
    step_flops: tuple[tuple[str, float], ...] = ()
    # the checkpoint `train` resumes from (`config/resume.py`), found and checked when the plan checks files
    resume: ResumePoint | None = None
    # how `train` calls the custom reward function, each argument named with what it holds (`rewards.custom.call_form`),
    # when the plan checks files
    reward_call: str | None = None
    # a whole verl config's keys taken at verl's defaults (no hybridrl field; they change nothing) and its Hydra
    # `_target_` entries ignored (`config/verl_defaults.py`), dotted as written: the text report counts them
    verl_defaults_taken: tuple[str, ...] = ()
    verl_targets_ignored: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # A Plan read back from JSON could pair one device's policy with another's resolved values.
        if self.device_policy.name != self.resolved.device:
            raise ValueError(f"Plan.device_policy is the {self.device_policy.name!r} policy but "
                             f"resolved.device={self.resolved.device!r}; they must name the same device")

    # Convenience lookups -----------------------------------------------------------------
    def layout(self, role: str) -> RoleLayout:
        return _find(self.layouts, role, "role")

    def speed_settings(self, role: str) -> tuple[SpeedSetting, ...]:
        """megatron's fusions and overlaps `role` runs with (cuda; empty on cpu). Whether TransformerEngine and
        Apex import is the workers' to tell: here those two settings say what decides them."""
        layout = self.layout(role)
        return speed_settings(
            cuda=self.device_policy.megatron_speed_defaults, trainable=role in TRAINED_ROLES,
            data_parallel=layout.mesh.dp, distributed_optimizer=layout.megatron.use_distributed_optimizer,
            user_transformer=layout.megatron.override_transformer_config,
            user_ddp=layout.megatron.override_ddp_config)

    def update(self, role: str) -> UpdatePlan:
        return _find(self.updates, role, "role")

    def forward(self, pass_name: str) -> ForwardPlan:
        return _find(self.forwards, pass_name, "pass_name")

    @property
    def rollout_mesh(self) -> tuple[tuple[int, ...], ...]:
        return self.reshard.groups.rollout.replicas

    # Serialization -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out = _to_plain(self)
        out["config"] = config_to_dict(self.config)
        return out

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        data = dict(data)
        config = config_from_dict(data.pop("config"))
        return _from_plain(cls, {**data, "config": config})

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))


def _find(items: tuple[Any, ...], key: str, attr: str) -> Any:
    for item in items:
        if getattr(item, attr) == key:
            return item
    raise KeyError(f"{attr}={key!r} not in plan; have: {', '.join(getattr(i, attr) for i in items)}")


def _to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        if isinstance(value, JobConfig):
            return config_to_dict(value)
        return {f.name: _to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    return value


def _from_plain(tp: Any, value: Any) -> Any:
    """Inverse of `_to_plain` guided by type hints (tuples back from JSON lists)."""
    if value is None:
        return None
    origin = typing.get_origin(tp)
    if origin in (typing.Union, __import__("types").UnionType):
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        return _from_plain(options[0], value)
    if tp is JobConfig:
        return value if isinstance(value, JobConfig) else config_from_dict(value)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        hints = typing.get_type_hints(tp)
        return tp(**{f.name: _from_plain(hints[f.name], value[f.name]) for f in dataclasses.fields(tp)})
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_from_plain(args[0], v) for v in value)
        return tuple(_from_plain(a, v) for a, v in zip(args, value))
    if origin is list:
        (item,) = typing.get_args(tp)
        return [_from_plain(item, v) for v in value]
    if tp is float and isinstance(value, int):
        return float(value)
    return value


# ---------------------------------------------------------------------------- building a plan
def plan_from_sources(path: str | Path | None, overrides: list[str] | tuple[str, ...] = (), *,
                      check_files: bool = False) -> Plan:
    """Load, validate and plan in one pass: loader and validation problems are raised together.

    `check_files`: also check what `train` reads (model folders, data files, reward code:
    `hybridrl.config.inputs`); False sizes the layout from the model's config.json alone."""
    verl = VerlDefaults()
    config, issues = load_config_collecting(path, overrides, verl)
    if any(issue.field == CONFIG_FILE for issue in issues):  # unread: its defaults would only add noise
        raise ConfigError(issues)
    if not issues and config == JobConfig():
        raise ConfigError([ConfigIssue(
            "<config>", str(path) if path else "(none)", "sets nothing: a job names at least its model "
            "(actor_rollout_ref.model.path) and data (data.train_files); start from "
            "configs/examples/cpu_tiny_grpo.yaml (docs/user-guide.md)")])
    plan = build_plan(config, prior_issues=issues, check_files=check_files)
    if verl.taken or verl.targets:
        plan = dataclasses.replace(plan, verl_defaults_taken=tuple(verl.taken),
                                   verl_targets_ignored=tuple(verl.targets))
    return plan


def megatron_pipeline_split(config: JobConfig, num_layers: int) -> None:
    """megatron's `account_for_embedding/loss_in_pipeline_split` (in `override_transformer_config`, verl's scripts
    set them) as the split hybridrl lays out: the embedding and the loss count as one layer each, every stage takes
    (layers + flags) / PP, so the first and last stage hold one decoder layer fewer — megatron's own
    `get_num_layers_to_build` gives the same counts. In place, on the plan's own config; left for validation to
    refuse where it does not apply (VPP, where megatron drops the layer from the first chunk only; an uneven
    split also set; a sum PP does not divide)."""
    for _, mc in megatron_sections(config):
        flags = {name: bool(mc.override_transformer_config.get(name)) for name in MEGATRON_SPLIT_FLAGS}
        pp = mc.pipeline_model_parallel_size
        if not any(flags.values()) or not isinstance(pp, int) or pp < 2 or (mc.virtual_pipeline_model_parallel_size
                                                                            or 1) > 1:
            continue
        if mc.num_layers_in_first_pipeline_stage is not None or mc.num_layers_in_last_pipeline_stage is not None:
            continue
        counted = num_layers + sum(flags.values())
        if counted % pp:
            continue
        per_stage = counted // pp
        if flags["account_for_embedding_in_pipeline_split"]:
            mc.num_layers_in_first_pipeline_stage = per_stage - 1
        if flags["account_for_loss_in_pipeline_split"]:
            mc.num_layers_in_last_pipeline_stage = per_stage - 1
        mc.override_transformer_config = {k: v for k, v in mc.override_transformer_config.items()
                                          if k not in MEGATRON_SPLIT_FLAGS}


def _refused_names(issues: list[ConfigIssue] | tuple[ConfigIssue, ...]) -> frozenset[str]:
    """The field names the loader refused a value for (or that an unknown key was meant to be): such a field
    holds its default, so a rule that reads it would judge a value the user never wrote."""
    names = set()
    for issue in issues:
        names.add(issue.field.rsplit(".", 1)[-1].split("[", 1)[0])
        meant = re.search(r"did you mean '([^']+)'", issue.rule)
        if meant:
            names.add(meant.group(1))
    return frozenset(names)


def _echoes_the_actor(issue: ConfigIssue, issues: list[ConfigIssue]) -> bool:
    """A reference layout field refused with the value it shares with (or took from) the actor's, which is
    refused too: one mistake, said once, on the actor."""
    ref_prefix, actor_prefix = "actor_rollout_ref.ref.megatron.", "actor_rollout_ref.actor.megatron."
    if not issue.field.startswith(ref_prefix):
        return False
    twin = actor_prefix + issue.field.removeprefix(ref_prefix)
    return any(other.field == twin and other.value == issue.value for other in issues)


def _reads_any(issue: ConfigIssue, names: frozenset[str]) -> bool:
    """Whether a validation problem is about, or quotes, one of `names` (`field=value` in its text)."""
    return issue.field.rsplit(".", 1)[-1] in names or any(
        re.search(rf"(?<![\w]){re.escape(name)}=", issue.rule) for name in names)


def build_plan(config: JobConfig, prior_issues: list[ConfigIssue] | tuple[ConfigIssue, ...] = (), *,
               check_files: bool = False, handed_over: bool = False, refuse_over_memory: bool = True) -> Plan:
    """Validate `config` (raising `ConfigError` with every problem) and derive the Plan.

    A model path that is a hub id in the local Hugging Face cache becomes its snapshot folder; with
    `check_files` the model folders, data files and reward code are checked too (`check_inputs`).
    `handed_over`: the caller gives `config` to the plan, which keeps and adjusts it (no copy: the layout
    search's configs share their unchanged sections, and what the plan adjusts there comes out the same).
    `refuse_over_memory=False`: a job the training GPUs cannot hold is planned anyway (`gpu_memory.fits` False), for
    the search to try its memory savers without building the refusal's advice."""
    if not handed_over:
        config = copy.deepcopy(config)  # the Plan owns its copy; the caller's object stays theirs
    issues: list[ConfigIssue] = list(prior_issues)
    warnings: list[str] = []
    resolve_hub_ids(config, warnings)
    model = load_model_shape(config.actor_rollout_ref.model.path, issues, warnings, "actor_rollout_ref.model.path",
                             quiet=check_files)
    if model is not None:
        megatron_pipeline_split(config, model.num_layers)
    resolved = resolve(config, model)
    validated = len(issues)
    validate(config, resolved, model, issues, warnings)
    refused = _refused_names(prior_issues)
    issues[validated:] = [issue for issue in issues[validated:]
                          if not _reads_any(issue, refused) and not _echoes_the_actor(issue, issues)]
    hint, resume, reward_call = None, None, None
    if check_files:
        absent, resume, reward_call = check_inputs(config, issues, critic=resolved.critic_enabled, warnings=warnings,
                                                   actor_shape=model)
        # the model the rollout workers build: checked with the folders they load (the trainer-side pieces a plan
        # also sizes, e.g. in tests, build no vLLM engine)
        check_rollout_head_dim(Checker(issues, warnings), config, model)
        hint = LAYOUT_ONLY_HINT if absent else None
    if issues:
        raise ConfigError(issues, hint)
    plan = _derive(config, resolved, model, tuple(warnings), refuse_over_memory)
    if resume is not None:  # the schedules' position, from the job's batch arithmetic
        optims = {str(Role.ACTOR): config.actor_rollout_ref.actor.optim, str(Role.CRITIC): config.critic.optim}
        notes = schedule_notes(resume, {u.role: u.optimizer_steps_per_step for u in plan.updates}, optims)
        resume = dataclasses.replace(resume, notes=resume.notes + notes)
    if resume is not None or reward_call is not None:
        plan = dataclasses.replace(plan, resume=resume, reward_call=reward_call)
    refusals = megatron_refusals(plan)
    if refusals:
        raise ConfigError(refusals)
    return plan


def megatron_refusals(plan: Plan) -> list[ConfigIssue]:
    """What megatron-core's TransformerConfig refuses of the roles that carry `override_transformer_config`
    settings (`config.megatron_verdict`), each role's config built as its workers build it."""
    if plan.model is None:
        return []
    config, found = plan.config, []
    for layout in plan.layouts:
        mc = layout.megatron
        if not mc.override_transformer_config:
            continue
        role = Role(layout.role)
        section = role_megatron_field(config, role)  # the reference's is the actor's unless it has its own
        shape = role_model_shape(config, role, plan.model)
        model_section = {Role.CRITIC: config.critic.model}.get(role, config.actor_rollout_ref.model)
        fixed = role_transformer_settings(
            mc, shape,
            gradient_checkpointing=role in TRAINED_ROLES and model_section.enable_gradient_checkpointing,
            router_replay=role == Role.ACTOR and config.actor_rollout_ref.actor.router_replay == "rollout")
        issue = megatron_refusal(f"{section}.override_transformer_config", mc, shape, device=plan.resolved.device,
                                 dtype=mc.dtype or plan.resolved.train_dtype, fixed=fixed)
        if issue is not None and all(str(issue) != str(other) for other in found):
            found.append(issue)
    return found


def _role_on_gpu(memory: TrainingMemory, layout: RoleLayout, *, grads: bool | None = None,
                 optimizer: bool | None = None) -> RoleOnGpu:
    """A role's memory estimate with its offload settings (`grads` / `optimizer` override them)."""
    mc = layout.megatron
    # the actor's parameters leave during generation (param_offload); the reference's always do (own_process)
    return RoleOnGpu(memory, offload_params=mc.param_offload and memory.role in (Role.ACTOR, Role.REWARD_MODEL,
                                                                              Role.TEACHER),
                     offload_grads=mc.grad_offload if grads is None else grads,
                     offload_optimizer=mc.optimizer_offload if optimizer is None else optimizer,
                     own_process=memory.role != Role.REF,
                     communicators=nccl_communicators(layout.mesh, mc.expert_model_parallel_size,
                                                      mc.expert_tensor_parallel_size))


def _layer_adapter_elements(lora: LoraConfig, model: ModelShape, ffn: int, *, tp: int = 1, experts: int = 0,
                            expert_tp: int = 1, peft_form: bool = False) -> int:
    """`lora_targets.adapter_elements_per_layer` of one of `model`'s layers (its MLP of `ffn`, or `experts` of it)."""
    return adapter_elements_per_layer(lora.type, lora.targets, lora.rank, hidden=model.hidden_size,
                                      q_rows=model.num_attention_heads * model.head_dim,
                                      kv_rows=model.num_kv_heads * model.head_dim, ffn=ffn, tp=tp,
                                      peft_form=peft_form, experts=experts, expert_tp=expert_tp)


def lora_elements_per_layer(lora: LoraConfig, model: ModelShape, tp: int, peft_form: bool = False,
                            ep: int = 1, etp: int | None = None) -> int:
    """A LoRA actor's adapter elements per decoder layer on one TP rank (0 without adapters), an MoE model's the
    mean over its layers (an MoE layer's this rank's experts', E / EP of them, each split over expert TP `etp`,
    None: TP as megatron's default); `peft_form`: in a PEFT folder (what a served-adapter sync moves:
    `lora_targets.adapter_elements_per_layer`)."""
    if lora.rank <= 0:
        return 0
    dense = _layer_adapter_elements(lora, model, model.ffn_hidden_size, tp=tp, peft_form=peft_form)
    if not model.is_moe:
        return dense
    moe = _layer_adapter_elements(lora, model, model.moe_ffn_hidden_size, tp=tp, peft_form=peft_form,
                                  experts=model.num_experts // ep, expert_tp=tp if etp is None else etp)
    moe_layers = len(model.moe_layers)
    return (moe_layers * moe + (model.num_layers - moe_layers) * dense) // model.num_layers


def lora_elements_met_per_token(lora: LoraConfig, model: ModelShape) -> int:
    """The adapter elements one token meets in a forward through every decoder layer (an MoE layer's: its routed
    top-k experts' adapters only): an adapter costs 2 FLOPs an element a token, like a weight."""
    if lora.rank <= 0:
        return 0
    moe_layers = len(model.moe_layers) if model.is_moe else 0
    moe = _layer_adapter_elements(lora, model, model.moe_ffn_hidden_size, experts=model.moe_top_k) if moe_layers else 0
    return moe_layers * moe + (model.num_layers - moe_layers) * _layer_adapter_elements(lora, model,
                                                                                          model.ffn_hidden_size)


def served_adapter_bytes(plan: Plan) -> int:
    """What a sync moves when vLLM serves a LoRA actor's adapters (`lora.merge: false`): the PEFT adapter's fp32
    tensors (a fused adapter's A once per projection), to every rollout rank; 0 when it does not."""
    model = plan.model
    if not plan.resolved.serves_adapters or model is None:
        return 0
    lora = plan.config.actor_rollout_ref.model.lora
    return 4 * lora_elements_per_layer(lora, model, 1, peft_form=True) * model.num_layers


def _gpu_memory(config: JobConfig, resolved: Resolved, policy: DevicePolicy, memories: tuple[TrainingMemory, ...],
                layouts: tuple[RoleLayout, ...], *, utilization: float | None = None,
                offload: dict[str, tuple[bool, bool]] | None = None) -> GpuMemoryPlan:
    """The per-GPU phases of the job (`offload`: role -> (grads, optimizer) offload to try instead)."""
    rollout = config.actor_rollout_ref.rollout
    by_role = {lay.role: lay for lay in layouts}
    roles = tuple(_role_on_gpu(m, by_role[m.role], **dict(zip(("grads", "optimizer"),
                                                               (offload or {}).get(m.role, (None, None)))))
                  for m in memories if not _in_teacher_pool(resolved, m.role))
    colocated = not resolved.disaggregated
    return gpu_memory_plan(
        roles, gpu_gib=config.trainer.gpu_memory_gib,
        gpu_memory_utilization=(utilization or rollout.gpu_memory_utilization) if colocated else None,
        infer_tp=rollout.tensor_model_parallel_size, cuda_graphs=policy.vllm_honours_enforce_eager
        and rollout.enforce_eager is False, device_overheads=policy.gpu_memory_budget_binding)


def _in_teacher_pool(resolved: Resolved, role: str) -> bool:
    """Whether `role` runs on the teacher's pool of its own (teacher.mode=disaggregated), not the training GPUs."""
    return role == Role.TEACHER and resolved.teacher_world > 0


def _teacher_pool_memory(resolved: Resolved, policy: DevicePolicy, memories: tuple[TrainingMemory, ...],
                         layouts: tuple[RoleLayout, ...], gpu_gib: float) -> GpuMemoryPlan | None:
    """One GPU of the teacher's own pool: the teacher's pass and its process's overheads alone (None: colocated)."""
    memory = next((m for m in memories if _in_teacher_pool(resolved, m.role)), None)
    if memory is None:
        return None
    layout = next(lay for lay in layouts if lay.role == Role.TEACHER)
    return gpu_memory_plan((_role_on_gpu(memory, layout),), gpu_gib=gpu_gib, gpu_memory_utilization=None,
                           device_overheads=policy.gpu_memory_budget_binding)


def _ways_to_fit(config: JobConfig, resolved: Resolved, policy: DevicePolicy, memories: tuple[TrainingMemory, ...],
                 layouts: tuple[RoleLayout, ...], rollout: RolloutMemory, seq_len: int) -> str:
    """The single changes that would bring the per-GPU peak under the GPU, with their peaks."""
    arr = config.actor_rollout_ref
    gpu, utilization = config.trainer.gpu_memory_gib, arr.rollout.gpu_memory_utilization
    trained = [lay for lay in layouts if lay.role in (Role.ACTOR, Role.CRITIC)]
    current = {lay.role: (lay.megatron.grad_offload, lay.megatron.optimizer_offload) for lay in trained}
    # each trained role's optimizer offload, then with its grads, then every role's both at once
    choices = [{lay.role: offload} for lay in trained for offload in ((current[lay.role][0], True), (True, True))]
    choices.append({lay.role: (True, True) for lay in trained})
    ways: list[str] = []
    for offload in choices:
        changed = {role: value for role, value in offload.items() if value != current[role]}
        # each setting written whole (field=value), so that the advice pastes as overrides
        label = " and ".join(
            f"{role_megatron_field(config, role)}.{name}=true"
            for role, value in changed.items()
            for name, on, was in zip(("grad_offload", "optimizer_offload"), value, current[role]) if on and not was)
        if not changed or any(label in way for way in ways):
            continue  # already what the job does, or named already
        memory = _gpu_memory(config, resolved, policy, memories, layouts, offload={**current, **offload})
        if memory.fits:
            ways.append(f"{label} (peak {memory.peak_gib:.1f} GiB)")
    # The largest utilization (in steps of 0.05) whose peak fits, if it still holds vLLM's weights and one
    # full sequence's KV cache.
    for step in range(int(utilization * 20) - 1, 0, -1):
        lower = step / 20
        room = gpu * lower - rollout.weights_gib
        if _gpu_memory(config, resolved, policy, memories, layouts, utilization=lower).fits \
                and room * GIB >= rollout.kv_bytes_per_token * seq_len:
            ways.append(f"actor_rollout_ref.rollout.gpu_memory_utilization={lower:g} (KV cache {room:.1f} GiB)")
            break
    ways += _single_changes_that_fit(config, layouts)
    ways += _frozen_role_changes_that_fit(config, resolved, layouts)
    if not ways:
        return ("no single change of an offload, rollout.gpu_memory_utilization, a role's TP or PP, its "
                "activation recompute or a micro-batch size fits it: `hybridrl plan --search` (with "
                "trainer.hardware) tries every layout of these GPUs with the memory savers together (a teacher's "
                "or reward model's layout stays yours), and `--target-step-time` larger clusters")
    return "would fit with: " + "; or ".join(ways)


# the micro-batch sizes whose activations a GPU holds at once, one per pass (dynamic batching leaves them unused)
MICRO_BATCH_FIELDS = ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
                      "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
                      "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", "critic.ppo_micro_batch_size_per_gpu",
                      "reward_model.micro_batch_size_per_gpu", "teacher.log_prob_micro_batch_size_per_gpu")


def _single_changes_that_fit(config: JobConfig, layouts: tuple[RoleLayout, ...]) -> list[str]:
    """Each single change of a trained role's layout (TP or PP doubled, with a reference section of its own kept
    equal), its activation recompute or a micro-batch size (halved) that the plan accepts and whose peak fits, with
    that peak: advice planned, every rule included, not guessed."""
    changes: list[list[tuple[str, object]]] = []
    for layout in layouts:
        if layout.role not in TRAINED_ROLES:
            continue
        sections = [role_megatron_field(config, layout.role)]
        if layout.role == Role.ACTOR and config.actor_rollout_ref.ref.megatron is not None:
            sections.append("actor_rollout_ref.ref.megatron")  # the reference's layout must stay the actor's
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
            changes.append([(f"{section}.{name}", 2 * getattr(layout.megatron, name)) for section in sections])
        model_path = f"{model_section_of(layout.role)}.model.enable_gradient_checkpointing"
        if not value_at(config, model_path):
            changes.append([(model_path, True)])
    changes += [[(path, value // 2)] for path in MICRO_BATCH_FIELDS
                if isinstance(value := value_at(config, path), int) and value > 1]
    ways = []
    for change in changes:
        trial = copy.deepcopy(config)
        for path, value in change:
            *parents, name = path.split(".")
            section = functools.reduce(getattr, parents, trial)
            if section is None:
                break
            setattr(section, name, value)
        else:
            try:
                memory = build_plan(trial, handed_over=True, refuse_over_memory=False).gpu_memory
            except ConfigError:
                continue  # a rule refuses it (TP past the heads, PP not dividing the layers, ...): no advice
            if memory is not None and memory.fits:
                ways.append(" and ".join(f"{path}={str(value).lower() if isinstance(value, bool) else value}"
                                         for path, value in change) + f" (peak {memory.peak_gib:.1f} GiB)")
    return ways


# the frozen roles with a layout of their own on the training GPUs (a teacher in a pool of its own has its own check)
OWN_LAYOUT_FROZEN_ROLES = (Role.TEACHER, Role.REWARD_MODEL)
MAX_FROZEN_STAGES = 16  # the deepest pipeline the advice tries for one (the layout search's own bound)


def _frozen_role_changes_that_fit(config: JobConfig, resolved: Resolved,
                                  layouts: tuple[RoleLayout, ...]) -> list[str]:
    """For a frozen role of its own layout on the training GPUs (a colocated teacher, a reward model): its weights
    on the host between its passes (`megatron.param_offload`), and the smallest split of it (TP x PP, TP first:
    powers of two within a machine, PP dividing its layers) that the plan accepts and whose peak fits. A 32B
    teacher beside a 7B student needs an 8-way split, which no single doubling reaches: advice planned, not
    guessed."""
    ways = []
    per_node = config.trainer.n_gpus_per_node
    for layout in layouts:
        if layout.role not in OWN_LAYOUT_FROZEN_ROLES or _in_teacher_pool(resolved, layout.role):
            continue
        section, megatron = role_megatron_field(config, layout.role), layout.megatron
        tp_now, pp_now = megatron.tensor_model_parallel_size, megatron.pipeline_model_parallel_size
        splits = sorted(((tp, pp) for tp in powers_of_two_upto(per_node if isinstance(per_node, int) else 1)
                         for pp in range(1, MAX_FROZEN_STAGES + 1) if tp * pp > tp_now * pp_now),
                        key=lambda split: (split[0] * split[1], split[1]))
        candidates: list[list[tuple[str, object]]] = (
            [[(f"{section}.param_offload", True)]] if not megatron.param_offload else [])
        candidates += [[(f"{section}.tensor_model_parallel_size", tp), (f"{section}.pipeline_model_parallel_size", pp)]
                       for tp, pp in splits]
        split_found = False
        for change in candidates:
            is_split = len(change) == 2
            if is_split and split_found:
                break  # the smallest split that fits: a larger one says nothing more
            peak = _fitting_peak(config, change)
            if peak is not None:
                split_found = split_found or is_split
                ways.append(" and ".join(f"{path}={str(value).lower() if isinstance(value, bool) else value}"
                                         for path, value in change) + f" (peak {peak:.1f} GiB)")
    return ways


def powers_of_two_upto(limit: int) -> list[int]:
    return [1 << i for i in range(limit.bit_length()) if 1 << i <= limit]


def _fitting_peak(config: JobConfig, change: list[tuple[str, object]]) -> float | None:
    """The per-GPU peak of `config` with `change` set, where the plan accepts it and it fits (else None)."""
    trial = copy.deepcopy(config)
    for path, value in change:
        *parents, name = path.split(".")
        setattr(functools.reduce(getattr, parents, trial), name, value)
    try:
        memory = build_plan(trial, handed_over=True, refuse_over_memory=False).gpu_memory
    except ConfigError:
        return None  # a rule refuses it (TP past the heads, PP not dividing the layers, ...): no advice
    return memory.peak_gib if memory is not None and memory.fits else None


def value_at(config: JobConfig, path: str) -> object:
    """The value at a dotted config path (None past a missing section)."""
    value: object = config
    for part in path.split("."):
        value = getattr(value, part, None)
    return value


def _cpu_kv_cache_bytes(config: JobConfig, resolved: Resolved, policy: DevicePolicy, model: ModelShape,
                        sequences_per_replica: int) -> int | None:
    """The KV cache each vLLM rank allocates on CPU: the configured size, or (unset) enough for
    every sequence vLLM runs at once (a replica's step, at most max_num_seqs) at full length.
    None on GPU, where vLLM sizes it from gpu_memory_utilization."""
    rollout = config.actor_rollout_ref.rollout
    if not policy.vllm_kv_cache_from_plan:
        return None
    if rollout.cpu_kv_cache_gib is not None:
        return int(rollout.cpu_kv_cache_gib * GIB)
    return kv_cache_bytes_needed(
        model, rollout.tensor_model_parallel_size, dtype=resolved.rollout_dtype,
        sequences=min(sequences_per_replica, rollout.max_num_seqs), seq_len=resolved.max_sequence_length,
    )


# The field a job the training GPUs cannot hold is refused at (the plan's own memory check, after validation).
MEMORY_REFUSAL_FIELD = "trainer.gpu_memory_gib"

# The share of a pipeline's time a better first/last stage split would save, from which the plan warns.
IMBALANCE_WARNING = 0.10


def _stage_balances(config: JobConfig, resolved: Resolved, model: ModelShape,
                    layouts: list[RoleLayout]) -> list[StageBalance]:
    """`stage_balance` of every pipelined role on the token budget's longest rows: every layer computes a
    row's prompt (once per group where the role's packed rows share it) and its response, the output
    layer the response only."""
    budget = token_budget(config, resolved)
    response = budget.sequence_tokens - budget.prompt_tokens
    out = []
    for layout in layouts:
        prompt = float(budget.prompt_tokens)  # padded rows: every column is computed
        if resolved.packed(layout.role) and resolved.shared_prefix(layout.role):
            prompt /= config.actor_rollout_ref.rollout.n
        balance = stage_balance(
            layout.role, role_model_shape(config, layout.role, model), layout.mesh.layout(),
            layer_tokens=prompt + response, head_tokens=response, seq_len=budget.sequence_tokens,
            vocab_head=layout.role in VOCABULARY_ROLES)
        if balance is not None:
            out.append(balance)
    return out


# The roles whose output layer is the vocabulary (the others' is a value head).
VOCABULARY_ROLES = (Role.ACTOR, Role.REF, Role.TEACHER)
# The phase each forward pass runs in (`Phase`'s names), and each trained role's update.
PASS_PHASES = {"old_log_prob": Phase.OLD_LOG_PROB, "ref_log_prob": Phase.REF, "values": Phase.VALUES,
               "reward_scores": Phase.REWARD, "teacher_log_prob": Phase.TEACHER}
UPDATE_PHASES = {Role.ACTOR: Phase.UPDATE_ACTOR, Role.CRITIC: Phase.UPDATE_CRITIC}


def _step_flops(config: JobConfig, resolved: Resolved, model: ModelShape, updates: list[UpdatePlan],
                forwards: list[ForwardPlan], lengths: tuple[float, float, float] | None = None,
                ) -> tuple[tuple[str, float], ...]:
    """(phase, matmul FLOPs) of one step over the whole job: generation (the prompt once per group, as vLLM's prefix
    cache holds it for the n samples), each forward pass that runs, each update (forward and backward: 3 forwards, a
    LoRA actor's fewer: `_update_flops`; per epoch). `lengths`: a row's (prompt, response, computed) tokens, computed
    being what a training pass computes of it with its padding; by default the token budget's full-length rows,
    unpadded. Shared prompts in training ignored."""
    budget = token_budget(config, resolved)
    if lengths is None:
        lengths = (budget.prompt_tokens, budget.sequence_tokens - budget.prompt_tokens, budget.sequence_tokens)
    prompt, response, computed = lengths
    rows, n = config.data.train_batch_size * config.actor_rollout_ref.rollout.n, config.actor_rollout_ref.rollout.n
    seq_len = max(1, round(prompt + response))

    def flops(role: str, layer_tokens: float) -> float:
        return forward_flops(role_model_shape(config, role, model), rows=rows, layer_tokens=layer_tokens,
                             head_tokens=response, seq_len=seq_len, vocab_head=role in VOCABULARY_ROLES)

    def passed(role: str) -> float:
        base, _, adapters = _forward_flops_parts(config, resolved, model, role, rows, prompt, response, computed)
        return base + adapters

    out = [(Phase.GEN, flops(Role.ACTOR, prompt / n + response))]
    out += [(PASS_PHASES[f.pass_name], passed(f.role)) for f in forwards
            if f.pass_name != "old_log_prob" or resolved.old_log_prob_pass]
    out += [(UPDATE_PHASES[Role(u.role)], u.ppo_epochs * _update_flops(config, resolved, model, u.role, rows, prompt,
                                                                  response, computed)[1]) for u in updates]
    return tuple(out)


def _forward_flops_parts(config: JobConfig, resolved: Resolved, model: ModelShape, role: str, rows: int,
                         prompt: float, response: float, computed: float) -> tuple[float, float, float]:
    """(the base model's, its attention's QK^T and AV share of that, the adapters') matmul FLOPs of one forward of
    `role` over `rows` rows of these lengths: causal attention's half of each row's s x s (TE's flash attention, and
    PyTorch's fused one that a GPU's local spec runs: `parallel.sdpa_attention`). The adapters: the actor's alone
    (its reference runs them off)."""
    shape = role_model_shape(config, role, model)
    seq_len = max(1, round(prompt + response))
    base = forward_flops(shape, rows=rows, layer_tokens=computed, head_tokens=response, seq_len=seq_len,
                         vocab_head=role in VOCABULARY_ROLES)
    attention = rows * computed * shape.num_layers * 2.0 * seq_len * shape.q_size
    adapters = 0.0
    if resolved.trains_adapters(role):
        adapters = rows * computed * 2.0 * lora_elements_met_per_token(config.actor_rollout_ref.model.lora, shape)
    return base, attention, adapters


def _update_flops(config: JobConfig, resolved: Resolved, model: ModelShape, role: str, rows: int, prompt: float,
                  response: float, computed: float) -> tuple[float, float]:
    """(a forward's, a forward and backward's) matmul FLOPs of `role`'s update over `rows` rows of these lengths. The
    backward is 2 forwards; with LoRA (the actor) megatron's frozen layers compute their input's gradient alone
    (`linear_with_frozen_weight`): the update is 2 forwards of the base's weights, 3 of attention's QK^T and AV
    (which have no weights: both of their inputs get a gradient) and 3 of the adapters."""
    base, attention, adapters = _forward_flops_parts(config, resolved, model, role, rows, prompt, response, computed)
    if not resolved.trains_adapters(role):
        return base, 3 * base
    return base + adapters, 2 * base + attention + 3 * adapters


def recompute_share(plan: Plan, role: str) -> float:
    """What a recomputed forward (full activation recompute) adds to `role`'s update FLOPs, as a share of them, at
    the plan's full-length rows: 1/3 for a whole model, more for a LoRA actor (whose backward is lighter)."""
    if plan.model is None:
        return 1 / 3
    budget = plan.token_budget
    forward, update = _update_flops(plan.config, plan.resolved, plan.model, role, plan.sequences_per_step,
                                    budget.prompt_tokens,
                                    budget.sequence_tokens - budget.prompt_tokens, budget.sequence_tokens)
    return forward / update


def step_flops_at(plan: Plan, prompt_tokens: float, response_tokens: float, computed_tokens: float,
                  ) -> tuple[tuple[str, float], ...]:
    """`Plan.step_flops` for rows of these mean lengths (a step as it ran) instead of the budget's full ones."""
    if plan.model is None:
        return ()
    return _step_flops(plan.config, plan.resolved, plan.model, list(plan.updates), list(plan.forwards),
                       (prompt_tokens, response_tokens, computed_tokens))


def _imbalance_warning(config: JobConfig, balance: StageBalance) -> str:
    """The plan's words for a pipeline whose stages carry unequal work, with the setting that evens it."""
    field = role_megatron_field(config, balance.role)
    settings = [f"{field}.{name}={value}" for name, value in (
        ("num_layers_in_first_pipeline_stage", balance.best_first),
        ("num_layers_in_last_pipeline_stage", balance.best_last)) if value is not None] or [
        f"{field}.num_layers_in_first/last_pipeline_stage unset (the even split)"]
    head = (f"the vocabulary head for the {balance.head_tokens_per_row} response tokens of a row"
            if balance.vocab_head else "the value head")
    return (f"{balance.role}: its pipeline stages ({split_text(balance.layers)} layers) carry "
            f"{shares_text(balance.shares)} of the matmul FLOPs (the last also holds {head}) and 1F1B runs at "
            f"the heaviest stage's pace: {' and '.join(settings)} ({split_text(balance.best_layers)} layers, "
            f"{shares_text(balance.best_shares)}) would take ~{balance.gain:.0%} off the pipeline's time")


@functools.lru_cache(maxsize=256)
def _colocated_reshard(model: ModelShape | None, mesh: TrainingMesh, infer_tp: int, dtype: str, ep: int,
                       etp: int | None) -> tuple[ReshardGroups, ReshardTraffic | None]:
    """The actor's mesh's groups with vLLM's TP and their traffic (None without a model shape); cached, as
    `hybridrl plan --search` plans many layouts on one mesh (both results are immutable)."""
    groups = build_reshard_groups(mesh, infer_tp)
    return groups, reshard_traffic(model, mesh, groups, dtype, ep=ep, etp=etp) if model else None


def _derive(config: JobConfig, resolved: Resolved, model: ModelShape | None, warnings: tuple[str, ...],
            refuse_over_memory: bool = True) -> Plan:
    """The Plan of a validated job: one derivation per section (layouts, passes, the weight sync, memory)."""
    data, n = config.data, config.actor_rollout_ref.rollout.n
    policy = DevicePolicy.for_device(resolved.device)  # validated: a known device
    layouts = _layouts(config, resolved)
    updates, forwards = _passes(config, resolved, {layout.role: layout for layout in layouts})
    reshard = _reshard(config, resolved, model, layouts)
    infer_dp = reshard.groups.rollout.infer_dp
    memory = MemoryPlans()
    if model is not None:
        memory = _memory(config, resolved, policy, model, layouts, updates, forwards, infer_dp, refuse_over_memory)
    return Plan(
        config=config,
        resolved=resolved,
        device_policy=policy,
        model=model,
        layouts=tuple(layouts),
        prompts_per_step=data.train_batch_size,
        sequences_per_step=data.train_batch_size * n,
        prompts_per_rollout_replica=data.train_batch_size // infer_dp,
        sequences_per_rollout_replica=data.train_batch_size // infer_dp * n,
        updates=tuple(updates),
        forwards=tuple(forwards),
        reshard=reshard,
        training_memory=memory.training,
        rollout_memory=memory.rollout,
        gpu_memory=memory.gpu,
        teacher_gpu_memory=memory.teacher,
        token_budget=token_budget(config, resolved),
        stage_balance=memory.balances,
        step_flops=_step_flops(config, resolved, model, updates, forwards) if model is not None else (),
        warnings=warnings + memory.warnings,
    )


def _layouts(config: JobConfig, resolved: Resolved) -> list[RoleLayout]:
    """Each active role's megatron section and its mesh over the ranks it runs on."""
    layouts = []
    for role in active_roles(config, resolved):
        mc = role_megatron(config, role)
        mesh = build_training_mesh(
            resolved.role_world(role), mc.tensor_model_parallel_size, mc.pipeline_model_parallel_size,
            mc.context_parallel_size, mc.virtual_pipeline_model_parallel_size,
            first_stage_layers=mc.num_layers_in_first_pipeline_stage,
            last_stage_layers=mc.num_layers_in_last_pipeline_stage,
        )
        layouts.append(RoleLayout(role, mc, mesh))
    return layouts


def _passes(config: JobConfig, resolved: Resolved,
            by_role: dict[str, RoleLayout]) -> tuple[list[UpdatePlan], list[ForwardPlan]]:
    """A step's updates (the actor's, the critic's) and forward passes (old, reference, values, reward scores,
    teacher), each split over its role's DP ranks into mini- and micro-batches."""
    arr, data = config.actor_rollout_ref, config.data
    n = arr.rollout.n

    def update(role: str, mini: int, micro: int, epochs: int, dynamic: bool) -> UpdatePlan:
        dp = by_role[role].mesh.dp
        per_rank = mini * n // dp
        return UpdatePlan(
            role, mini, mini * n, data.train_batch_size // mini, per_rank, micro,
            0 if dynamic else per_rank // micro, epochs, (data.train_batch_size // mini) * epochs, dynamic,
        )

    def forward(role: str, pass_name: str, micro: int) -> ForwardPlan:
        per_rank = data.train_batch_size * n // by_role[role].mesh.dp
        batching = pass_batching(config, pass_name)
        if batching.dynamic:
            per_micro = max(1, batching.max_tokens // max(1, resolved.max_sequence_length))
            return ForwardPlan(role, pass_name, per_rank, micro, -(-per_rank // per_micro), True, batching.max_tokens)
        return ForwardPlan(role, pass_name, per_rank, micro, -(-per_rank // micro))

    actor = arr.actor
    updates = [update(Role.ACTOR, actor.ppo_mini_batch_size, actor.ppo_micro_batch_size_per_gpu,
                      actor.ppo_epochs, actor.use_dynamic_bsz)]
    forwards = [forward(Role.ACTOR, "old_log_prob", arr.rollout.log_prob_micro_batch_size_per_gpu)]
    if Role.REF in by_role:
        forwards.append(forward(Role.REF, "ref_log_prob", arr.ref.log_prob_micro_batch_size_per_gpu))
    if Role.CRITIC in by_role:
        critic = config.critic
        updates.append(update(Role.CRITIC, resolved.critic_mini_batch_size, critic.ppo_micro_batch_size_per_gpu,
                              resolved.critic_ppo_epochs, actor.use_dynamic_bsz))
        forwards.append(forward(Role.CRITIC, "values", critic.ppo_micro_batch_size_per_gpu))
    if Role.REWARD_MODEL in by_role:
        forwards.append(forward(Role.REWARD_MODEL, "reward_scores", config.reward_model.micro_batch_size_per_gpu))
    if Role.TEACHER in by_role:
        forwards.append(forward(Role.TEACHER, "teacher_log_prob", config.teacher.log_prob_micro_batch_size_per_gpu))
    return updates, forwards


def _reshard(config: JobConfig, resolved: Resolved, model: ModelShape | None,
             layouts: list[RoleLayout]) -> ReshardPlan:
    """The weight sync: the rollout pool's groups and the cross-pool bytes (disaggregated), or the resharder's groups
    and what each rank receives (colocated)."""
    arr = config.actor_rollout_ref
    actor_mesh = next(layout.mesh for layout in layouts if layout.role == Role.ACTOR)
    infer_tp = arr.rollout.tensor_model_parallel_size
    cross = traffic = None
    if resolved.disaggregated:
        groups = build_pool_groups(resolved.rollout_world, infer_tp)
        if model:
            cross = cross_pool_traffic(model, resolved.world_size, resolved.rollout_world, infer_tp,
                                       resolved.rollout_dtype)
    else:
        groups, traffic = _colocated_reshard(model, actor_mesh, infer_tp, resolved.rollout_dtype,
                                             arr.actor.megatron.expert_model_parallel_size,
                                             arr.actor.megatron.expert_tensor_parallel_size)
    return ReshardPlan(groups, traffic, resolved.rollout_dtype, cross)


@dataclass(frozen=True)
class MemoryPlans:
    """What `_memory` derives: each role's training memory, the rollout's, the GPU's phases (the training pool's and
    a teacher pool's), the stage balances, and the warnings they raise."""

    training: tuple[TrainingMemory, ...] = ()
    rollout: RolloutMemory | None = None
    gpu: GpuMemoryPlan | None = None
    teacher: GpuMemoryPlan | None = None
    balances: tuple[StageBalance, ...] = ()
    warnings: tuple[str, ...] = ()


def _memory(config: JobConfig, resolved: Resolved, policy: DevicePolicy, model: ModelShape,
            layouts: list[RoleLayout], updates: list[UpdatePlan], forwards: list[ForwardPlan], infer_dp: int,
            refuse_over_memory: bool) -> MemoryPlans:
    """Memory per role and per GPU phase; a job the GPUs cannot hold refused (`ConfigError`) unless
    `refuse_over_memory` is False, the rest of what does not fit a warning."""
    arr, data = config.actor_rollout_ref, config.data
    balances = _stage_balances(config, resolved, model, layouts)
    train_mem = _training_memories(config, resolved, model, layouts, updates, forwards)
    sequences_per_replica = data.train_batch_size // infer_dp * arr.rollout.n
    if resolved.async_mode == "fully_async":  # up to max_staleness + 1 batches in flight at once
        sequences_per_replica *= resolved.max_staleness + 1
    roll_mem = rollout_memory(
        model, arr.rollout.tensor_model_parallel_size, dtype=resolved.rollout_dtype,
        gpu_gib=config.trainer.gpu_memory_gib,
        gpu_memory_utilization=arr.rollout.gpu_memory_utilization,
        sequences_per_replica=sequences_per_replica,
        seq_len=resolved.max_sequence_length,
        cpu_kv_cache_bytes=_cpu_kv_cache_bytes(config, resolved, policy, model, sequences_per_replica),
    )
    gpu_memory = _gpu_memory(config, resolved, policy, tuple(train_mem), tuple(layouts))
    teacher_memory = _teacher_pool_memory(resolved, policy, tuple(train_mem), tuple(layouts),
                                          config.trainer.gpu_memory_gib)
    if teacher_memory is not None and not teacher_memory.fits and policy.gpu_memory_budget_binding:
        peak = teacher_memory.peak
        raise ConfigError([ConfigIssue(
            "teacher.megatron.tensor_model_parallel_size", config.teacher.megatron.tensor_model_parallel_size,
            f"leaves the teacher's pool short of memory: its pass holds {peak.total_gib:.1f} GiB + a margin of "
            f"{teacher_memory.margin_gib:.1f} = {teacher_memory.peak_gib:.1f} GiB per GPU, more than "
            f"trainer.gpu_memory_gib={config.trainer.gpu_memory_gib:g}; split the teacher further (TP or PP), "
            "give its pool more GPUs, or lower teacher.log_prob_micro_batch_size_per_gpu")])
    extra = [f"{m.role}: estimated {m.total_gib:.1f} GiB per GPU exceeds trainer.gpu_memory_gib="
             f"{config.trainer.gpu_memory_gib:g}" for m in train_mem if not m.fits]
    extra += _rollout_memory_warnings(config, resolved, model, roll_mem, sequences_per_replica)
    if not gpu_memory.fits:
        peak = gpu_memory.peak
        what = (f"its heaviest phase, {peak.name}, holds {peak.total_gib:.1f} GiB + a margin of "
                f"{gpu_memory.margin_gib:.1f} = {gpu_memory.peak_gib:.1f} GiB per GPU (`hybridrl plan` lists "
                f"every item)")
        if not gpu_memory.startup_fits:
            what = (f"vLLM's start-up check needs gpu_memory_utilization x the GPU free while the actor's "
                    f"process already holds {gpu_memory.startup.total_gib:.1f} GiB (more than "
                    f"{gpu_memory.startup_limit_gib:.1f})" + ("" if gpu_memory.peak_gib <= gpu_memory.gpu_gib
                                                              else "; and " + what))
        # it would run out of memory after minutes of start-up: refuse now
        if policy.gpu_memory_budget_binding and refuse_over_memory:
            raise ConfigError([ConfigIssue(
                MEMORY_REFUSAL_FIELD, config.trainer.gpu_memory_gib,
                f"is too small for this job: {what}; "
                + _ways_to_fit(config, resolved, policy, tuple(train_mem), tuple(layouts), roll_mem,
                               resolved.max_sequence_length))])
        extra.append(f"GPU memory: {what} > trainer.gpu_memory_gib={config.trainer.gpu_memory_gib:g}; lower "
                     "rollout.gpu_memory_utilization, offload, or add TP/PP")
    # a reference on the actor's megatron section has the actor's balance: one warning says it
    shared_ref = config.actor_rollout_ref.ref.megatron is None
    extra += [_imbalance_warning(config, balance) for balance in balances
              if balance.gain >= IMBALANCE_WARNING and not (balance.role == Role.REF and shared_ref)]
    return MemoryPlans(tuple(train_mem), roll_mem, gpu_memory, teacher_memory, tuple(balances), tuple(extra))


def full_recompute(config: JobConfig, layout: RoleLayout) -> bool:
    """Whether a role's update recomputes each layer's activations in its backward: by its model section's switch
    (`model.enable_gradient_checkpointing`) or megatron's own setting (override_transformer_config's
    recompute_granularity full); selective recompute keeps most activations, and is counted as none."""
    section = getattr(config, model_section_of(layout.role))
    return (section.model.enable_gradient_checkpointing
            or layout.megatron.override_transformer_config.get("recompute_granularity") == "full")


def _training_memories(config: JobConfig, resolved: Resolved, model: ModelShape, layouts: list[RoleLayout],
                       updates: list[UpdatePlan], forwards: list[ForwardPlan]) -> list[TrainingMemory]:
    """Each role's memory per GPU (a LoRA actor's reference is its own frozen base: none of its own)."""
    arr, data = config.actor_rollout_ref, config.data
    train_mem = []
    for layout in layouts:
        mc = layout.megatron
        if layout.role == Role.REF and resolved.lora_rank > 0:
            continue  # a LoRA actor's reference is its own frozen base (adapters off): no model of its own
        trainable = layout.role in (Role.ACTOR, Role.CRITIC)
        micro = next((u.micro_batch_size for u in updates if u.role == layout.role),
                     next(f.micro_batch_size for f in forwards if f.role == layout.role))
        value_model = layout.role in (Role.CRITIC, Role.REWARD_MODEL)
        train_mem.append(training_memory(
            layout.role, role_model_shape(config, layout.role, model), layout.mesh,
            dtype=mc.dtype or resolved.train_dtype,
            distributed_optimizer=mc.use_distributed_optimizer, trainable=trainable,
            micro_batch=micro, seq_len=resolved.max_sequence_length,
            sequence_parallel=mc.sequence_parallel_in_effect,
            gpu_gib=config.trainer.gpu_memory_gib, ep=mc.expert_model_parallel_size,
            etp=mc.expert_tensor_parallel_size, value_head=value_model,
            recompute=trainable and full_recompute(config, layout),
            # the policy's passes compute the vocabulary only at the response tokens (training/actor.py)
            head_tokens=None if value_model else data.max_response_length,
            adapter_elements_per_layer=lora_elements_per_layer(arr.model.lora, model, mc.tensor_model_parallel_size,
                                                               ep=mc.expert_model_parallel_size,
                                                               etp=mc.expert_tensor_parallel_size)
            if layout.role == Role.ACTOR else 0,
        ))
    return train_mem


def _rollout_memory_warnings(config: JobConfig, resolved: Resolved, model: ModelShape, roll_mem: RolloutMemory,
                             sequences_per_replica: int) -> list[str]:
    """What the rollout's memory means for its waves; a CPU KV cache too small for one sequence refused."""
    arr = config.actor_rollout_ref
    extra = []
    if roll_mem.on_cpu and not roll_mem.fits:  # vLLM would refuse to start: say so before any process
        needed = kv_cache_bytes_needed(model, arr.rollout.tensor_model_parallel_size, dtype=resolved.rollout_dtype,
                                       sequences=1, seq_len=resolved.max_sequence_length)
        raise ConfigError([ConfigIssue(
            "actor_rollout_ref.rollout.cpu_kv_cache_gib", arr.rollout.cpu_kv_cache_gib,
            f"holds {roll_mem.kv_cache_tokens} tokens, less than one {resolved.max_sequence_length}-token "
            f"sequence (max_prompt_length + response length); it must be at least {needed / GIB:.3g} GiB, "
            "or unset to size it for one wave")])
    if sequences_per_replica > arr.rollout.max_num_seqs:
        extra.append(
            f"rollout: actor_rollout_ref.rollout.max_num_seqs={arr.rollout.max_num_seqs} is below the "
            f"{sequences_per_replica} sequences of one replica's step: generation runs in waves"
        )
    elif roll_mem.on_cpu and not roll_mem.one_wave:
        extra.append(
            f"rollout: actor_rollout_ref.rollout.cpu_kv_cache_gib={arr.rollout.cpu_kv_cache_gib:g} holds "
            f"{roll_mem.kv_cache_tokens:,} tokens but one replica's step has {roll_mem.tokens_per_replica_step:,}: "
            "generation runs in waves (slower); leave it unset to size the cache for one wave"
        )
    if not roll_mem.fits:
        extra.append(
            f"rollout: no room for a KV cache of one {resolved.max_sequence_length}-token sequence "
            f"(weights {roll_mem.weights_gib:.1f} GiB per GPU at gpu_memory_utilization="
            f"{arr.rollout.gpu_memory_utilization:g})"
        )
    return extra
