"""The rules of LoRA adapters on the actor at plan time (`actor_rollout_ref.model.lora`, verl's keys); the
unbuilt options a single field decides are in `config.refusals`. Torch-free; called by `config.validate`."""
from __future__ import annotations

from hybridrl.config.checker import Checker
from hybridrl.config.refusals import LORA
from hybridrl.config.schema import REF_DEFAULTS_TO_ACTOR, JobConfig
from hybridrl.models.arch import ModelShape
from hybridrl.models.lora_targets import TARGETS, VLLM_LORA_RANKS
from hybridrl.parallel.device_policy import ADAPTERS_ON_LOCAL_SPEC, DEVICE_POLICIES


def check_lora(check: Checker, config: JobConfig, model: ModelShape | None) -> None:
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
                if name == "all-linear":  # peft's and verl's FSDP value (read as [] from verl's FSDP key)
                    check.fail(field, name, "is peft's every linear layer; here that is every target of the type: "
                               "leave target_modules empty ([]) or list them", valid)
                elif "*" in str(name) or "." in str(name):
                    check.fail(field, name, "per-layer patterns are not supported yet: name whole layer kinds", valid)
                elif name not in valid and (holders := [t for t, hf in TARGETS[lora.type].items() if name in hf]):
                    # verl's FSDP path (peft) names Hugging Face projections; megatron's layers hold them
                    check.fail(field, name, f"is a Hugging Face projection; {lora.type} adapters name megatron's "
                               f"layers: {name} is in {holders[0]} (all-linear: leave target_modules empty)", valid)
                else:
                    check.one_of(field, name, valid, f"{lora.type} target")
        if lora.exclude_modules and lora.target_modules:
            check.fail(f"{LORA}.exclude_modules", lora.exclude_modules,
                       "needs target_modules empty (adapt every layer kind but these), as in verl", [])
        elif not lora.target_modules and set(lora.exclude_modules) >= set(valid):
            check.fail(f"{LORA}.target_modules", lora.target_modules, "adapts nothing: name the layers to adapt",
                       valid)
    if model is not None and model.is_moe:
        _check_expert_adapters(check, config, model)
    policy = DEVICE_POLICIES.get(config.trainer.device)
    if policy is not None and policy.adapters_change_spec:
        _check_local_spec(check, config)
    ref = config.actor_rollout_ref.ref.megatron
    if ref is not None and ref.param_offload:
        check.fail("actor_rollout_ref.ref.megatron.param_offload", True, f"with {LORA}.rank > 0 the reference is the "
                   "actor's own frozen base with the adapters off: it has no weights of its own to offload", [False])
    if ref is not None:  # (its layout fields must equal the actor's in any job: `validate`)
        actor = config.actor_rollout_ref.actor.megatron
        for name in REF_DEFAULTS_TO_ACTOR:
            mine, theirs = getattr(ref, name), getattr(actor, name)
            if mine != theirs:
                check.fail(f"actor_rollout_ref.ref.megatron.{name}", mine, f"with {LORA}.rank > 0 the reference is the "
                           "actor's own model with the adapters off, which runs with the actor's settings: leave it "
                           f"unset or equal to actor_rollout_ref.actor.megatron.{name}={theirs!r}", [theirs])
    if lora.merge is False:
        if isinstance(lora.rank, int) and lora.rank > VLLM_LORA_RANKS[-1]:
            check.fail(f"{LORA}.rank", lora.rank, f"vLLM serves adapters of rank <= {VLLM_LORA_RANKS[-1]}; with a "
                       f"higher rank set {LORA}.merge true (merged syncs)", [VLLM_LORA_RANKS[-1]])


def _check_local_spec(check: Checker, config: JobConfig) -> None:
    """On GPUs the adapters' model is megatron's local layer spec (`layer_spec_kind`): packed sequences, which its
    attention does not take, refused here if the job sets them, rather than at the workers' start-up."""
    if config.actor_rollout_ref.model.use_remove_padding:
        check.fail("actor_rollout_ref.model.use_remove_padding", True, f"with {LORA}.rank > 0 on "
                   f"{config.trainer.device}: {ADAPTERS_ON_LOCAL_SPEC}; set false, or leave it unset (then padded)",
                   [False, None])


def _check_expert_adapters(check: Checker, config: JobConfig, model: ModelShape) -> None:
    """Adapters on an MoE model's routed experts (`models.lora`): one per expert, of type lora, at any expert TP and
    EP; merged into the weights at each sync."""
    lora = config.actor_rollout_ref.model.lora
    expert_targets = sorted(set(lora.targets) & {"linear_fc1", "linear_fc2", "linear_fc1_gate", "linear_fc1_up"})
    if not expert_targets:
        return  # the attention alone: nothing on the experts
    experts = f"adapters on {model.architecture}'s experts ({', '.join(expert_targets)})"
    if lora.type != "lora":
        check.fail(f"{LORA}.type", lora.type, f"{experts}: one adapter per expert whose gate and up share an A "
                   "(type lora, as peft's adapter on the stacked gate_up_proj) is built", ["lora"])
    if lora.dropout:
        check.fail(f"{LORA}.dropout", lora.dropout, f"{experts}: peft's adapters on stacked expert weights take "
                   "no dropout, so an exported adapter would not load", [0.0])
    if len(model.moe_layers) < model.num_layers:
        dense = [i for i in range(model.num_layers) if i not in model.moe_layers]
        check.warnings.append(
            f"{LORA}: layers {dense} of {model.architecture} are dense MLPs among MoE layers; peft 0.21 loading the "
            "checkpoint's PEFT folder onto transformers 5 drops those layers' MLP adapters (measured: their output "
            "unchanged), so load it with the merged export (trainer.export_hf_on_save, hybridrl convert), which "
            "holds them")
    if lora.merge is False:
        check.fail(f"{LORA}.merge", False, f"{experts}: vLLM serving adapters on experts is not built; merged "
                   "syncs are", [True])
