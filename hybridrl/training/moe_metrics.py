"""Per-update router figures of a mixture-of-experts actor: the load-balancing loss megatron applied
and how unevenly the router spread the tokens over the experts.

- `actor/moe_aux_loss`: megatron's load-balancing loss without its coefficient, as its router records
  it per layer and micro-batch (`moe_utils.save_to_aux_losses_tracker`, name
  "load_balancing_loss"), averaged over the MoE layers and the update's micro-batches of every DP
  rank. Logged only while the loss is on (`moe_aux_loss_coeff > 0`, type aux_loss).
  The per-sequence loss (type seq_aux_loss) is logged under the same name.
- `actor/moe_z_loss`: megatron's router z-loss without its coefficient (the mean squared logsumexp of
  the router logits), averaged like the aux loss; logged while `moe_z_loss_coeff` is set.
- `actor/moe_expert_imbalance`: per MoE layer, the tokens routed to its busiest expert over the mean
  per expert (1 = even, top-k = every token to the same experts), from the routing map of every
  training forward of the update, counted over all DP/CP ranks; the mean over the layers. With a
  capacity factor these are the tokens each expert kept.
- `actor/moe_dropped_token_fraction`: of the top-k (token, expert) assignments the routers made in
  the update's training forwards, the share megatron dropped because the expert was over its
  capacity (`moe_expert_capacity_factor`; 0 without one), over every MoE layer and DP/CP rank.
  Before dropping every token has exactly top-k experts, so the dropped ones are top-k × tokens
  minus the kept ones. Kept: the routing map's entries, or with `moe_pad_expert_input_to_capacity`
  (whose map marks the padded capacity slots too) those with a non-zero routing probability (a
  kept expert whose probability underflowed to 0 counts as dropped: it adds nothing).
All four leave out padding (megatron's `padding_mask`, which the actor passes for MoE models).

Counted by forward hooks on megatron's `TopKRouter` modules (the routing map is its output).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

# megatron's tracker names: the load-balancing loss of type aux_loss or seq_aux_loss, the z-loss
AUX_LOSS_NAMES = ("load_balancing_loss", "seq_load_balancing_loss")
Z_LOSS_NAME = "z_loss"


class MoERouterMetrics:
    """Hooks on this rank's routers; `reset()` before an update, `collect()` (collective over the
    world group) after it."""

    def __init__(self, chunks: Sequence[Any], num_layers: int, num_experts: int, top_k: int) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.float64)
        self.calls = torch.zeros(num_layers, dtype=torch.float64)
        self.tokens = torch.zeros(num_layers, dtype=torch.float64)  # real tokens routed
        self._handles = []
        for chunk in chunks:
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    self._handles.append(module.register_forward_hook(self._hook, with_kwargs=True))

    def _hook(self, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return  # log-prob passes and the reference: not the update's routing
        probs, routing_map = output
        padding = args[1] if len(args) > 1 else kwargs.get("padding_mask")
        routed = routing_map.detach()
        if module.config.moe_pad_expert_input_to_capacity:  # the map holds the padded capacity slots too
            routed = routed & (probs.detach() != 0)
        real = routed.shape[0]
        if padding is not None:  # [s, b] in the routing map's token order (MoELayer transposed it)
            routed = routed & ~padding.reshape(-1, 1)
            real -= int(padding.sum())
        layer = module.layer_number - 1  # megatron's layer_number is global and 1-based
        self.counts[layer] += routed.sum(dim=0).to("cpu", torch.float64)
        self.calls[layer] += 1
        self.tokens[layer] += real

    def reset(self) -> None:
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        self.counts.zero_()
        self.calls.zero_()
        self.tokens.zero_()
        clear_aux_losses_tracker()

    def collect(self, ctx: Any, device: torch.device, sequence_parallel: bool) -> dict[str, float]:
        """The figures of the update since `reset()`, the same on every rank (all-reduced over the
        world group: every rank must call it)."""
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        tracker = get_moe_layer_wise_logging_tracker()

        def tracked(names: Sequence[str]) -> torch.Tensor | None:
            """The per-layer sum of megatron's tracked values under `names`, None if none is tracked."""
            entries = [tracker[name]["values"] for name in names if name in tracker]
            if not entries:
                return None
            return sum(entry.detach().to("cpu", torch.float64) for entry in entries)

        aux_losses, z_losses = tracked(AUX_LOSS_NAMES), tracked((Z_LOSS_NAME,))
        losses = torch.zeros(self.num_layers, dtype=torch.float64) if aux_losses is None else aux_losses
        # Without sequence parallelism TP peers route the same tokens: TP rank 0 counts them. The
        # micro-batches are counted once per DP rank (TP and CP rank 0). Every rank adds its part
        # of the loss: megatron's router splits each micro-batch's loss so that its parts over the
        # TP x CP group sum to it (`get_tokens_per_expert_and_token_count` over tp_cp_group).
        # The z-loss is each rank's mean over its own tokens: the ranks that hold distinct tokens (TP
        # rank 0, or every TP rank under sequence parallelism; every CP rank) each add theirs and
        # count their calls, so the figure is the mean over those (rank, micro-batch) terms.
        distinct = 1.0 if sequence_parallel or ctx.tp_rank == 0 else 0.0
        counts = self.counts * distinct
        calls = self.calls * float(ctx.tp_rank == 0 and ctx.cp_rank == 0)
        z_sum = torch.zeros_like(losses) if z_losses is None else z_losses * distinct
        packed = torch.cat([counts.reshape(-1), calls, losses, z_sum, self.calls * distinct,
                            self.tokens * distinct]).to(device)
        dist.all_reduce(packed)
        packed = packed.cpu()
        e, n = self.num_experts, self.num_layers
        counts = packed[: n * e].view(n, e)
        calls, losses, z_sum, z_calls, tokens = packed[n * e:].view(5, n)
        routed = calls > 0
        out: dict[str, float] = {}
        if routed.any():
            per_layer = counts[routed]
            out["actor/moe_expert_imbalance"] = float((per_layer.max(dim=1).values / per_layer.mean(dim=1)).mean())
            assigned = self.top_k * float(tokens.sum())
            out["actor/moe_dropped_token_fraction"] = (assigned - float(counts.sum())) / assigned if assigned else 0.0
            if aux_losses is not None:
                out["actor/moe_aux_loss"] = float((losses[routed] / calls[routed]).mean())
            if z_losses is not None:
                out["actor/moe_z_loss"] = float((z_sum[routed] / z_calls[routed]).mean())
        return out
