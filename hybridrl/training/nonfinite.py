"""Non-finite steps: detect NaN/Inf in a step's losses or gradients before the optimizer applies them.

Megatron's fp32 and bf16 optimizers step whatever the gradients hold (only fp16's loss scaler checks
for overflow): a NaN gradient with clipping on gives a NaN clip coefficient that is silently not
applied, and Adam then writes NaN into every weight. So `MegatronBackend.train_step` asks
`step_is_finite` first and skips the optimizer step when any rank saw a non-finite value; the
decision is all-reduced, so every rank (TP, PP, DP) skips together and the replicas stay identical.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from hybridrl.parallel.device import collective_device


def _local_finite(models: Iterable[Any], micro_metrics: Sequence[Mapping[str, Any]]) -> bool:
    for metrics in micro_metrics:  # the last stage's per-micro-batch losses (empty elsewhere)
        for value in metrics.values():
            if isinstance(value, torch.Tensor) and value.is_floating_point() and not torch.isfinite(value).all():
                return False
    for model in models:
        for param in model.parameters():
            # DDP accumulates into `main_grad` (views of its fp32 grad buffers); plain modules use `grad`.
            grad = getattr(param, "main_grad", None)
            if grad is None:
                grad = param.grad
            if grad is not None and not _all_finite(grad):
                return False
    return True


def _all_finite(tensor: torch.Tensor) -> bool:
    """Whether every element is finite. A sum with a NaN or an Inf term is never finite, so a finite sum
    proves it in one read of the tensor, without an elementwise mask as large as the tensor (a
    135M-parameter model's grads: ~0.5 s of page faults a step on CPU); only a non-finite sum, which
    finite values can also give by overflowing, is looked at element by element."""
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


def step_is_finite(models: Iterable[Any], micro_metrics: Sequence[Mapping[str, Any]]) -> bool:
    """True when no rank of the default process group saw a non-finite loss or gradient this step."""
    import torch.distributed as dist

    finite = _local_finite(models, micro_metrics)
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return finite
    bad = torch.tensor([0.0 if finite else 1.0], device=collective_device())
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return bool(bad.item() == 0.0)
