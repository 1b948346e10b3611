"""One role's megatron backend on one rank: parallel state, model chunks, DDP, optimizer, LR schedule,
and the two ways to run micro-batches through megatron's pipeline schedule.

`MegatronBackend(spec)` on every rank of the role's group:
  1. megatron parallel state for the role's mesh (`hybridrl.parallel.state`; on CPU that installs the
     CPU layer). Roles sharing a process (actor + ref) must share the layout: megatron's parallel
     state is process-global.
  2. this rank's GPTModel chunks (one per VPP stage) from the bridge, weights loaded; value models
     (critic, reward model) get a scalar head (`value_head`).
  3. trainable roles: megatron `DistributedDataParallel` per chunk, with `finalize_model_grads_func`
     and `no_sync_func` set on the shared config (without them DP replicas silently drift apart),
     `get_megatron_optimizer` (plain or distributed), grad clipping, and `LRSchedule`.
     Frozen roles (ref, reward model): eval mode, no grads, parameters offloadable.

`forward_only(micro_batches, collect)` and `train_step(micro_batches, loss_fn)` run a list of
`ModelInputs` through `get_forward_backward_func()` (1F1B, interleaved with VPP, or no pipelining).
Micro-batches may differ in rows and length (padding is trimmed per micro-batch), so the config
sets `variable_seq_lengths=True`: pipeline stages exchange each activation's shape first.

The loss function given to `train_step` must return the *scaled* loss (see
`hybridrl.algorithms.aggregation`): `aggregate_loss(...) * num_microbatches * dp_size`.
"""
from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from hybridrl.config.megatron_verdict import megatron_settings, role_transformer_settings
from hybridrl.config.plan import Plan
from hybridrl.config.resolve import needs_uniform_micro_batches
from hybridrl.config.schema import LoraConfig, MegatronConfig, OptimConfig
from hybridrl.models.bridge import ModelSource, build_gpt_models, load_weights
from hybridrl.models.lora import LoraSettings, add_lora, load_lora_state, read_peft_adapter
from hybridrl.names import Role
from hybridrl.parallel import state
from hybridrl.parallel.context_parallel import gather_from_cp, split_for_cp_rank
from hybridrl.parallel.device import (
    apex_wgrad_available,
    collective_device,
    default_dtype_for,
    layer_spec_kind,
    te_available,
    to_rank_device,
)
from hybridrl.parallel.device_policy import ADAPTERS_ON_LOCAL_SPEC, WITHOUT_TE, DevicePolicy
from hybridrl.parallel.speed_settings import ddp_values, speed_settings, transformer_values
from hybridrl.training.lr_schedule import LRSchedule
from hybridrl.training.micro_batching import Partition, partition_rows
from hybridrl.training.moe_capacity import without_capacity
from hybridrl.training.nonfinite import step_is_finite
from hybridrl.training.offload import (
    OptimizerStateOffload,
    ParamStorageOffload,
    offload_grad_buffers,
    restore_grad_buffers,
)
from hybridrl.training.router_replay import ReplayMismatch, chunk_routing, moe_routers, replaying
from hybridrl.training.sequences import ModelInputs, micro_batch_inputs, prompt_groups
from hybridrl.training.value_head import attach_value_head, load_value_model, value_model_source

# megatron disables clipping with clip_grad=0 and then reports no grad norm; a bound no real norm
# reaches keeps the norm computed without ever clipping.
NO_CLIP = 1.0e12
# torch's words when `.grad` of a non-leaf is read (megatron's distributed optimizer does, see `train_step`)
NON_LEAF_GRAD_WARNING = "The .grad attribute of a Tensor that is not a leaf Tensor is being accessed"

LM_ROLES = (Role.ACTOR, Role.REF, Role.TEACHER)
VALUE_ROLES = (Role.CRITIC, Role.REWARD_MODEL)


@dataclass(frozen=True)
class RoleSpec:
    """What one role's backend is built from (all read from the Plan by `role_spec`)."""

    role: Role
    model_path: str
    megatron: MegatronConfig
    optim: OptimConfig | None  # None: frozen weights (ref, reward model, teacher)
    value_head: bool
    dtype: str
    device_policy: DevicePolicy  # the Plan's (its name is the resolved device)
    gradient_checkpointing: bool = False
    packed: bool = False  # the model section's resolved use_remove_padding: micro-batches as packed (THD) sequences
    # the model section's resolved shared_prefix: rows of a micro-batch with the same prompt hold it once
    # (`hybridrl.training.sequences`; served by the CPU layer's attention stand-in)
    shared_prefix: bool = False
    # actor.router_replay == "rollout" (actor only): every forward routes as the rollout's vLLM did,
    # from the batch's `routed_experts` column (`hybridrl.training.router_replay`)
    router_replay: bool = False
    # actor only: LoRA adapters on the frozen model (`hybridrl.models.lora`), the only parameters it trains
    lora: LoraSettings | None = None
    lora_adapter_path: str | None = None  # a PEFT adapter folder the adapters start from

    @property
    def trainable(self) -> bool:
        return self.optim is not None

    @property
    def trained_optim(self) -> OptimConfig:
        """The optimizer settings of a role that trains; a frozen role (ref, reward model, teacher) has none."""
        if self.optim is None:
            raise ValueError(f"{self.role} is frozen: it has no optimizer")
        return self.optim

    @property
    def adapter_settings(self) -> LoraSettings:
        """The LoRA settings of a role with adapters (the actor, model.lora.rank > 0); the others have none."""
        if self.lora is None:
            raise ValueError(f"{self.role} has no LoRA adapters (model.lora.rank is 0)")
        return self.lora


