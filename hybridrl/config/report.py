"""The Plan as a one-screen report: meshes, batch arithmetic, memory, resharding."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from hybridrl.config.distillation_rules import FULL_VOCAB_TABLE_LIMIT_BYTES, full_vocab_table_bytes
from hybridrl.config.estimates import GpuMemoryPlan, StageBalance, shares_text, split_text
from hybridrl.config.hardware import load_hardware
from hybridrl.config.internode import plan_internode_traffic
from hybridrl.config.megatron_verdict import moe_aux_loss
from hybridrl.config.meshes import TrainingMesh, expert_groups
from hybridrl.config.model_shapes import role_model_shape
from hybridrl.config.plan import (
    MEMORY_REFUSAL_FIELD,
    TRAINED_ROLES,
    Plan,
    lora_elements_per_layer,
    served_adapter_bytes,
)
from hybridrl.config.resolve import MODEL_SECTIONS, role_megatron_field
from hybridrl.config.search import Found, SearchResult, Sizing, job_command, job_overrides
from hybridrl.config.step_time import StepTime, predict_step_time, seconds_text, step_time_line
from hybridrl.config.verl_default_values import VERL_VERSION
from hybridrl.models.arch import ModelShape
from hybridrl.parallel.device_policy import WITHOUT_TE
from hybridrl.persistence import latest_step
from hybridrl.rewards.registry import AUTO

MIB = 1024**2


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([line(cells[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in cells[1:]])


def _groups(groups: Sequence[Sequence[int]], limit: int = 8) -> str:
    shown = ", ".join("[" + ",".join(map(str, g)) + "]" for g in groups[:limit])
    return f"[{shown}{', …' if len(groups) > limit else ''}]"


def _stage_layers(mesh: TrainingMesh, model: ModelShape | None) -> str:
    """Decoder layers of each PP stage, first to last ("15+15"; "-" without a model)."""
    if model is None:
        return "-"
    return split_text(mesh.layout().stage_layers(model.num_layers))


def _role_shape(plan: Plan, role: str) -> ModelShape | None:
    """The model `role` runs (a critic's, reward model's or teacher's own folder, else the policy's)."""
    return None if plan.model is None else role_model_shape(plan.config, role, plan.model)


def _model_text(model: ModelShape) -> str:
    """A model's shape in one phrase: "LlamaForCausalLM: 0.6M params, 4 layers, hidden 128, heads 4/2 (q/kv), vocab
    96"."""
    return (f"{model.architecture}: {model.param_count() / 1e6:,.1f}M params, {model.num_layers} layers, "
            f"hidden {model.hidden_size}, heads {model.num_attention_heads}/{model.num_kv_heads} (q/kv), "
            f"vocab {model.vocab_size}")


def _correction(rc: Any, rollout: Any) -> str:
    """The plan's words for `algorithm.rollout_correction` ("" when off)."""
    parts = ([f"{rc.is_level} TIS, cap {rc.is_cap:g}"] if rc.is_level != "none" else []) + (
        [f"{rc.mask_level} MIS, band [{rc.mask_low:g}, {rc.mask_high:g}]"] if rc.mask_level != "none" else [])
    if parts and rc.match_truncation:
        parts.append(f"target under top-k {rollout.top_k if rollout.top_k > 0 else 'off'}, top-p {rollout.top_p:g}")
    return f" + rollout correction ({'; '.join(parts)})" if parts else ""


PACKED_ATTENTION = {
    "cpu_stand_in": "the CPU layer's attention stand-in",
    "transformer_engine": "TransformerEngine's attention (the gpu extra installs it; " + WITHOUT_TE + ")",
}


def gpu_memory_lines(memory: GpuMemoryPlan, pool: str = "training") -> list[str]:
    """Each phase of a step on one GPU of `pool`, item by item (every colocated role, the overheads), the
    peak against the GPU with the margin, and vLLM's start-up check."""
    phases = ([memory.startup] if memory.startup else []) + list(memory.phases)
    labels: list[str] = []
    for phase in phases:
        labels += [label for label, _ in phase.items if label not in labels]
    rows = [[label, *[next((f"{gib:.2f}" for name, gib in phase.items if name == label), "")
                      for phase in phases]] for label in labels]
    rows.append(["total", *[f"{phase.total_gib:.2f}" for phase in phases]])
    peak = memory.peak
    verdict = "fits" if memory.peak_gib <= memory.gpu_gib else "DOES NOT FIT"
    lines = [f"GPU memory per phase of a step, estimated (GiB on one {pool} GPU of trainer.gpu_memory_gib="
             f"{memory.gpu_gib:g})",
             table(["item", *[phase.name for phase in phases]], rows),
             f"peak: {peak.name} {peak.total_gib:.2f} + margin {memory.margin_gib:.2f} = {memory.peak_gib:.2f} GiB "
             f"of {memory.gpu_gib:g} — {verdict}"]
    if memory.startup:
        passes = "passes" if memory.startup_fits else "FAILS"
        lines.append(f"vLLM start-up check (free memory >= gpu_memory_utilization x the GPU): the actor's process "
                     f"holds {memory.startup.total_gib:.2f} GiB when the engine is built, at most "
                     f"{memory.startup_limit_gib:.2f} may be held — {passes}")
    lines += [f"({note})" for note in memory.notes]
    return lines


