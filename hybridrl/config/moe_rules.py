"""The rules of mixture-of-experts models at plan time: expert parallelism and the expert TP, the token
dispatcher and its capacity, routing replay. Torch-free; called by `config.validate`."""
from __future__ import annotations

import typing

from hybridrl.config.checker import Checker, divisors
from hybridrl.config.megatron_rules import megatron_sections, model_section_beside
from hybridrl.config.resolve import needs_uniform_micro_batches
from hybridrl.config.schema import JobConfig, MegatronConfig, MoEDispatcher, MoEDropPolicy
from hybridrl.models.arch import ModelShape
from hybridrl.parallel.device_policy import DEVICE_POLICIES


def check_router_replay(check: Checker, config: JobConfig, model: ModelShape | None) -> None:
    mode = config.actor_rollout_ref.actor.router_replay
    if mode != "rollout":
        return  # "none", or an unknown value (reported by validate._check_names)
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


def check_experts(check: Checker, prefix: str, mc: MegatronConfig, tp: int, cp: int, dp: int,
                   model: ModelShape | None) -> bool:
    """Expert-parallel rules (MoE models): megatron's expert mesh, EP × expert TP, tiles the DP × CP × TP
    ranks of a pipeline stage (an expert TP other than TP: experts split over fewer ranks than the dense
    layers, e.g. TP 4 × ETP 1 as verl's MoE scripts run, or over DP ranks of the dense layers at TP 1)."""
    ep, etp = mc.expert_model_parallel_size, mc.expert_tensor_parallel_size
    if mc.moe_aux_loss_coeff is not None:  # null: config.json's (`megatron_verdict.moe_aux_loss`)
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


def check_moe_dispatch(check: Checker, config: JobConfig, model: ModelShape | None) -> None:
    """The token dispatcher and the expert capacity of each megatron section (megatron-core 0.16.1's
    rules first, then what the workers can feed them)."""
    for prefix, mc in megatron_sections(config):
        known = (mc.moe_token_dispatcher_type in typing.get_args(MoEDispatcher)
                 and mc.moe_token_drop_policy in typing.get_args(MoEDropPolicy))
        if not known:
            continue  # an unknown name: reported by validate._check_names
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
        model_prefix, model_section = model_section_beside(config, prefix)
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


def check_expert_tp_uses(check: Checker, config: JobConfig) -> None:
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
