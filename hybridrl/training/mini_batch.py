"""One optimizer step over a mini-batch of this rank's rows — shared by every trained role.

Cut the mini-batch into micro-batches (fixed size, or by token budget with the count agreed over
DP), count the loss normalizers over all micro-batches of all DP ranks (so the loss does not depend
on the cut, see `hybridrl.algorithms.aggregation`), run megatron's schedule with the loss scaled by
`num_microbatches * dp_size` (undoing the schedule's and DDP's averaging; `/ cp` under context
parallelism, see `loss_scale`), and reduce the
micro-batch metrics over DP on the last pipeline stage.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from hybridrl.algorithms.aggregation import global_loss_normalizers
from hybridrl.data.batch import Batch
from hybridrl.training.backend import MegatronBackend
from hybridrl.training.metrics import StepMetrics


def loss_scale(num_microbatches: int, ctx: Any) -> float:
    """The factor on a micro-batch's share of the mini-batch loss that makes megatron's update its gradient.

    megatron's schedule divides a returned loss by the number of micro-batches and multiplies it by
    CP; DDP averages gradients over DP × CP. Under CP every CP rank computes the whole micro-batch's
    loss (`hybridrl.training.backend._model_forward`) and the CP gathers' backward sums the CP ranks'
    gradients, i.e. the gradient of CP × the loss. Hence num_microbatches × DP / CP: the update
    equals CP = 1's (`tests/training/test_context_parallel.py`).
    """
    scale = num_microbatches * ctx.dp
    return scale / ctx.cp if ctx.cp > 1 else scale


def train_mini_batch(
    backend: MegatronBackend, batch: Batch, mini_rows: Sequence[int], micro_batch_size: int, loss: Callable[..., Any],
    *, extra_keys: tuple[str, ...], dynamic: bool, max_tokens: int, response_tokens_only: bool = False,
) -> tuple[dict[str, float], bool]:
    """`loss(micro, output, *, normalizers, scale)` as the roles define it (`response_tokens_only`: see
    `MegatronBackend.train_step`).

    Returns the step's metrics and whether the optimizer applied it (False: a non-finite step skipped).
    """
    ctx = backend.ctx
    mini_rows = list(mini_rows)
    partition = backend.partition(batch.tensors, micro_batch_size, rows=mini_rows, dynamic=dynamic,
                                  max_tokens=max_tokens)
    micros = backend.micro_batches(batch.tensors, [[mini_rows[r] for r in part] for part in partition],
                                  extra_keys=extra_keys)
    normalizers = global_loss_normalizers([m.response_mask for m in micros], ctx.dp_group)
    result = backend.train_step(micros, partial(loss, normalizers=normalizers, scale=loss_scale(len(micros), ctx)),
                                response_tokens_only=response_tokens_only)
    step = {"grad_norm": result.grad_norm, "lr": result.lr}
    if ctx.is_last_pp_stage:
        sums = StepMetrics()
        for metrics in result.micro_metrics:
            sums.add_micro(metrics)
        step.update(sums.reduce_over(ctx.dp_group))
    return step, result.applied