def packing_line(plan: Plan) -> str:
    """Which roles run packed (THD) micro-batches and which of those hold a shared prompt once, and whether the
    user or the device default chose it."""
    active = {lay.role for lay in plan.layouts}
    parts = []
    for name, roles in MODEL_SECTIONS.items():
        mine = [str(r) for r in roles if r in active]
        if not mine:
            continue
        prefix, section = f"{name}.model", getattr(plan.config, name).model
        on = plan.resolved.packed(roles[0])
        why = "set" if section.use_remove_padding is not None else f"default on {plan.resolved.device}"
        adapters = plan.resolved.trains_adapters(roles[0])
        if not on and section.use_remove_padding is None and plan.device_policy.packed_attention is not None:
            why += (", off: LoRA adapters build the actor on megatron's local layer spec, whose attention takes no "
                    "packed sequences" if plan.device_policy.packed_attention_for(adapters) is None
                    else ", off: the MoE dispatcher needs equal-width micro-batches across DP ranks")
        parts.append(f"{'/'.join(mine)} {'packed' if on else 'padded'} ({prefix}.use_remove_padding {why})")
        shared = plan.resolved.shared_prefix(roles[0])
        if on and (shared or section.shared_prefix is not None):  # unset and not served: nothing to say
            how = "set" if section.shared_prefix is not None else f"default on {plan.resolved.device}"
            parts[-1] += f" with {'shared' if shared else 'per-row'} prompts ({prefix}.shared_prefix {how})"
    served = PACKED_ATTENTION.get(plan.device_policy.packed_attention or "", "nothing on this device")
    return f"Sequence packing: {', '.join(parts)}; packed attention: {served}"


def _balance_line(balance: StageBalance) -> str:
    """A pipelined role's FLOP shares per stage, and the best split where it is not the configured one."""
    line = (f"{balance.role} pipeline balance (matmul FLOPs per stage, 1F1B runs at the heaviest's pace): "
            f"{split_text(balance.layers)} layers carry {shares_text(balance.shares)}")
    if balance.best_layers == balance.layers:
        return line + " (the most even split)"
    return (line + f"; {split_text(balance.best_layers)} would carry {shares_text(balance.best_shares)} "
            f"(~{balance.gain:.0%} less pipeline time)")


def lora_line(plan: Plan) -> str:
    """What a LoRA actor trains, and where its reference and the weight sync come from."""
    lora = plan.config.actor_rollout_ref.model.lora
    line = (f"LoRA ({lora.type}, rank {lora.rank}, alpha {lora.alpha:g}) on {', '.join(lora.targets)}: the model "
            "frozen, the fp32 adapters train")
    model = plan.model
    if model is not None:
        per_layer = lora_elements_per_layer(lora, model, 1)  # whole adapters (TP 1)
        total = per_layer * model.num_layers
        line += f" ({total:,} parameters, {100 * total / model.param_count():.2f} % of the model's)"
    if plan.resolved.ref_enabled:
        line += "; the reference is the base with the adapters off (no second model)"
    if plan.resolved.serves_adapters:
        served = served_adapter_bytes(plan)
        moved = f" ({served:,} bytes: the PEFT adapter, to every rollout rank)" if served else ""
        return line + ("; vLLM serves the adapters (merge false): the first sync writes the base as below, each "
                       f"later one moves the adapters alone{moved}")
    return line + "; each weight sync merges them into the served weights (W + alpha/rank B A)"


def distillation_line(plan: Plan) -> str:
    """What on-policy distillation trains on, and what its teacher sends the student each step."""
    settings, res = plan.config.algorithm.distillation, plan.resolved
    mix = ("added to the task reward's advantages" if settings.task_reward else
           "alone (the reward logged, not trained on)")
    if res.distillation_top_k:
        signal = (f"KL(teacher's top-{res.distillation_top_k} || student) a loss term x {settings.kl_coef:g}, {mix}; "
                  f"the teacher sends {res.distillation_top_k} log-probs and ids a position")
    elif res.distillation_full_vocab and plan.model is not None:
        table = full_vocab_table_bytes(plan.config, plan.model)
        signal = (f"KL(student || teacher) over the whole vocabulary a loss term x {settings.kl_coef:g}, {mix}; the "
                  f"teacher sends its log-probs of all {plan.model.vocab_size:,} ids a position: {table / 2**20:,.1f} "
                  f"MiB a step (refused above {FULL_VOCAB_TABLE_LIMIT_BYTES // 2**30} GiB)")
    else:
        signal = f"the sampled token's reverse KL x {settings.kl_coef:g} as its advantage, {mix}"
    teacher = _role_shape(plan, "teacher")
    shape = f" ({_model_text(teacher)})" if teacher is not None else ""
    return f"On-policy distillation from {plan.config.teacher.model.path}{shape}: {signal}"


