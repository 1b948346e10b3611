"""Tiny megatron-core GPT models on CPU, for the parallel-state tests (test-only helpers).

The production model builder lives in `hybridrl.models`; this one only needs to be small, fast and
deterministic. With `use_cpu_initialization=True` megatron initializes each weight as a full
"master" tensor from the (seeded) CPU default generator and keeps this rank's TP slice, so the
same seed gives TP shards that are exact slices of the TP=1 weights: that is what lets tests
compare layouts.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

VOCAB = 64
SEQ = 8
HIDDEN = 32
HEADS = 4
LAYERS = 4  # divisible by pp * vpp = 2 * 2


def tiny_config(num_layers: int = LAYERS, **overrides: Any):
    """A TransformerConfig for a tiny Llama-like model (RMSNorm, SwiGLU, no bias), CPU-safe."""
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    from hybridrl.parallel.cpu.layer import CPU_CONFIG_OVERRIDES
    from hybridrl.parallel.state import get_context

    ctx = get_context()
    kwargs: dict[str, Any] = dict(
        num_layers=num_layers,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_query_groups=2,
        ffn_hidden_size=64,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=ctx.tp,
        pipeline_model_parallel_size=ctx.pp,
        virtual_pipeline_model_parallel_size=ctx.vpp,
        context_parallel_size=ctx.cp,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        **CPU_CONFIG_OVERRIDES,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def tiny_gpt(config=None, vp_stage: int | None = None, **config_overrides: Any):
    """A GPTModel with the local (non-TE) spec for this rank's pipeline stage."""
    from megatron.core import parallel_state as mps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from hybridrl.parallel.device import rank_device

    config = config or tiny_config(**config_overrides)
    # built on the host (use_cpu_initialization), then moved where the rank's model lives, as the bridge does
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=mps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=mps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
        vp_stage=vp_stage,
    ).to(rank_device("cpu"))


def tokens(batch: int = 2, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels) from a private generator: identical on every rank, RNG streams untouched."""
    from hybridrl.parallel.device import rank_device

    gen = torch.Generator().manual_seed(seed)
    # drawn on the host, then where the model's inputs go (tagged as the GPU's under strict-device mode)
    data = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=gen).to(rank_device("cpu"))
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def position_ids(batch: int) -> torch.Tensor:
    from hybridrl.parallel.device import rank_device

    return torch.arange(SEQ, device=rank_device("cpu")).unsqueeze(0).expand(batch, SEQ).contiguous()


def gather_tp_logits(logits: torch.Tensor) -> torch.Tensor:
    """Full-vocab logits from vocab-parallel ones ([b, s, v/tp] on each TP rank)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    return gather_from_tensor_model_parallel_region(logits)


def microbatches(n: int, batch: int, seed: int = 0) -> Iterator[dict[str, torch.Tensor]]:
    """n microbatches for a forward_step_func."""
    for i in range(n):
        ids, labels = tokens(batch, seed + i)
        yield {"tokens": ids, "labels": labels, "position_ids": position_ids(batch)}


def forward_step(data_iterator, model):
    """megatron forward_step_func: mean token loss; loss_func returns (loss, {'loss': loss})."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

    def loss_func(per_token_loss: torch.Tensor):
        loss = per_token_loss.float().mean()
        # clone: the schedule divides the returned loss by num_microbatches in place.
        return loss, {"loss": loss.detach().clone()}

    return output, loss_func


# --------------------------------------------------------------------------------------------------
# Comparing layouts: load a full (TP=1, PP=1) state into a sharded model, train with megatron
# --------------------------------------------------------------------------------------------------
def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters of an unsharded (TP=1, PP=1) model, detached clones keyed by name."""
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def global_param_name(model: torch.nn.Module, local_name: str) -> str:
    """Translate `decoder.layers.<local i>.` to the global layer index of this pipeline stage."""
    parts = local_name.split(".")
    if len(parts) > 2 and parts[0] == "decoder" and parts[1] == "layers":
        layer = model.decoder.layers[int(parts[2])]
        parts[2] = str(layer.layer_number - 1)  # megatron's layer_number is global and 1-based
    return ".".join(parts)


