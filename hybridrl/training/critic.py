"""The critic on megatron: per-token values and the clipped value-loss update.

Batch columns (this DP rank's rows):
  in:  the model inputs of `sequences` (`input_ids`, `attention_mask`, `position_ids`, `responses`,
       `response_mask`).
  `compute_values` out: `values` `[B, R]`, the value of the state before each response token
       (the backbone's output at the column that predicts it), 0 where `response_mask` is 0.
  `update_critic` in: also `values` (the old values, for clipping) and `returns` `[B, R]`.
Results are returned on the output ranks (last pipeline stage, TP rank 0), None elsewhere.

Normalization and scaling are the actor's (see `actor`): global normalizers per mini-batch,
loss scaled by `num_microbatches * dp_size` for megatron's schedule and DDP.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridrl.algorithms.aggregation import LossNormalizers
from hybridrl.algorithms.losses import value_loss
from hybridrl.config.plan import Plan
from hybridrl.data.batch import Batch
from hybridrl.names import Role
from hybridrl.training.backend import MegatronBackend
from hybridrl.training.metrics import average_steps
from hybridrl.training.micro_batching import restore_order
from hybridrl.training.mini_batch import train_mini_batch
from hybridrl.training.sequences import ModelInputs


@dataclass(frozen=True)
class CriticUpdateMetrics:
    """Means over the optimizer steps of one `update_critic` call (per step in `per_step`)."""

    vf_loss: float
    vf_clipfrac: float
    vpred_mean: float
    grad_norm: float
    lr: float
    optimizer_steps: int
    per_step: tuple[dict[str, float], ...] = field(default=())
    skipped_steps: int = 0  # optimizer steps skipped for a non-finite loss or gradient

    def as_dict(self, prefix: str = "critic/") -> dict[str, float]:
        names = ("vf_loss", "vf_clipfrac", "vpred_mean", "grad_norm", "lr", "skipped_steps")
        return {prefix + n: getattr(self, n) for n in names}


def response_values(micro: ModelInputs, output: torch.Tensor) -> torch.Tensor:
    """`[b, R]` float32 values at the columns predicting each response token, from `[b, s, 1]`
    (`[1, t, 1]` packed)."""
    return micro.take(output, micro.predict_index).squeeze(-1).float()


class MegatronCritic:
    def __init__(self, backend: MegatronBackend, plan: Plan) -> None:
        if not backend.spec.value_head:
            raise ValueError("the critic needs a value-head backend (role_spec(plan, 'critic'))")
        self.backend = backend
        self.plan = plan
        critic = plan.config.critic
        self.clip = critic.cliprange_value
        self.agg = critic.loss_agg_mode
        self.norm_length = plan.resolved.response_length
        actor = plan.config.actor_rollout_ref.actor
        self.dynamic = actor.use_dynamic_bsz
        self.max_tokens = actor.ppo_max_token_len_per_gpu

    def compute_values(self, batch: Batch) -> Batch | None:
        backend = self.backend
        tensors = batch.tensors
        partition = backend.partition(tensors, self.plan.forward("values").micro_batch_size, dynamic=self.dynamic,
                                      max_tokens=self.max_tokens)
        micros = backend.micro_batches(tensors, partition)
        outputs = backend.forward_only(micros, response_values)
        if not backend.is_output_rank:
            return None
        values = restore_order(outputs, partition).cpu() * tensors["response_mask"].float()
        return Batch({"values": values})

    def update_critic(self, batch: Batch) -> CriticUpdateMetrics | None:
        backend = self.backend
        update = self.plan.update(Role.CRITIC)
        per_mini = update.sequences_per_rank_per_mini_batch
        rows = len(batch)
        if rows % per_mini:
            raise ValueError(f"{rows} rows on this rank do not split into critic mini-batches of {per_mini}")
        steps: list[dict[str, float]] = []
        skipped = 0
        for _epoch in range(update.ppo_epochs):
            for start in range(0, rows, per_mini):
                step, applied = train_mini_batch(
                    backend, batch, range(start, start + per_mini), update.micro_batch_size, self._value_loss,
                    extra_keys=("values", "returns"), dynamic=self.dynamic, max_tokens=self.max_tokens)
                skipped += not applied
                steps.append(step)
        backend.finish_param_gather()
        if not backend.is_output_rank:
            return None
        mean = average_steps(steps)
        return CriticUpdateMetrics(mean["vf_loss"], mean["vf_clipfrac"], mean["vpred_mean"], mean["grad_norm"],
                                   mean["lr"], len(steps), tuple(steps), skipped)

    def _value_loss(self, micro: ModelInputs, output: torch.Tensor, *, normalizers: LossNormalizers,
                    scale: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        values = response_values(micro, output)
        mask = micro.response_mask.to(values.dtype)
        loss, metrics = value_loss(
            values, micro.extras["values"].to(values.dtype), micro.extras["returns"].to(values.dtype), mask,
            self.clip, self.agg, **normalizers.as_kwargs(), norm_length=self.norm_length,
        )
        out = {
            "weight": mask.sum().detach(),
            "total/vf_loss": loss.detach().clone(),
            "mean/vf_clipfrac": metrics["clipfrac"],
            "mean/vpred_mean": metrics["vpred_mean"],
        }
        return loss * scale, out