def lora_settings(config: LoraConfig, seed: int) -> LoraSettings | None:
    """The adapters a role's `model.lora` section asks for (None at rank 0): verl's names read as `LoraSettings`."""
    if config.rank == 0:
        return None
    return LoraSettings(rank=config.rank, alpha=float(config.alpha), kind=config.type, targets=config.targets,
                        dropout=float(config.dropout), a_init=config.lora_A_init_method, seed=seed)


def role_spec(plan: Plan, role: Role | str) -> RoleSpec:
    try:
        role = Role(role)
    except ValueError:
        raise ValueError(f"unknown role {role!r}; expected one of {[str(r) for r in Role]}") from None
    config = plan.config
    arr = config.actor_rollout_ref
    megatron = plan.layout(role).megatron
    dtype = megatron.dtype or plan.resolved.train_dtype
    policy = plan.device_policy
    shared = plan.resolved.shared_prefix(role)
    if role == Role.ACTOR:
        return RoleSpec(role, arr.model.path, megatron, arr.actor.optim, False, dtype, policy,
                        arr.model.enable_gradient_checkpointing, plan.resolved.packed(role), shared,
                        router_replay=arr.actor.router_replay == "rollout",
                        lora=lora_settings(arr.model.lora, megatron.seed),
                        lora_adapter_path=arr.model.lora.adapter_path)
    if role == Role.REF:
        return RoleSpec(role, arr.model.path, megatron, None, False, dtype, policy,
                        packed=plan.resolved.packed(role), shared_prefix=shared)
    if role == Role.CRITIC:
        return RoleSpec(role, config.critic.model.path or arr.model.path, megatron, config.critic.optim, True,
                        dtype, policy, config.critic.model.enable_gradient_checkpointing,
                        plan.resolved.packed(role), shared)
    if role == Role.REWARD_MODEL:
        return RoleSpec(role, config.reward_model.model.path, megatron, None, True, dtype, policy,
                        packed=plan.resolved.packed(role), shared_prefix=shared)
    if role == Role.TEACHER:
        return RoleSpec(role, config.teacher.model.path, megatron, None, False, dtype, policy,
                        packed=plan.resolved.packed(role), shared_prefix=shared)
    raise AssertionError(role)  # every Role is handled above


def ensure_parallel_state(megatron: MegatronConfig, device: str) -> Any:
    """The current `ParallelContext`, initializing megatron for this layout if nothing is yet."""

    tp, pp = megatron.tensor_model_parallel_size, megatron.pipeline_model_parallel_size
    cp, vpp = megatron.context_parallel_size, megatron.virtual_pipeline_model_parallel_size
    vpp = vpp if vpp and vpp > 1 else None
    ep = megatron.expert_model_parallel_size
    etp = megatron.expert_tensor_parallel_size or tp
    first, last = megatron.num_layers_in_first_pipeline_stage, megatron.num_layers_in_last_pipeline_stage
    if state.is_initialized():
        ctx = state.get_context()
        have = (ctx.tp, ctx.pp, ctx.cp, ctx.vpp, ctx.ep, ctx.etp or ctx.tp, ctx.first_stage_layers,
                ctx.last_stage_layers)
        if have != (tp, pp, cp, vpp, ep, etp, first, last):
            raise ValueError(
                f"this process already runs megatron with tp={ctx.tp} pp={ctx.pp} cp={ctx.cp} vpp={ctx.vpp} "
                f"ep={ctx.ep} etp={ctx.etp or ctx.tp} stage layers first={ctx.first_stage_layers} "
                f"last={ctx.last_stage_layers}; a role needing tp={tp} pp={pp} cp={cp} vpp={vpp} ep={ep} etp={etp} "
                f"first={first} last={last} must live in its own worker group"
            )
        return ctx
    return state.initialize_model_parallel(tp=tp, pp=pp, vpp=vpp, cp=cp, seed=megatron.seed, device=device, ep=ep,
                                           first_stage_layers=first, last_stage_layers=last, etp=etp)


def _activate_cpu_layer(policy: DevicePolicy) -> None:
    # The CPU layer's torch-function mode is per thread; Ray may run a method on another thread
    # than the one that initialized megatron.
    if policy.megatron_cpu_layer:
        from hybridrl.parallel.cpu.layer import apply_cpu_layer

        apply_cpu_layer()


def _torch_adams(optimizer: Any) -> Iterator[torch.optim.Adam | torch.optim.AdamW]:
    """The torch Adam/AdamW optimizers inside megatron's optimizer (one, or each of a chained one's)."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer = getattr(inner, "optimizer", None)
        if isinstance(torch_optimizer, torch.optim.Adam | torch.optim.AdamW):
            yield torch_optimizer


def fuse_torch_adam(optimizer: Any) -> None:
    """Switch the torch Adam/AdamW that megatron falls back to (no TE or apex FusedAdam: CPU) to torch's
    fused kernel: one pass over params, grads and both moments instead of a dozen elementwise ops per
    tensor (~3x faster on CPU for SmolLM2-135M's 135M parameters; equal to the single-tensor
    update up to float rounding)."""
    for torch_optimizer in _torch_adams(optimizer):
        params = [p for group in torch_optimizer.param_groups for p in group["params"]]
        if not all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params):
            continue
        for options in (torch_optimizer.defaults, *torch_optimizer.param_groups):
            options.update(fused=True, foreach=False)


def materialize_adam_state(optimizer: Any) -> int:
    """Allocate the state torch's Adam/AdamW (megatron's fallback) would create lazily at its first step,
    exactly as that step would (zero moments, step 0 where the fused or capturable kernel keeps it),
    for every parameter that trains; returns how many parameters got state. The first step then finds
    its state and updates exactly as with lazy allocation (`DevicePolicy.optimizer_state_at_setup`)."""
    from torch.optim.optimizer import _get_scalar_dtype

    made = 0
    for torch_optimizer in _torch_adams(optimizer):
        for group in torch_optimizer.param_groups:
            on_device = group["capturable"] or group["fused"]
            for param in group["params"]:
                if not param.requires_grad or torch_optimizer.state.get(param):
                    continue
                state = torch_optimizer.state[param]
                state["step"] = (torch.zeros((), dtype=_get_scalar_dtype(is_fused=group["fused"]), device=param.device)
                                 if on_device else torch.tensor(0.0, dtype=_get_scalar_dtype(), device="cpu"))
                moments = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if group["amsgrad"] else ("exp_avg", "exp_avg_sq")
                for name in moments:
                    state[name] = torch.zeros_like(param, memory_format=torch.preserve_format)
                made += 1
    return made


def _prompt_width(tensors: dict[str, torch.Tensor]) -> int:
    """The prompt columns of a rollout batch's `[prompt | response]` rows."""
    return tensors["input_ids"].shape[1] - tensors["responses"].shape[1]