def step_flops_line(step_flops: tuple[tuple[str, float], ...]) -> str:
    """Where a step's matmul FLOPs go, by phase (the whole job's; a share of compute, not yet of time)."""
    total = sum(flops for _, flops in step_flops)
    shares = ", ".join(f"{phase} {flops / total:.0%}" for phase, flops in step_flops)
    unit, scale = next((u, s) for u, s in (("EFLOP", 1e18), ("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9),
                                           ("FLOP", 1.0)) if total >= s or s == 1.0)
    return (f"Matmul FLOPs per step (whole job, full-length rows): {total / scale:.3g} {unit}: {shares} "
            "(compute, not time: generation is bound by memory reads, not FLOPs)")


def render_plan(plan: Plan) -> str:
    """The plan as `hybridrl plan` prints it: one section after another."""
    cfg = plan.config
    sections = [header_lines(plan), mesh_lines(plan), pool_lines(plan), batch_lines(plan), memory_lines(plan),
                compute_lines(plan), sync_lines(plan), internode_lines(plan), ["", *speed_lines(plan)],
                ["", *failure_cost_lines(cfg.trainer.save_freq, cfg.trainer.max_restarts), resume_line(plan),
                 reward_line(plan)]]
    if plan.warnings:
        sections.append(["", "Warnings:", *(f"  - {w}" for w in plan.warnings)])
    return "\n".join(line for section in sections for line in section)


def reward_line(plan: Plan) -> str:
    """What scores the samples and how: the custom function's call, argument by argument (`Plan.reward_call`), or
    the rule scorer; each call's time limit, the processes that make the calls, and what a failed call scores."""
    algorithm, custom = plan.config.algorithm, plan.config.algorithm.custom_reward_function
    if custom.path:
        how = (f", called once per sample as {plan.reward_call}" if plan.reward_call
               else " (not loaded: --layout-only)")
        scorer = f"{custom.name} from {custom.path}{how}"
    else:
        scorer = f"algorithm.reward_fn={algorithm.reward_fn}" + (
            " (each row by the scorer its data_source names)" if algorithm.reward_fn == AUTO else "")
    if plan.config.reward_model.enable:
        scorer = f"the reward model's score (reward_model.enable); validation rows by {scorer}"
    if custom.timeout_s is None:
        limit = "each call in the trainer's process, without a time limit (timeout_s: null)"
    else:
        where = ("in a process of its own, one call after another" if custom.num_workers == 1 else
                 f"in {custom.num_workers} processes of their own, {custom.num_workers} calls at once")
        limit = (f"each call may take {custom.timeout_s:g} s, {where} (algorithm.custom_reward_function.timeout_s, "
                 "num_workers)")
    failed = (f"scores {custom.fallback_score:g} (fallback_score)" if custom.fallback_score is not None
              else "stops the run naming it (fallback_score: null)")
    return f"Reward: {scorer}; {limit}; a call that raises, returns no number or times out {failed}"


def resume_line(plan: Plan) -> str:
    """Where `train` starts: the checkpoint it resumes from (`Plan.resume`), or a fresh start and why."""
    t, point = plan.config.trainer, plan.resume
    if point is not None:
        how = "the newest complete checkpoint under trainer.default_local_dir" if point.mode == "auto" \
            else "trainer.resume_mode"
        return (f"Resume: from {point.path} at step {point.step} ({how}); "
                "trainer.resume_mode=disable starts fresh" + "".join(f"; {note}" for note in point.notes))
    if t.resume_mode == "disable":
        return "Resume: none, a fresh start (trainer.resume_mode=disable)"
    if t.resume_mode != "auto":  # a path, not checked: `plan --layout-only`
        return f"Resume: from {t.resume_mode} (trainer.resume_mode; not checked: --layout-only)"
    root = t.checkpoint_root
    found = latest_step(root)
    if found is not None:  # only when the files were not checked: `plan --layout-only`
        return f"Resume: from {found} (the newest complete checkpoint; not checked: --layout-only)"
    return f"Resume: none, a fresh start (no complete checkpoint under {root}; trainer.resume_mode=auto)"


def header_lines(plan: Plan) -> list[str]:
    """The job: its model, its cluster, its algorithm."""
    cfg, res, model = plan.config, plan.resolved, plan.model
    arr = cfg.actor_rollout_ref
    model_line = _model_text(model) if model else "unknown (no config.json at the model path)"
    notes = model.reading_notes() if model else []
    return [
        f"hybridrl plan — {cfg.trainer.project_name}/{cfg.trainer.experiment_name}",
        f"  model:   {arr.model.path or '<none>'} — {model_line}",
        *([f"           config.json: {'; '.join(notes)}"] if notes else []),
        f"  cluster: {cfg.trainer.nnodes} node(s) × {cfg.trainer.n_gpus_per_node} {cfg.trainer.device} "
        f"devices = world size {res.world_size}; algorithm {cfg.algorithm.adv_estimator}"
        f"{' + critic' if res.critic_enabled else ''}{' + ref' if res.ref_enabled else ''}"
        f"{_correction(cfg.algorithm.rollout_correction, arr.rollout)}",
        *verl_defaults_lines(plan),
        "",
    ]


def verl_defaults_lines(plan: Plan) -> list[str]:
    """One line for a whole verl config's keys at verl's defaults (`config/verl_defaults.py`): how many were taken
    as changing nothing and where they are listed; none for a config without any."""
    taken, targets = len(plan.verl_defaults_taken), len(plan.verl_targets_ignored)
    if not taken and not targets:
        return []
    return [f"  verl:    {taken} key(s) without a hybridrl field at verl {VERL_VERSION}'s defaults taken (they change "
            f"nothing here), {targets} Hydra _target_ entries ignored; listed in `hybridrl plan --format json` "
            "(verl_defaults_taken, verl_targets_ignored)"]


def moe_aux_loss_lines(plan: Plan) -> list[str]:
    """Each trained MoE role's router load-balancing loss, and whether the job or config.json decided it."""
    if plan.model is None:
        return []
    out = []
    for lay in plan.layouts:
        if lay.role not in TRAINED_ROLES:
            continue
        shape = role_model_shape(plan.config, lay.role, plan.model)
        if not shape.is_moe:
            continue
        coeff, why = moe_aux_loss(lay.megatron, shape)
        kind = lay.megatron.moe_router_load_balancing_type
        loss = f"{kind} × {coeff:g}" if coeff > 0 else "off"
        out.append(f"{lay.role} MoE load-balancing loss: {loss} ({why}; "
                   f"{role_megatron_field(plan.config, lay.role)}.moe_aux_loss_coeff sets it)")
    return out


def mesh_lines(plan: Plan) -> list[str]:
    """Each role's training mesh and its groups, experts, stage balance, packing, and what LoRA and distillation
    train on."""
    out = ["Training meshes (megatron order tp-cp-dp-pp; DP = world ÷ (TP·PP·CP))", table(
        ["role", "TP", "PP", "VPP", "CP", "DP", "layers per stage", "TP groups", "PP groups", "DP groups"],
        [[lay.role, lay.mesh.tp, lay.mesh.pp, lay.mesh.vpp or "-", lay.mesh.cp, lay.mesh.dp,
          _stage_layers(lay.mesh, _role_shape(plan, lay.role)),
          _groups(lay.mesh.tp_groups, 3), _groups(lay.mesh.pp_groups, 3), _groups(lay.mesh.dp_groups, 3)]
         for lay in plan.layouts],
    )]
    for lay in plan.layouts:
        ep, etp = lay.megatron.expert_model_parallel_size, lay.megatron.expert_tensor_parallel_size
        etp = lay.mesh.tp if etp is None else etp
        if isinstance(ep, int) and (ep > 1 or etp != lay.mesh.tp):
            ep_groups, edp_groups = expert_groups(lay.mesh, ep, etp)
            expert_tp = "expert TP = TP" if etp == lay.mesh.tp else f"expert TP {etp}"
            out.append(f"{lay.role} experts (megatron order etp-ep-edp-pp, {expert_tp}): EP {ep} × expert-DP "
                       f"{len(edp_groups[0])}; EP groups {_groups(ep_groups, 4)}; expert-DP groups "
                       f"{_groups(edp_groups, 4)}")
    out += moe_aux_loss_lines(plan)
    out += [_balance_line(balance) for balance in plan.stage_balance]
    out.append(packing_line(plan))
    if plan.resolved.lora_rank > 0:
        out.append(lora_line(plan))
    if plan.config.algorithm.distillation.enable:
        out.append(distillation_line(plan))
    return out


def pool_lines(plan: Plan) -> list[str]:
    """Where vLLM runs (the training ranks' replicas, or a pool of its own and its async mode), and a teacher's own
    pool."""
    cfg, res = plan.config, plan.resolved
    rollout = plan.reshard.groups.rollout
    if res.disaggregated:
        r = cfg.actor_rollout_ref.rollout
        out = ["", f"Rollout pool (vLLM, disaggregated): {r.nnodes} node(s) × {r.n_gpus_per_node} = "
                   f"{res.rollout_world} ranks of its own beside the trainer's {res.world_size}; "
                   f"{rollout.infer_dp} replicas × infer_tp {rollout.infer_tp}: {_groups(rollout.replicas, 12)} "
                   "(pool ranks)", _async_line(res), ""]
    else:
        out = ["", f"Rollout mesh (vLLM): {rollout.infer_dp} replicas × infer_tp {rollout.infer_tp}: "
                   f"{_groups(rollout.replicas, 12)}", ""]
    if res.teacher_world:
        teacher = cfg.teacher
        out += [f"Teacher pool (disaggregated): {teacher.nnodes} node(s) × {teacher.n_gpus_per_node} = "
                f"{res.teacher_world} ranks of its own (the teacher's mesh above spans them); each step's sequences "
                "go to it and its log-probs come back", ""]
    return out


def batch_lines(plan: Plan) -> list[str]:
    """A step's batch arithmetic, from prompts to micro-batches, and the token budget."""
    n = plan.config.actor_rollout_ref.rollout.n
    rollout = plan.reshard.groups.rollout
    rows = [
        ["prompts per step", "data.train_batch_size", plan.prompts_per_step],
        ["sequences per step", f"{plan.prompts_per_step} prompts × rollout.n {n}", plan.sequences_per_step],
        ["prompts per rollout replica", f"{plan.prompts_per_step} ÷ {rollout.infer_dp} replicas",
         plan.prompts_per_rollout_replica],
        ["sequences per rollout replica", f"{plan.prompts_per_rollout_replica} × n {n}",
         plan.sequences_per_rollout_replica],
    ]
    for up in plan.updates:
        dp = plan.layout(up.role).mesh.dp
        rows += [
            [f"{up.role}: mini-batches per step", f"{plan.prompts_per_step} ÷ mini {up.mini_batch_prompts}",
             up.mini_batches_per_step],
            [f"{up.role}: sequences per GPU per mini-batch", f"{up.mini_batch_prompts} × n {n} ÷ DP {dp}",
             up.sequences_per_rank_per_mini_batch],
            [f"{up.role}: grad-accumulation micro-batches",
             "dynamic (token budget)" if up.dynamic_batching else
             f"{up.sequences_per_rank_per_mini_batch} ÷ micro {up.micro_batch_size}",
             "dyn" if up.dynamic_batching else up.grad_accum_steps],
            [f"{up.role}: optimizer steps per step", f"{up.mini_batches_per_step} × ppo_epochs {up.ppo_epochs}",
             up.optimizer_steps_per_step],
        ]
    for fw in plan.forwards:
        if fw.pass_name == "old_log_prob" and not plan.resolved.old_log_prob_pass:
            why = ("1 optimizer step on fresh data: the update's forward" if plan.resolved.async_mode == "sync" else
                   "1 optimizer step: the update's forward is the proximal policy (vLLM's log-probs: the behaviour)")
            rows.append([f"{fw.role}: {fw.pass_name} pass", why, "skipped"])
            continue
        rows.append([f"{fw.role}: {fw.pass_name} micro-batches per GPU",
                     f"{fw.sequences_per_rank} seqs ÷ micro {fw.micro_batch_size}", fw.micro_batches_per_rank])
    return ["Batch arithmetic per step", table(["quantity", "from", "value"], rows), "", *token_budget_lines(plan)]


def memory_lines(plan: Plan) -> list[str]:
    """Each role's memory per GPU (per pipeline stage where it differs), the rollout's, and the GPU's phases."""
    if not plan.training_memory:
        return []
    cfg = plan.config
    out = ["", f"Memory per GPU, estimated (GiB; fits in trainer.gpu_memory_gib={cfg.trainer.gpu_memory_gib:g}?)",
           table(["role", "params", "grads", "optim", "optim w/o dist-opt", "act/micro", "act in flight", "total",
                  "fits"],
                 [[m.role, f"{m.params_gib:.2f}", f"{m.grads_gib:.2f}", f"{m.optimizer_gib:.2f}",
                   f"{m.optimizer_gib_without_distributed:.2f}", f"{m.activations_gib_per_micro_batch:.2f}",
                   f"{m.activations_gib_in_flight:.2f}", f"{m.total_gib:.2f}", "yes" if m.fits else "NO"]
                  for m in plan.training_memory])]
    for m in plan.training_memory:
        if len(m.stages) > 1:  # the row above is the heaviest stage's GPU
            out.append(f"{m.role} per pipeline stage (layers: params / total GiB): " + ", ".join(
                f"stage {s.stage} ({s.layers}): {s.params_gib:.2f} / {s.total_gib:.2f}" for s in m.stages))
    rm = plan.rollout_memory
    if rm:
        waves = "fits in one wave" if rm.one_wave else "runs in waves"
        cache = (f"{rm.kv_cache_bytes / 2**20:,.1f} MiB per rank (CPU: rollout.cpu_kv_cache_gib)" if rm.on_cpu
                 else f"{rm.kv_cache_gib:.2f} GiB")
        out.append(
            f"rollout: weights {rm.weights_gib:.2f} GiB/GPU, KV cache {cache} = "
            f"{rm.kv_cache_tokens:,} tokens ({rm.kv_bytes_per_token} B/token); one replica's step needs "
            f"{rm.tokens_per_replica_step:,} tokens ({waves})"
        )
    if plan.gpu_memory and plan.device_policy.gpu_memory_budget_binding:  # GPU memory: a GPU job's
        out += ["", *gpu_memory_lines(plan.gpu_memory)]
    if plan.teacher_gpu_memory and plan.device_policy.gpu_memory_budget_binding:
        out += ["", *gpu_memory_lines(plan.teacher_gpu_memory, pool="teacher-pool")]
    return out


def compute_lines(plan: Plan) -> list[str]:
    """Where a step's matmul FLOPs go, and its predicted time on `trainer.hardware`."""
    out = ["", step_flops_line(plan.step_flops)] if plan.step_flops else []
    if plan.config.trainer.hardware is not None:
        step = predict_step_time(plan, load_hardware(plan.config.trainer.hardware))
        out += [step_time_line(step) if step else "Predicted step time: needs the model's config.json (its shape)"]
    return out


def sync_lines(plan: Plan) -> list[str]:
    """The weight sync: across the pools, or the resharder's groups and what each rank receives."""
    groups = plan.reshard.groups
    cross = plan.reshard.cross_pool
    if plan.resolved.disaggregated:
        out = ["", "Weight sync across the pools (a group spanning both; every vLLM rank receives its shard once, "
                   "straight from training ranks that hold each range; the least-loaded holder sends)"]
        if cross:
            out.append(f"each rollout rank receives {cross.bytes_received[0] / MIB:,.1f} MiB (its whole shard: it "
                       f"holds nothing); the trainer ranks send {cross.total_bytes / MIB:,.1f} MiB in all, "
                       f"{cross.bytes_sent_even / MIB:,.1f} MiB each if spread evenly; model "
                       f"{cross.model_bytes / MIB:,.1f} MiB in {plan.reshard.dtype}")
    else:
        out = ["", f"Resharding (HybridFlow §5, {groups.strategy} generation TP groups): micro-DP size "
                   f"{groups.micro_dp_size}, groups {_groups(groups.micro_dp_groups, 6)}"]
    traffic = plan.reshard.traffic
    if traffic:
        rows = [[r, f"{traffic.bytes_received[r] / MIB:,.1f}", f"{traffic.lower_bound[r] / MIB:,.1f}",
                 f"{traffic.naive_gather_all[r] / MIB:,.1f}", f"{traffic.generation_shard_bytes[r] / MIB:,.1f}"]
                for r in range(min(len(traffic.bytes_received), 16))]
        out.append(table(["rank", "receives MiB", "lower bound", "naive gather-all", "gen shard"], rows))
        if len(traffic.bytes_received) > 16:
            out.append(f"(first 16 of {len(traffic.bytes_received)} ranks; max received "
                       f"{max(traffic.bytes_received) / MIB:,.1f} MiB)")
        total_naive = sum(traffic.naive_gather_all)
        out.append(
            f"total received {sum(traffic.bytes_received) / MIB:,.1f} MiB "
            f"(×{traffic.ratio_to_lower_bound:.2f} the lower bound) vs naive {total_naive / MIB:,.1f} MiB; "
            f"model {traffic.model_bytes / MIB:,.1f} MiB in {plan.reshard.dtype}"
        )
    return out


def internode_lines(plan: Plan) -> list[str]:
    """On more than one node: what each node sends the others per step, by phase (`config.internode`, every
    sequence at full length; measured against a real link in docs/performance.md)."""
    traffic = plan_internode_traffic(plan)
    if traffic is None:
        return []
    shown = min(traffic.nodes, 8)
    rows = [[phase, *(f"{sent[node] / MIB:,.2f}" for node in range(shown))]
            for phase, sent in traffic.phases.items()]
    rows.append(["step", *(f"{total / MIB:,.2f}" for total in traffic.total()[:shown])])
    more = f" (first {shown} of {traffic.nodes} nodes)" if traffic.nodes > shown else ""
    return ["", f"Traffic between nodes per step, MiB each node sends (every sequence at full length; gradient "
                f"all-reduce, pipeline activations, weight sync; not Ray's calls){more}",
            table(["phase", *(f"node {n}" for n in range(shown))], rows)]


def token_budget_lines(plan: Plan) -> list[str]:
    """The plan's `TokenBudget`: the sequence's parts and, with multi-turn rollouts, how the response
    splits into the model's turns and tool observations."""
    tb, cfg = plan.token_budget, plan.config
    response_from = ("actor_rollout_ref.rollout.response_length" if cfg.actor_rollout_ref.rollout.response_length
                     is not None else "data.max_response_length")
    what = "model turns + tool observations" if tb.multi_turn else "the model's answer"
    rows: list[list[Any]] = [
        ["prompt", "data.max_prompt_length", tb.prompt_tokens],
        [f"response ({what})", response_from, tb.response_tokens],
        ["sequence", f"{tb.prompt_tokens} + {tb.response_tokens}", tb.sequence_tokens],
    ]
    lines = ["Tokens per sequence (the model's length, the KV cache, every training pass and the memory "
             "estimate cover the whole sequence)"]
    if tb.multi_turn:
        mt = "actor_rollout_ref.rollout.multi_turn"
        rows += [
            ["model turns per sample, at most",
             f"{mt}.max_turns" if cfg.actor_rollout_ref.rollout.multi_turn.max_turns is not None
             else "max_turns null: the response tokens (a model turn writes >= 1 token)", tb.max_turns],
            ["tool answers per sample, at most", f"max_turns {tb.max_turns} - 1 (the last turn's calls are not run)",
             tb.max_tool_rounds],
            ["model tokens per sample, at most", "the whole response (no tool call)", tb.max_model_tokens],
            ["observation tokens per sample, at most",
             f"{tb.response_tokens} - 1 (a model turn writes >= 1 token)" if tb.max_tool_rounds else "no tool round",
             tb.max_observation_tokens],
            ["one tool answer, at most (characters)",
             f"{mt}.max_observation_chars, + a truncation note (cut: "
             f"{cfg.actor_rollout_ref.rollout.multi_turn.observation_truncate_side})",
             tb.max_observation_chars],
        ]
    lines.append(table(["quantity", "from", "value"], rows))
    if tb.multi_turn:
        lines += [
            f"Observation tokens (the chat template's tool messages) share the {tb.response_tokens}-token response "
            "budget with the model's turns:",
            "a conversation that reaches it ends (multi_turn/finish_length_mean). Every training pass computes them "
            "like the model's tokens;",
            "the loss, KL and entropy leave them out (response_mask 0). In tokens, a tool answer of N characters is N "
            "with a character",
            "tokenizer and usually fewer with BPE (more for non-ASCII text with byte-level BPE).",
        ]
    return lines


def _async_line(res: Any) -> str:
    """What rollout.async_mode does in this plan, in one line."""
    if res.async_mode == "one_step_off":
        return ("async: one_step_off — the pool generates step k+1's samples while step k trains; each batch is "
                "one weight version old when trained (the rollout's log-probs are its behaviour policy)")
    if res.async_mode == "fully_async":
        partial = ("requests in flight at a sync pause and continue under the new weights, each token tagged with "
                   "its version" if res.partial_rollout else "requests in flight finish on the old weights first")
        return (f"async: fully_async — the pool generates continuously into a buffer; a sample more than "
                f"{res.max_staleness} version(s) behind when trained is "
                f"{'dropped' if res.stale_samples == 'drop' else 'kept'} (counted); {partial}")
    return "async: sync — generate, then train, then sync (the pools take turns)"


def failure_cost_lines(save_freq: int, max_restarts: int, step_s: float | None = None) -> list[str]:
    """What a worker failure costs at this checkpoint cadence: the steps since the last checkpoint are
    run again, S/2 on average and S at most for trainer.save_freq = S (a failure strikes anywhere
    between two checkpoints); `step_s` (a measured step time) turns steps into seconds."""
    def seconds(steps: float) -> str:
        return f" ≈ {steps * step_s:,.0f} s" if step_s else ""

    then = (f"the workers restart in place from the last checkpoint (trainer.max_restarts={max_restarts})"
            if max_restarts else "the run stops; `trainer.resume_mode=auto` continues from the last checkpoint "
            "(trainer.max_restarts=0)")
    if save_freq > 0:
        cost = (f"a failure re-runs the steps since the last checkpoint: on average save_freq/2 = "
                f"{save_freq / 2:g} steps{seconds(save_freq / 2)}, at most {save_freq}{seconds(save_freq)}")
    else:
        cost = "a failure loses every step since the start (trainer.save_freq=-1: no checkpoints)"
    return [f"On a worker failure {then}; {cost}."]


def speed_lines(plan: Plan) -> list[str]:
    """Which of megatron's fusions and overlaps each role runs with, and why any is off
    (`hybridrl.parallel.speed_settings`; override_transformer_config / override_ddp_config change them)."""
    if not plan.device_policy.megatron_speed_defaults:
        return [f"Fusions and overlaps: none on trainer.device={plan.resolved.device} (megatron's CPU layer; the "
                "fused CUDA kernels and NCCL's overlapped collectives apply on cuda)"]
    out = ["Fusions and overlaps (megatron; override_transformer_config / override_ddp_config turn one off or on)"]
    for layout in plan.layouts:
        settings = plan.speed_settings(layout.role)
        on = [s.name for s in settings if s.on]
        out.append(f"  {layout.role}: on {', '.join(on) if on else 'none'}")
        out += [f"    off {s.name}: {s.why}" for s in settings if not s.on]
    return out


SAVER_NAMES = ("grads freed", "moments offloaded", "recompute")


def _placement(found: Found) -> str:
    layout = found.layout
    if not layout.rollout_gpus:
        return "colocated"
    return f"rollout pool {layout.rollout_gpus} GPUs, {layout.async_mode}"


def _why(better: StepTime, other: StepTime, other_name: str) -> str:
    """What `better` gains over `other`: the phase that saves the most."""
    phases = {p.phase for p in better.phases} | {p.phase for p in other.phases}
    phase = max(phases, key=lambda name: other.phase(name) - better.phase(name))
    gain = other.seconds - better.seconds
    overlap = " (generation beside training)" if better.overlapped and not other.overlapped else ""
    return (f"{seconds_text(gain)} faster than {other_name}{overlap}: {phase} {seconds_text(better.phase(phase))} "
            f"against {seconds_text(other.phase(phase))}")


def render_search(result: SearchResult, config_path: str | None, overrides: Sequence[str] = (), top: int = 5) -> str:
    """`hybridrl plan --search` of the job at `config_path` with `overrides`: the fastest layouts, why each is ahead
    of the next, the job's own among them, and the fastest as a command."""
    shown = result.ranked[:top]
    refused = ", ".join(f"{field} {count}" for field, count in result.refused[:6])
    out = [
        f"hybridrl plan --search on {result.hardware}: {result.total_gpus} GPUs; {result.layouts} layouts "
        f"({result.planned} plans with their memory savers) in {result.seconds:.2f} s; {len(result.ranked)} plan, "
        f"{result.layouts - len(result.ranked)} refused (by the field refused first: {refused or 'none'})",
        "Ranked by the predicted step time (a roofline at stated efficiencies, `hybridrl plan` explains it); the "
        "cluster, model, batch and lengths are the job's",
        "",
    ]
    if not shown:
        over_memory = dict(result.refused).get(MEMORY_REFUSAL_FIELD, 0)
        out.append(f"No layout plans: {over_memory} of the {result.layouts} layouts do not fit the GPUs' memory "
                   f"({MEMORY_REFUSAL_FIELD}) with any memory saver, and each of the others breaks a rule; more GPUs "
                   "may fit it (`--target-step-time SECONDS` searches larger clusters)." if over_memory else
                   "No layout plans: the job's own problems (`hybridrl plan` lists them) come before its layout.")
        return "\n".join(out)
    rows = [[f"#{i + 1}", seconds_text(f.step.seconds), f"{f.layout.train_tp}x{f.layout.train_pp}x{f.train_dp}",
             f"{f.layout.rollout_tp}x{f.rollout_replicas}", _placement(f),
             ", ".join(name for name, on in zip(SAVER_NAMES, f.savers) if on) or "-", f"{f.peak_gib:.1f}",
             seconds_text(f.step.phase("gen"))] for i, f in enumerate(shown)]
    out.append(table(["rank", "step", "train TPxPPxDP", "vLLM TPxreplicas", "placement", "memory savers",
                      "peak GiB", "generation"], rows))
    out.append("")
    for i, found in enumerate(shown):
        if i + 1 < len(result.ranked):
            out.append(f"#{i + 1}: {_why(found.step, result.ranked[i + 1].step, f'#{i + 2}')}")
    written = result.written
    if written is not None:
        place = sum(f.step.seconds < written.step.seconds for f in result.ranked) + 1
        out.append(f"the job as written: {seconds_text(written.step.seconds)} (#{place} of {len(result.ranked)}); "
                   + (_why(shown[0].step, written.step, "it") if shown[0].step.seconds < written.step.seconds
                      else "nothing found is faster"))
    else:
        out.append("the job as written does not plan (`hybridrl plan --layout-only` of it says why): every layout "
                   "above is one that does")
    out += ["", f"#1 as a job: {job_command(config_path, overrides, shown[0])}"]
    return "\n".join(out)


def search_json(result: SearchResult, config_path: str | None, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """`hybridrl plan --search --format json`: the result's fields, and each ranked layout's `job_overrides` (the
    user's overrides with the layout's, what `train` takes after the config) and `command` (its `hybridrl plan`
    line, as the text report's "#1 as a job"), so a script needs no second step to run what it picked."""
    out = dataclasses.asdict(result)
    for row, found in zip(out["ranked"], result.ranked):
        row["job_overrides"] = job_overrides(overrides, found)
        row["command"] = job_command(config_path, overrides, found)
    return out


def sizing_json(sizing: Sizing, config_path: str | None, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """`hybridrl plan --search --target-step-time S --format json`: each cluster tried as `search_json` writes it;
    `smallest` as the one meeting S (its ranked layouts carry their commands), or None."""
    results = [search_json(result, config_path, overrides) for result in sizing.results]
    smallest = next((row for row, result in zip(results, sizing.results) if result is sizing.smallest), None)
    return {"target_s": sizing.target_s, "results": results, "smallest": smallest}


def render_sizing(sizing: Sizing, config_path: str | None, overrides: Sequence[str] = ()) -> str:
    """`hybridrl plan --search --target-step-time S` of the job at `config_path` with `overrides`: each cluster tried,
    its best layout, the smallest that meets S as a command."""
    rows = []
    for result in sizing.results:
        best = result.ranked[0] if result.ranked else None
        rows.append([result.total_gpus, seconds_text(best.step.seconds) if best else "no layout plans",
                     f"{best.layout.train_tp}x{best.layout.train_pp}x{best.train_dp}" if best else "-",
                     f"{best.layout.rollout_tp}x{best.rollout_replicas}" if best else "-",
                     _placement(best) if best else "-", len(result.ranked), f"{result.seconds:.2f} s"])
    out = [f"hybridrl plan --search --target-step-time {sizing.target_s:g}: the smallest cluster of "
           f"{sizing.results[0].hardware if sizing.results else '?'} GPUs whose best layout predicts a step of at most "
           f"{seconds_text(sizing.target_s)} (the job's model, batch and lengths)", "",
           table(["GPUs", "best step", "train TPxPPxDP", "vLLM TPxreplicas", "placement", "layouts that plan",
                  "search"], rows), ""]
    smallest = sizing.smallest
    if smallest is None:
        out.append(f"none of these clusters meets {seconds_text(sizing.target_s)}: the largest tried predicts "
                   + (seconds_text(sizing.results[-1].ranked[0].step.seconds) if sizing.results
                      and sizing.results[-1].ranked else "nothing"))
    else:
        out.append(f"{smallest.total_gpus} GPUs: {job_command(config_path, overrides, smallest.ranked[0])}")
    return "\n".join(out)