def tp_slice(full: torch.Tensor, param: torch.nn.Parameter, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's shard of `full`, the way megatron partitions `param`.

    A TP-sharded parameter carries `partition_dim` and `partition_stride`: the full tensor is cut
    into tp*stride equal chunks along that dim and rank r keeps chunks r, r+tp, ... (stride 2 is the
    gated MLP's fc1: [gate_r; up_r]). Parameters without the attribute are replicated.
    """
    if not getattr(param, "tensor_model_parallel", False) or tp_size == 1:
        return full
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    chunks = torch.chunk(full, tp_size * stride, dim=dim)
    return torch.cat(chunks[tp_rank::tp_size], dim=dim)


def load_full_state(
    model: torch.nn.Module, full: dict[str, torch.Tensor], wrong_tp_order: bool = False
) -> int:
    """Copy this rank's slices of a full state into `model` (possibly DDP-wrapped); return count.

    `wrong_tp_order=True` loads the shards of the mirrored TP rank: a deliberately wrong layout
    that tests use to show their comparisons catch layout errors.
    """
    from megatron.core import parallel_state as mps

    module = model.module if hasattr(model, "module") else model
    tp_rank, tp_size = mps.get_tensor_model_parallel_rank(), mps.get_tensor_model_parallel_world_size()
    loaded = 0
    with torch.no_grad():
        for name, param in module.named_parameters():
            rank = tp_size - 1 - tp_rank if wrong_tp_order else tp_rank
            src = tp_slice(full[global_param_name(module, name)], param, rank, tp_size)
            if src.shape != param.shape:
                raise ValueError(f"{name}: shard {tuple(src.shape)} != param {tuple(param.shape)}")
            param.copy_(src)
            loaded += 1
    return loaded


def gather_full_state(model: torch.nn.Module, grads: bool = False) -> dict[str, torch.Tensor]:
    """Inverse of `load_full_state` across TP (this stage's params only), for checking results.

    `grads=True` gathers `param.grad` instead of the values.
    """
    from megatron.core import parallel_state as mps

    module = model.module if hasattr(model, "module") else model
    tp_size = mps.get_tensor_model_parallel_world_size()
    out = {}
    for name, param in module.named_parameters():
        value = (param.grad if grads else param).detach()
        if getattr(param, "tensor_model_parallel", False) and tp_size > 1:
            dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
            shards = [torch.empty_like(value) for _ in range(tp_size)]
            group = mps.get_tensor_model_parallel_group()
            torch.distributed.all_gather(shards, value.contiguous(), group=group)
            # shard r holds chunks r, r+tp, ...: interleave them back into order.
            per_rank = [torch.chunk(s, stride, dim=dim) for s in shards]
            value = torch.cat([per_rank[r][k] for k in range(stride) for r in range(tp_size)], dim=dim)
        out[global_param_name(module, name)] = value.clone()
    return out


def wrap_ddp_and_optimizer(
    module: torch.nn.Module, *, distributed_optimizer: bool, lr: float = 1e-2, clip_grad: float = 0.0,
    finalize: bool = True,
):
    """megatron DDP + optimizer on a built module, with the config hooks DDP needs.

    `finalize=False` leaves `finalize_model_grads_func` unset: the pitfall where DP replicas
    silently drift apart (tests show it).
    """
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = module.config
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False,
        use_distributed_optimizer=distributed_optimizer,
    )
    model = DistributedDataParallel(config, ddp_config, module)
    if finalize:
        config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model.no_sync
    opt_config = OptimizerConfig(
        optimizer="adam", lr=lr, weight_decay=0.0, clip_grad=clip_grad, bf16=False, fp16=False,
        params_dtype=torch.float32, use_distributed_optimizer=distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(opt_config, [model])
    return model, optimizer


def train_steps(model, optimizer, steps: int, num_microbatches: int, micro_batch: int,
                data_seed: int = 100) -> list[dict[str, float]]:
    """Run `steps` megatron train steps; per step: mean loss over the global batch, grad norm.

    Every DP rank takes its own slice of each step's global batch (microbatch seeds differ per DP
    rank), so any layout with dp * num_microbatches * micro_batch equal sees the same samples.
    """
    from megatron.core import parallel_state as mps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    dp_rank, dp = mps.get_data_parallel_rank(), mps.get_data_parallel_world_size()
    fwd_bwd = get_forward_backward_func()
    history = []
    for step in range(steps):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        base = data_seed + step * 1000 + dp_rank * num_microbatches
        losses = fwd_bwd(
            forward_step_func=forward_step, data_iterator=microbatches(num_microbatches, micro_batch, base),
            model=[model], num_microbatches=num_microbatches, seq_length=SEQ,
            micro_batch_size=micro_batch, forward_only=False,
        )
        _, grad_norm, _ = optimizer.step()
        history.append({"loss": mean_loss_over_dp(losses, dp), "grad_norm": float(grad_norm)})
    return history


def mean_loss_over_dp(losses: list[dict[str, torch.Tensor]], dp: int) -> float:
    """Mean microbatch loss of the global batch, known on every rank (0.0 sent by non-last stages)."""
    from megatron.core import parallel_state as mps

    from hybridrl.parallel.device import collective_device

    local = torch.stack([d["loss"] for d in losses]).mean() if losses else torch.zeros((), device=collective_device())
    total = local.reshape(1).clone()
    # Sum over DP of the last stage's values, then share with the other stages through PP.
    torch.distributed.all_reduce(total, group=mps.get_data_parallel_group())
    torch.distributed.all_reduce(total, group=mps.get_pipeline_model_parallel_group())
    return float(total.item() / dp)