def packed_seq_params(micro: ModelInputs, cp: int = 1) -> Any:
    """megatron's `PackedSeqParams` (THD) of a packed micro-batch, None for a padded one.

    Under context parallelism (`cp` > 1) the segments are padded to 2 × CP chunks and `cu_seqlens`
    bounds the padded segments: they are given as the padded boundaries too, as megatron's
    `get_thd_batch_on_this_cp_rank` does, so the rotary split and TE's THD CP read the same layout."""
    if not micro.is_packed:
        return None
    if micro.prefix_branches is not None:  # rows sharing a prompt: the CPU layer's stand-in reads the tree
        from hybridrl.parallel.cpu.attention import shared_prefix_seq_params

        return shared_prefix_seq_params(micro.cu_seqlens, micro.max_seqlen, micro.position_ids[0],
                                        micro.prefix_branches)
    from megatron.core.packed_seq_params import PackedSeqParams

    padded = micro.cu_seqlens if cp > 1 else None
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=micro.cu_seqlens, cu_seqlens_kv=micro.cu_seqlens,
                           cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded,
                           max_seqlen_q=micro.max_seqlen, max_seqlen_kv=micro.max_seqlen)


def _unwrapped(model: Any) -> Any:
    gpt = model
    while not hasattr(gpt, "decoder") and hasattr(gpt, "module"):
        gpt = gpt.module  # DDP (and Float16Module) wrappers
    return gpt


