"""megatron's fused kernels and communication overlap a role trains with on cuda, each with why: `speed_settings`.

megatron-core's dataclasses default every fusion and overlap off; its own training scripts and the peers
(verl's default override_transformer_config, NeMo-RL's recipes) turn them on. On cuda hybridrl turns on
each one megatron-core 0.16.1 serves for the job, and names why any stays off. The CPU layer keeps its own
settings (`device_policy.CPU_LAYER_TRANSFORMER_SETTINGS`: none of these kernels exists there).

The user's `override_transformer_config` / `override_ddp_config` win over a default (a setting here is a
default, never a refusal). Torch-free: the plan shows the same list the workers apply; what only a worker
knows (whether TransformerEngine or Apex imports there) enters as `te` / `apex_wgrad`, None at plan time
(the plan then says what decides).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

SettingKind = Literal["transformer", "ddp"]


@dataclass(frozen=True)
class SpeedSetting:
    name: str  # the field of megatron's TransformerConfig ("transformer") or DistributedDataParallelConfig ("ddp")
    kind: SettingKind
    on: bool
    why: str

    def describe(self) -> str:
        return f"{self.name}: {'on' if self.on else 'off'} ({self.why})"


# The fusion and overlap fields this module decides: what a user may also set in override_transformer_config /
# override_ddp_config (their value then wins).
TRANSFORMER_SPEED_FIELDS = ("bias_activation_fusion", "bias_dropout_fusion", "apply_rope_fusion",
                            "gradient_accumulation_fusion", "masked_softmax_fusion", "persist_layer_norm")
DDP_SPEED_FIELDS = ("overlap_grad_reduce", "overlap_param_gather")


def speed_settings(*, cuda: bool, trainable: bool, data_parallel: int, distributed_optimizer: bool,
                   te: bool | None = None, apex_wgrad: bool | None = None,
                   user_transformer: Mapping[str, object] | None = None,
                   user_ddp: Mapping[str, object] | None = None) -> tuple[SpeedSetting, ...]:
    """The settings one role trains (or runs) with. `cuda`: the resolved device is a GPU (on cpu: an empty
    tuple, the CPU layer decides); `trainable`: the role has gradients (the overlaps and the wgrad fusion
    concern only those); `te` / `apex_wgrad`: whether TransformerEngine / Apex's fused_weight_gradient_mlp_cuda
    import on the worker (None: unknown, at plan time)."""
    if not cuda:
        return ()
    user_transformer, user_ddp = user_transformer or {}, user_ddp or {}
    settings = [
        SpeedSetting("bias_activation_fusion", "transformer", False,
                     "megatron refuses it next to use_te_activation_func, which the job sets")
        if user_transformer.get("use_te_activation_func") else
        SpeedSetting("bias_activation_fusion", "transformer", True,
                     "SwiGLU and its bias in one jit-fused kernel (megatron's bias_swiglu; any CUDA GPU)"),
        SpeedSetting("bias_dropout_fusion", "transformer", True,
                     "each residual's bias-dropout-add in one jit-fused kernel (any CUDA GPU)"),
        _rope(te),
        _wgrad(trainable, apex_wgrad),
        SpeedSetting("masked_softmax_fusion", "transformer", False,
                     "TransformerEngine's attention fuses its softmax itself; megatron's kernel for the local "
                     "spec needs its legacy scaled_masked_softmax_cuda extension, which no wheel ships"),
        SpeedSetting("persist_layer_norm", "transformer", False,
                     "the models are RMSNorm: megatron's persistent kernel is Apex's for LayerNorm, and "
                     "TransformerEngine's norms are fused already"),
        *_overlaps(trainable, data_parallel, distributed_optimizer, user_ddp),
    ]
    return tuple(_as_user_set(s, user_transformer if s.kind == "transformer" else user_ddp) for s in settings)


def _rope(te: bool | None) -> SpeedSetting:
    if te is False:
        return SpeedSetting("apply_rope_fusion", "transformer", False,
                            "needs TransformerEngine's fused RoPE, which does not import on this worker")
    why = "rotary embeddings in TransformerEngine's fused kernel (packed sequences: its THD kernel)"
    return SpeedSetting("apply_rope_fusion", "transformer", True,
                        why if te else why + "; off on a worker where TransformerEngine does not import")


def _wgrad(trainable: bool, apex_wgrad: bool | None) -> SpeedSetting:
    name = "gradient_accumulation_fusion"
    if not trainable:
        return SpeedSetting(name, "transformer", False, "a frozen role has no gradients")
    if apex_wgrad:
        return SpeedSetting(name, "transformer", True, "weight-gradient GEMMs accumulate into DDP's main_grad "
                            "(Apex's fused_weight_gradient_mlp_cuda; TransformerEngine's linear layers natively)")
    needs = ("megatron's own output layer needs Apex's fused_weight_gradient_mlp_cuda even under TransformerEngine's "
             "spec")
    if apex_wgrad is None:
        return SpeedSetting(name, "transformer", False, f"{needs}: on where Apex imports on the workers")
    return SpeedSetting(name, "transformer", False, f"{needs}, which does not import on this worker")


def _overlaps(trainable: bool, data_parallel: int, distributed_optimizer: bool,
              user_ddp: Mapping[str, object]) -> list[SpeedSetting]:
    if not trainable:
        return []  # a frozen role has no DDP wrapper
    if data_parallel <= 1:
        reason = "data-parallel size 1: no gradient reduce or parameter all-gather to overlap"
        return [SpeedSetting(name, "ddp", False, reason) for name in DDP_SPEED_FIELDS]
    grads = SpeedSetting("overlap_grad_reduce", "ddp", True,
                         "each gradient bucket's reduce starts in the backward pass as soon as its grads are ready")
    if not distributed_optimizer:
        params = SpeedSetting("overlap_param_gather", "ddp", False,
                              "needs use_distributed_optimizer (without it every rank steps every parameter)")
    elif not user_ddp.get("overlap_grad_reduce", True):
        params = SpeedSetting("overlap_param_gather", "ddp", False,
                              "goes with overlap_grad_reduce, which the job turns off (Megatron-LM's rule)")
    else:
        params = SpeedSetting("overlap_param_gather", "ddp", True,
                              "the distributed optimizer's parameter all-gather overlaps the next mini-batch's "
                              "forward; completed at the end of each update, before anything reads the weights")
    return [grads, params]


def _as_user_set(setting: SpeedSetting, user: Mapping[str, object]) -> SpeedSetting:
    if setting.name not in user:
        return setting
    on = bool(user[setting.name])
    return SpeedSetting(setting.name, setting.kind, on, f"set by the job (the default: {setting.describe()})"
                        if on != setting.on else setting.why)


def transformer_values(settings: tuple[SpeedSetting, ...]) -> dict[str, bool]:
    return {s.name: s.on for s in settings if s.kind == "transformer"}


def ddp_values(settings: tuple[SpeedSetting, ...]) -> dict[str, bool]:
    return {s.name: s.on for s in settings if s.kind == "ddp"}