def _model_forward(model: Any, micro: ModelInputs,
                   hidden_hook: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """The model's output for `micro`; `hidden_hook` (last stage) rewrites the decoder's final hidden
    states `[s, b, h]` before the output layer.

    Context parallelism (CP > 1): the model sees this CP rank's columns of the micro-batch
    (megatron's load-balanced order, `hybridrl.parallel.context_parallel`; packed: chunks of every
    segment, TE's THD order), and on the last stage the decoder's output is all-gathered over CP back
    into the whole sequence before `hidden_hook` and the output layer. So the output and everything
    computed from it (log-probs, entropy, values, the loss) are those of CP = 1 on every CP rank; the
    gather's backward sums their gradients over CP, which `train_mini_batch`'s loss scale accounts for.
    """
    gpt = _unwrapped(model)
    input_ids, position_ids = micro.input_ids, micro.position_ids
    cp = gpt.config.context_parallel_size
    kwargs: dict[str, Any] = {"packed_seq_params": packed_seq_params(micro, cp)}
    # MoE: padding columns are routed (the dispatch is dense) but left out of the router's losses and
    # counts, as transformers' load-balancing loss leaves out masked tokens.
    padding_mask = micro.padding_mask() if gpt.config.num_moe_experts else None
    hooks: list[Callable[[torch.Tensor], torch.Tensor]] = []
    if cp > 1:
        from megatron.core import parallel_state

        group = parallel_state.get_context_parallel_group()
        rank, bounds = group.rank(), micro.segment_bounds
        input_ids = split_for_cp_rank(input_ids, 1, cp, rank, bounds)
        position_ids = split_for_cp_rank(position_ids, 1, cp, rank, bounds)
        if padding_mask is not None:
            padding_mask = split_for_cp_rank(padding_mask, 1, cp, rank, bounds)
        hooks.append(lambda hidden: gather_from_cp(hidden, 0, group, bounds))
    if padding_mask is not None:
        if gpt.config.sequence_parallel and not gpt.pre_process:
            # megatron scatters the mask over the sequence-parallel ranks only on the stage that embeds
            from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

            padding_mask = scatter_to_sequence_parallel_region(padding_mask.t().contiguous()).t().contiguous()
        kwargs["padding_mask"] = padding_mask
    if hidden_hook is not None:
        hooks.append(hidden_hook)
    if not hooks or not getattr(gpt, "post_process", False):
        return model(input_ids, position_ids, None, **kwargs)

    def rewrite(_module: Any, _args: Any, hidden: torch.Tensor) -> torch.Tensor:
        for hook in hooks:
            hidden = hook(hidden)
        return hidden

    handle = gpt.decoder.register_forward_hook(rewrite)
    try:
        return model(input_ids, position_ids, None, **kwargs)
    finally:
        handle.remove()


def _response_tokens_forward(model: Any, micro: ModelInputs) -> torch.Tensor:
    """The model's output `[1, N, ...]` at the N real response tokens' predicting columns only
    (`micro.response_token_positions()`, row-major).

    On the last stage the decoder's hidden states `[s, b, h]` are cut to those N columns before the
    output layer: prompt positions and response padding carry no loss, and on a large vocabulary the
    head (its matmul, its weight gradient and the logits every later step reads) is a large part of
    the update. The decoder ends with the final norm, which is per token, so the cut commutes with
    it: the logits are the same numbers as the full output's. With sequence parallelism the hidden
    states are split over TP along s, so the full output is computed and then cut.
    """
    gpt = _unwrapped(model)
    if not getattr(gpt, "post_process", False):  # not the last stage: activations go on whole
        return _model_forward(model, micro)
    rows, cols = micro.response_token_positions()
    # where each predicting column sits in the model's [b, s] input (packed: b = 1, s = the pack)
    batch_index, seq_index = micro.token_index(rows, micro.predict_index[rows, cols])
    if gpt.config.sequence_parallel:
        return _model_forward(model, micro)[batch_index, seq_index].unsqueeze(0)
    # [N, 1, h]: one "sequence" of N tokens (under CP, cut from the gathered whole sequence)
    return _model_forward(model, micro, lambda hidden: hidden[seq_index, batch_index].unsqueeze(1))


@dataclass
class TokenCounts:
    """Real tokens and computed columns of the micro-batches a backend built since the last `reset`
    (`perf/padding_ratio` = the share of computed columns that were padding)."""

    real: int = 0
    computed: int = 0
    rows: int = 0  # the rows' real tokens: a prompt shared by k rows counts k times here, once in `real`

    def add(self, micros: Sequence[ModelInputs]) -> None:
        self.real += sum(m.real_tokens for m in micros)
        self.computed += sum(m.computed_tokens for m in micros)
        self.rows += sum(m.row_tokens for m in micros)

    def ratios(self, group: Any = None) -> tuple[float, float]:
        """(padding columns / computed columns, the share of the rows' real tokens not computed because
        their prompt was shared); with `group` (the DP group: every rank calls it), over the group's
        micro-batches together."""
        real, computed, rows = self.real, self.computed, self.rows
        if group is not None:
            import torch.distributed as dist

            counts = torch.tensor([real, computed, rows], dtype=torch.int64, device=collective_device(group))
            dist.all_reduce(counts, group=group)
            real, computed, rows = (int(v) for v in counts.tolist())
        return ((computed - real) / computed if computed else 0.0, (rows - real) / rows if rows else 0.0)

    def padding_ratio(self, group: Any = None) -> float:
        """Padding columns / computed columns (`ratios`' first)."""
        return self.ratios(group)[0]

    def reset(self) -> None:
        self.real = self.computed = self.rows = 0


@dataclass(frozen=True)
class StepResult:
    """One optimizer step: per-micro-batch metrics (last stage only; empty elsewhere), grad norm, lr."""

    micro_metrics: list[dict[str, torch.Tensor]]
    grad_norm: float
    lr: float
    applied: bool  # False when the optimizer skipped the step (fp16 overflow or a non-finite norm)


class MegatronBackend:
    """A role's model on this rank, built and (when trainable) wrapped for training."""

    def __init__(self, spec: RoleSpec, *, total_optimizer_steps: int | None = None,
                 optimizer_steps_per_step: int | None = None) -> None:
        self.spec = spec
        self.device_policy = spec.device_policy
        self.ctx = ensure_parallel_state(spec.megatron, spec.device_policy.name)
        _activate_cpu_layer(self.device_policy)
        self.dtype = default_dtype_for(self.ctx.device, spec.dtype)
        megatron = spec.megatron
        # the layer spec this role's model is built on: TE's on GPUs where it imports, but never for adapters
        self.spec_kind = layer_spec_kind(self.ctx.device, adapters=spec.lora is not None)
        if spec.packed and not self.device_policy.megatron_cpu_layer and self.spec_kind != "te":
            # megatron's local DotProductAttention asserts packed_seq_params is None: on CPU the CPU layer's stand-in
            # serves packed sequences, on GPUs TE does
            why = ADAPTERS_ON_LOCAL_SPEC if spec.lora is not None else WITHOUT_TE
            raise ValueError(f"{spec.role}: packed sequences here, but {why}")
        if megatron.context_parallel_size > 1:
            self._check_context_parallel(spec)
        if spec.shared_prefix:
            self._check_shared_prefix(spec)
        self.tokens_seen = TokenCounts()
        source = value_model_source(spec.model_path) if spec.value_head else ModelSource.from_path(spec.model_path)
        overrides = role_transformer_settings(megatron, source.shape,
                                              gradient_checkpointing=spec.gradient_checkpointing,
                                              router_replay=spec.router_replay)
        if spec.trainable and self.device_policy.wgrad_accumulation_fusion == "cpu_stand_in":
            # weight-gradient GEMMs accumulate into DDP's main_grad (only a trained role has one)
            from hybridrl.parallel.cpu.wgrad import install_cpu_wgrad_fusion

            overrides["gradient_accumulation_fusion"] = install_cpu_wgrad_fusion()
        self.uniform_width = self._check_moe_dispatch(spec) if source.shape.is_moe else False
        if spec.shared_prefix and source.shape.is_moe:
            # the router's losses, token counts and capacity see each token of a micro-batch once
            raise ValueError(f"{spec.role}: model.shared_prefix=true with a mixture-of-experts model is not served "
                             "(the router's load-balancing loss, token counts and expert capacity would count a "
                             "shared prompt once instead of once per row); set shared_prefix=false")
        if spec.router_replay:
            self._check_router_replay(spec, source)
        self.replay_mismatch = ReplayMismatch()  # filled by replayed forwards; callers reset and read it
        self.source = source
        # on cuda megatron's fusions and overlaps (each a default the user's own setting overrides), then the user's
        # megatron settings (verl's override_transformer_config; the plan refused any of hybridrl's own)
        apex_wgrad = apex_wgrad_available()
        self.speed = speed_settings(
            cuda=self.device_policy.megatron_speed_defaults, trainable=spec.trainable, data_parallel=self.ctx.dp,
            distributed_optimizer=megatron.use_distributed_optimizer,
            # TE's fused RoPE serves the local spec too (megatron's rope_utils imports it whatever the spec)
            te=self.ctx.device == "cuda" and te_available(), apex_wgrad=apex_wgrad,
            user_transformer=megatron.override_transformer_config, user_ddp=megatron.override_ddp_config)
        if (self.device_policy.megatron_speed_defaults and spec.trainable and not apex_wgrad
                and megatron.override_transformer_config.get("gradient_accumulation_fusion") is True):
            # megatron's own output layer (a ColumnParallelLinear even under TE's spec) raises a RuntimeError later
            raise ValueError(f"{spec.role}: override_transformer_config.gradient_accumulation_fusion=true needs Apex's "
                             "fused_weight_gradient_mlp_cuda on this worker (megatron's output layer uses it), which "
                             "does not import here: install Apex with its CUDA extensions, or set it false (hybridrl "
                             "then leaves it off, as `hybridrl plan` shows)")
        overrides = {**transformer_values(self.speed), **megatron_settings(megatron.override_transformer_config),
                     **overrides}
        chunks = build_gpt_models(source, ctx=self.ctx, dtype=self.dtype, config_overrides=overrides,
                                  spec_kind=self.spec_kind)
        if spec.value_head:
            # Seeded like the model so every rank (TP, PP, DP) builds the same initial head.
            attach_value_head(chunks, seed=megatron.seed)
            self.head_loaded = load_value_model(chunks, spec.model_path)
        else:
            load_weights(chunks, spec.model_path)
            self.head_loaded = False
        if spec.lora is not None:
            self._add_adapters(spec, chunks)
        self.config = chunks[0].config
        self.vocab_size = source.shape.vocab_size
        self.optimizer: Any = None
        self.schedule: LRSchedule | None = None
        self.optimizer_offload: OptimizerStateOffload | None = None
        self._grads_offloaded = False
        self.param_storage: ParamStorageOffload | None = None
        if spec.trainable:
            if spec.megatron.param_offload and spec.role != Role.ACTOR:
                raise ValueError(
                    f"{spec.role}: megatron.param_offload is supported for the colocated actor (idle while vLLM "
                    "generates) and the frozen roles (ref, reward model); use optimizer_offload and grad_offload "
                    "to free this role's training state between phases.")
            self.models = self._wrap_for_training(chunks)
            if spec.megatron.param_offload:
                self.param_storage = ParamStorageOffload([p for m in self.models for p in m.parameters()])
            # megatron's own host optimizer (optimizer_cpu_offload) keeps the states on the host already
            settings = spec.optim.override_optimizer_config if spec.optim is not None else {}
            host_optimizer = bool(settings.get("optimizer_cpu_offload"))
            if spec.megatron.optimizer_offload and not host_optimizer:
                self.optimizer_offload = OptimizerStateOffload(self.optimizer, store="cpu")
            self.schedule = LRSchedule.from_config(spec.trained_optim, total_optimizer_steps, optimizer_steps_per_step)
        else:
            for chunk in chunks:
                chunk.eval()
                chunk.requires_grad_(False)
            self.models = chunks
        self._offloaded = False

    @property
    def trained_schedule(self) -> LRSchedule:
        """The LR schedule of a role that trains; a frozen role (ref, reward model, teacher) has none."""
        if self.schedule is None:
            raise RuntimeError(f"role {self.spec.role} is frozen: it has no LR schedule")
        return self.schedule

    # ------------------------------------------------------------------------ construction
    def _check_context_parallel(self, spec: RoleSpec) -> None:
        """What context parallelism serves today (the plan refuses the rest first, `config/validate.py`)."""
        cp = spec.megatron.context_parallel_size
        if spec.megatron.sequence_parallel_in_effect:
            # The last stage's hidden states are gathered over CP along s, where SP splits them over TP too.
            raise ValueError(f"{spec.role}: context_parallel_size={cp} with sequence_parallel=true is not "
                             "implemented yet; set sequence_parallel=false")
        if not self.device_policy.megatron_cpu_layer:
            raise ValueError(f"{spec.role}: context_parallel_size={cp} runs on CPU only so far (the CPU "
                             "attention stand-in); TransformerEngine's ring attention on GPUs is not wired yet")

    @staticmethod
    def _check_moe_dispatch(spec: RoleSpec) -> bool:
        """What the MoE dispatcher needs from the micro-batches (the plan refuses the rest first,
        `config/validate.py`); True when every micro-batch must take the batch's full width."""
        m = spec.megatron
        allgather = m.moe_token_dispatcher_type == "allgather"
        if allgather and m.pipeline_model_parallel_size > 1:
            raise ValueError(f"{spec.role}: moe_token_dispatcher_type=allgather needs pipeline_model_parallel_size=1 "
                             "(megatron's allgather dispatcher refuses variable_seq_lengths)")
        uniform = needs_uniform_micro_batches(m)
        if uniform and spec.packed:
            raise ValueError(f"{spec.role}: use_remove_padding=true with the allgather dispatcher or drop-and-pad "
                             "across DP ranks is not supported (packed micro-batches differ in length)")
        return uniform

    def _check_shared_prefix(self, spec: RoleSpec) -> None:
        """What shared prompts need (the plan refuses the rest first, `config/validate.py`): packed
        micro-batches, the CPU layer's attention stand-in (TE's attention has no tree mask), CP 1."""
        if not spec.packed:
            raise ValueError(f"{spec.role}: model.shared_prefix=true needs packed micro-batches "
                             "(model.use_remove_padding=true)")
        if not self.device_policy.shared_prefix_attention:
            raise ValueError(f"{spec.role}: model.shared_prefix=true is served by the CPU layer's attention stand-in "
                             f"only; on {self.device_policy.name} set it to false")
        if self.ctx.cp > 1:
            raise ValueError(f"{spec.role}: model.shared_prefix=true with context_parallel_size={self.ctx.cp} is not "
                             "served (a shared segment is not a causal run CP could cut into chunks)")

    @staticmethod
    def _check_router_replay(spec: RoleSpec, source: ModelSource) -> None:
        """What routing replay serves exactly (the plan refuses the rest first, `config/validate.py`)."""
        if not source.shape.is_moe:
            raise ValueError(f"{spec.role}: router_replay needs a mixture-of-experts model")
        m = spec.megatron
        if m.sequence_parallel_in_effect:
            raise ValueError(f"{spec.role}: router_replay with sequence_parallel=true is not implemented (each TP rank "
                             "routes only its sequence chunk)")
        if m.context_parallel_size > 1:
            raise ValueError(f"{spec.role}: router_replay with context_parallel_size={m.context_parallel_size} is "
                             "not implemented (each CP rank routes only its columns)")
        if spec.gradient_checkpointing:
            raise ValueError(f"{spec.role}: router_replay with activation recompute is not implemented (the "
                             "recomputed forward runs in the backward, outside the replayed forward)")

    @staticmethod
    def _add_adapters(spec: RoleSpec, chunks: list[Any]) -> None:
        """LoRA: freeze the loaded model and attach the adapters (before DDP, so that its buffers and the optimizer
        hold the adapters alone), from `lora_adapter_path` when set."""
        if not spec.trainable:
            raise ValueError(f"{spec.role}: LoRA adapters are for a trained role (the actor)")
        adapters = [adapter for chunk in chunks for adapter in add_lora(chunk, spec.adapter_settings)]
        if spec.lora_adapter_path:
            load_lora_state(adapters, read_peft_adapter(spec.lora_adapter_path, spec.adapter_settings))

    def _wrap_for_training(self, chunks: list[Any]) -> list[Any]:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        spec, optim = self.spec, self.spec.trained_optim
        if self.ctx.vpp is not None and self.ctx.pp <= 2:
            # With two stages a rank's previous and next stage are the same peer: the interleaved
            # schedule's batched send/recv of activations and gradients to one peer can match the
            # wrong messages (gloo: silently swapped tensors). Megatron-LM refuses this layout too.
            raise ValueError(f"training with virtual pipeline stages needs pp > 2 (got pp={self.ctx.pp}, "
                             f"vpp={self.ctx.vpp}); forward-only roles may use it")
        distributed = spec.megatron.use_distributed_optimizer
        # fp32 gradient reduction; the overlaps on by default on cuda (`speed_settings`), the user's DDP settings last
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=distributed,
            **{**ddp_values(self.speed), **spec.megatron.override_ddp_config},
        )
        # Megatron-LM buckets only the first chunk (the others' grads are reduced at the end anyway).
        models = [
            DistributedDataParallel(self.config, ddp_config, chunk, disable_bucketing=index > 0)
            for index, chunk in enumerate(chunks)
        ]
        self.config.finalize_model_grads_func = finalize_model_grads
        no_sync = [m.no_sync for m in models]
        self.config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
        if optim.optimizer not in ("adam", "sgd"):
            raise ValueError(f"optim.optimizer={optim.optimizer!r}; expected adam or sgd")
        opt_config = OptimizerConfig(
            optimizer=optim.optimizer, lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay,
            adam_beta1=optim.betas[0], adam_beta2=optim.betas[1], adam_eps=optim.eps,
            clip_grad=optim.clip_grad if optim.clip_grad > 0 else NO_CLIP,
            bf16=self.dtype == torch.bfloat16, fp16=self.dtype == torch.float16, params_dtype=self.dtype,
            use_distributed_optimizer=distributed,
            # the user's megatron optimizer settings (verl's override_optimizer_config; the plan refused hybridrl's own)
            **optim.override_optimizer_config,
        )
        self.optimizer = get_megatron_optimizer(opt_config, models)
        fuse_torch_adam(self.optimizer)
        if self.device_policy.optimizer_state_at_setup:
            materialize_adam_state(self.optimizer)
        return models

    # ------------------------------------------------------------------------------ queries
    @property
    def chunks(self) -> list[Any]:
        """The bare GPTModel chunks (DDP unwrapped)."""
        return [getattr(m, "module", m) for m in self.models]

    @property
    def is_output_rank(self) -> bool:
        """Last pipeline stage, TP rank 0: the rank whose results the controller collects."""
        return self.ctx.is_last_pp_stage and self.ctx.tp_rank == 0 and self.ctx.cp_rank == 0

    @property
    def pad_multiple(self) -> int:
        """Sequence lengths must divide over TP when sequence parallelism splits them, and into 2 × CP
        chunks under context parallelism (megatron's load-balanced split)."""
        multiple = self.ctx.tp if self.config.sequence_parallel else 1
        if self.ctx.cp > 1:
            multiple = math.lcm(multiple, 2 * self.ctx.cp)
        return multiple

    @property
    def segment_multiple(self) -> int:
        """Packed micro-batches under context parallelism: each row's segment cuts into 2 × CP chunks."""
        return 2 * self.ctx.cp if self.spec.packed and self.ctx.cp > 1 else 1

    def prompt_groups(self, tensors: dict[str, torch.Tensor], rows: Sequence[int] | None = None) -> list[list[int]]:
        """The rows (positions in `rows`, default all) whose prompts are the same tokens, grouped in the order
        of each group's first row: what a micro-batch computes once with `shared_prefix`."""
        pick = {k: tensors[k] for k in ("input_ids", "attention_mask", "position_ids")}
        if rows is not None:
            index = torch.tensor(list(rows), dtype=torch.long)
            pick = {k: v.index_select(0, index) for k, v in pick.items()}
        return prompt_groups(pick["input_ids"], pick["attention_mask"], pick["position_ids"], _prompt_width(tensors))

    def partition(self, tensors: dict[str, torch.Tensor], micro_batch_size: int, *, rows: Sequence[int] | None = None,
                  dynamic: bool = False, max_tokens: int = 0) -> Partition:
        """`rows` of `tensors` (default all) cut into micro-batches, as positions in `rows`: fixed size, or
        (`dynamic`) by token budget agreed over DP (a collective), where with `shared_prefix` a prompt
        group's prompt counts once (`hybridrl.training.micro_batching`)."""
        mask = tensors["attention_mask"]
        if rows is not None:
            mask = mask.index_select(0, torch.tensor(list(rows), dtype=torch.long))
        shared = dynamic and self.spec.shared_prefix  # fixed sizes need not know the groups
        return partition_rows(mask, micro_batch_size, dynamic=dynamic, max_tokens=max_tokens,
                              dp_group=self.ctx.dp_group,
                              prompt_groups=self.prompt_groups(tensors, rows) if shared else None,
                              prompt_width=_prompt_width(tensors) if shared else 0)

    def micro_batches(self, tensors: dict[str, torch.Tensor], partition: Sequence[Sequence[int]], *,
                      extra_keys: tuple[str, ...] = (), free_routing: bool = False) -> list[ModelInputs]:
        """The model inputs of each part of `partition` (row lists of `tensors`), on this rank's device.

        The one place where batch rows enter the model's device: rows are cut and aligned where the
        batch lives (the host, as the controller sends it), then every tensor of every micro-batch
        (inputs and extras) moves to the rank's device, from pinned memory without blocking on cuda.
        With routing replay (`spec.router_replay`) the micro-batches carry the batch's `routed_experts`
        and every forward of them replays it; `free_routing` lets the routers choose for themselves
        (rows no rollout routed: the sync's probe sequence).
        """

        device = self.ctx.device
        replay = self.spec.router_replay and not free_routing
        if replay and "routed_experts" not in tensors:
            raise ValueError(f"{self.spec.role}: router_replay=rollout needs the rollout's `routed_experts` column; "
                             "this batch has none (generate it with rollout routing on)")
        # the batch's full width is the same on every DP rank (their rows are cut from one batch)
        width = tensors["input_ids"].shape[1] if self.uniform_width else None
        cut = [micro_batch_inputs(tensors, list(rows), extra_keys=extra_keys, pad_multiple=self.pad_multiple,
                                  min_width=width, packed=self.spec.packed, segment_multiple=self.segment_multiple,
                                  routed_experts=replay, shared_prefix=self.spec.shared_prefix)
               for rows in partition]
        self.tokens_seen.add(cut)
        return [micro.map_tensors(lambda t: to_rank_device(t, device)) for micro in cut]

    def mesh_coords(self) -> dict[str, int]:
        return {"dp": self.ctx.dp_rank, "tp": self.ctx.tp_rank, "pp": self.ctx.pp_rank, "cp": self.ctx.cp_rank}

    # ----------------------------------------------------------------------------- running
    def _run(self, micro_batches: Sequence[ModelInputs], step_output: Callable[..., Any], *,
             forward_only: bool, response_tokens_only: bool = False) -> list[Any]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        _activate_cpu_layer(self.device_policy)
        if not micro_batches:
            raise ValueError("no micro-batches to run")
        if not self.device_policy.params_on_host and micro_batches[0].input_ids.device.type != "cuda":
            raise ValueError(f"{self.spec.role}: micro-batches are on {micro_batches[0].input_ids.device}, the model "
                             "on cuda; build them with MegatronBackend.micro_batches")

        def forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Callable[..., Any]]:
            micro = next(data_iterator)
            with self._replayed_routing(model, micro):
                if response_tokens_only:
                    output = _response_tokens_forward(model, micro)
                else:
                    output = _model_forward(model, micro)
            return output, partial(step_output, micro)

        chunks = len(self.models)
        # Every VPP chunk consumes every micro-batch (the first for its tokens, the last for its loss).
        iterators: Any = [iter(micro_batches) for _ in range(chunks)] if chunks > 1 else iter(micro_batches)
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iterators,
            model=self.models if chunks > 1 else self.models[0],
            num_microbatches=len(micro_batches),
            seq_length=max(m.seq_length for m in micro_batches),
            micro_batch_size=max(m.model_batch_size for m in micro_batches),
            forward_only=forward_only,
            collect_non_loss_data=forward_only,
        )

    def _replayed_routing(self, model: Any, micro: ModelInputs) -> Any:
        """While the forward of `micro` on this chunk runs: its routers replay the rollout's routing
        (the forward runs inside megatron's forward step, so each micro-batch gets its own)."""
        if micro.routed_experts is None:
            return contextlib.nullcontext()
        routers = [n for n, _ in moe_routers([model], required=False)]
        if not routers:  # a pipeline stage of dense layers only
            return contextlib.nullcontext()
        per_layer, valid = chunk_routing(micro.routed_experts, routers, self.source.shape.moe_layers)
        return replaying([model], per_layer, mismatch=self.replay_mismatch, valid=valid)

    def without_capacity(self) -> Any:
        """While active, every MoE layer routes dropless (no expert capacity), as vLLM does
        (`hybridrl.training.moe_capacity`); a no-op without a capacity factor."""
        return without_capacity(self.chunks, self.config)

    @torch.no_grad()
    def forward_only(self, micro_batches: Sequence[ModelInputs],
                     collect: Callable[[ModelInputs, torch.Tensor], torch.Tensor], *,
                     response_tokens_only: bool = False) -> list[torch.Tensor]:
        """`collect(micro, output)` of every micro-batch, in order, on the last stage ([] elsewhere).

        `output` is the model's `[b, s, V/tp]` logits (or `[b, s, 1]` values); `collect` runs on
        every TP rank of the last stage (vocab-parallel reductions are collectives). With
        `response_tokens_only`, `output` is `[1, N, ...]`: only the columns predicting the micro-batch's
        N real response tokens go through the output layer (see `_response_tokens_forward`;
        `micro.scatter_response_tokens` puts per-token results back in `[b, R]`).
        """
        self.load_params()
        was_training = [m.training for m in self.models]
        for m in self.models:
            m.eval()
        try:
            return self._run(micro_batches, lambda micro, output, non_loss_data=True: collect(micro, output),
                             forward_only=True, response_tokens_only=response_tokens_only)
        finally:
            for m, mode in zip(self.models, was_training):
                m.train(mode)

    def train_step(self, micro_batches: Sequence[ModelInputs],
                   loss_fn: Callable[[ModelInputs, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]],
                   *, response_tokens_only: bool = False) -> StepResult:
        """Forward/backward every micro-batch, then one optimizer step at the scheduled lr.

        `loss_fn(micro, output)` returns `(scaled loss, metrics)` (see the module docstring);
        `response_tokens_only` as in `forward_only`.
        """
        if not self.spec.trainable:
            raise RuntimeError(f"role {self.spec.role} is frozen: it has no optimizer")
        self.load_params()
        self.restore_training_state()
        for m in self.models:
            m.train()
            m.zero_grad_buffer()
        with warnings.catch_warnings():
            # megatron's distributed optimizer zeroes its fp32 shard groups, views of the parameters (non-leaves),
            # through `hasattr(view, "grad")` (`optimizer._zero_grad_group_helper`), which torch warns about on every
            # device: megatron's reading, not a gradient this run loses (each step's grads are the buffers' anyway)
            warnings.filterwarnings("ignore", message=NON_LEAF_GRAD_WARNING, category=UserWarning)
            self.optimizer.zero_grad()
        lr = self.trained_schedule.current_lr
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
            group["weight_decay"] = self.spec.trained_optim.weight_decay * group.get("wd_mult", 1.0)
        metrics = self._run(micro_batches, lambda micro, output: loss_fn(micro, output), forward_only=False,
                            response_tokens_only=response_tokens_only)

        if not step_is_finite(self.models, metrics):
            # megatron's fp32/bf16 optimizers would apply NaN grads (see training.nonfinite): skip the
            # step on every rank; the next train_step zeroes the grad buffers, the lr schedule waits.
            return StepResult(list(metrics), float("nan"), lr, False)
        applied, grad_norm, _ = self.optimizer.step()
        if applied:
            self.trained_schedule.step_count += 1
        return StepResult(list(metrics), float(grad_norm) if grad_norm is not None else float("nan"), lr,
                          bool(applied))

    def finish_param_gather(self) -> None:
        """After an update's last optimizer step: with megatron's overlapped parameter all-gather the gathered
        weights arrive only in the next forward's pre-hooks, so complete it now, before anything reads them
        (the weight sync, a checkpoint, an offload, the next log-prob pass). A no-op without the overlap."""
        if not self.spec.trainable or not self.models[0].ddp_config.overlap_param_gather:
            return
        for model in self.models:
            model.start_param_sync(force_sync=True)

    # ------------------------------------------------------------------------- offloading
    def offload_training_state(self) -> None:
        """After an update phase: optimizer states to CPU and grad buffers freed, as configured
        (`megatron.optimizer_offload` / `grad_offload`; see `hybridrl.training.offload`). The next
        `train_step` brings them back. A no-op for frozen roles and when neither option is set."""
        if self.optimizer_offload is not None:
            self.optimizer_offload.offload()
        if self.spec.trainable and self.spec.megatron.grad_offload and not self._grads_offloaded:
            offload_grad_buffers(self.models, self.device_policy)
            self._grads_offloaded = True

    def restore_training_state(self) -> None:
        """Undo `offload_training_state` (called by `train_step`; cheap when nothing is offloaded)."""
        if self._grads_offloaded:
            restore_grad_buffers(self.models, self.device_policy)
            self._grads_offloaded = False
        if self.optimizer_offload is not None:
            self.optimizer_offload.reload()

    def offload_params(self) -> None:
        """Move a frozen role's parameters to CPU between calls (a no-op when they already live there); a trained
        role's (the colocated actor with param_offload) by their storages (`ParamStorageOffload`)."""
        if self.spec.trainable:
            if self.param_storage is None:
                raise ValueError(f"{self.spec.role}: parameters offloaded without megatron.param_offload")
            self.param_storage.offload()
            return
        if self.device_policy.params_on_host or self._offloaded:
            return
        for chunk in self.chunks:
            chunk.to("cpu")
        self._offloaded = True

    def load_params(self) -> None:
        """Bring offloaded parameters back to the device (no-op unless `offload_params` moved them)."""
        if self.param_storage is not None:
            self.param_storage.reload()
        if not self._offloaded:
            return
        for chunk in self.chunks:
            chunk.to(torch.device("cuda", torch.cuda.current_device()))
        self._offloaded = False
