"""Metrics of one optimizer step, summed over micro-batches and DP ranks the way their math requires.

Two kinds:
* totals: losses aggregated with the mini-batch's global normalizers (`aggregate_loss(...,
  global_tokens=N)`): each micro-batch holds its share, so the mini-batch value is their *sum*
  over micro-batches and DP ranks (e.g. the PPO loss).
* means: per-token averages (clip fraction, approximate KL, entropy): weighted by each micro-batch's
  token count, so the result is the mean over every token of the mini-batch, however it was cut.
* maxima: the largest value over micro-batches and DP ranks (e.g. the rollout/trainer log-prob gap).

Only the last pipeline stage sees the loss; `reduce_over` runs there (DP group collective).
Across optimizer steps, `average_steps` takes the plain mean of each step's values.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist

from hybridrl.parallel.device import collective_device


class StepMetrics:
    """Accumulates one optimizer step's micro-batch metrics on this rank."""

    def __init__(self) -> None:
        self._totals: dict[str, float] = {}
        self._weighted: dict[str, float] = {}
        self._weights: dict[str, float] = {}
        self._maxima: dict[str, float] = {}

    def add_total(self, name: str, value: torch.Tensor | float) -> None:
        self._totals[name] = self._totals.get(name, 0.0) + float(value)

    def add_mean(self, name: str, value: torch.Tensor | float, weight: torch.Tensor | float) -> None:
        w = float(weight)
        self._weighted[name] = self._weighted.get(name, 0.0) + float(value) * w
        self._weights[name] = self._weights.get(name, 0.0) + w

    def add_max(self, name: str, value: torch.Tensor | float) -> None:
        self._maxima[name] = max(self._maxima.get(name, -math.inf), float(value))

    def add_micro(self, metrics: Mapping[str, torch.Tensor]) -> None:
        """A loss function's metric dict: `total/<name>`, `max/<name>` and `mean/<name>` with `weight`."""
        weight = metrics.get("weight", 1.0)
        for key, value in metrics.items():
            kind, _, name = key.partition("/")
            if kind == "total":
                self.add_total(name, value)
            elif kind == "mean":
                self.add_mean(name, value, weight)
            elif kind == "max":
                self.add_max(name, value)

    def reduce_over(self, group: dist.ProcessGroup | None) -> dict[str, float]:
        """Totals summed and means weighted over `group` (every rank must hold the same names)."""
        total_names, mean_names = sorted(self._totals), sorted(self._weighted)
        packed = torch.tensor(
            [self._totals[n] for n in total_names]
            + [self._weighted[n] for n in mean_names] + [self._weights[n] for n in mean_names],
            dtype=torch.float64,
        )
        if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1 and packed.numel():
            packed = packed.to(collective_device(group))
            dist.all_reduce(packed, group=group)
        values = packed.tolist()
        out = dict(zip(total_names, values[: len(total_names)]))
        weighted = values[len(total_names): len(total_names) + len(mean_names)]
        weights = values[len(total_names) + len(mean_names):]
        out.update({n: s / w if w else 0.0 for n, s, w in zip(mean_names, weighted, weights)})
        max_names = sorted(self._maxima)
        if max_names:
            maxima = torch.tensor([self._maxima[n] for n in max_names], dtype=torch.float64)
            if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
                maxima = maxima.to(collective_device(group))
                dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
            out.update(zip(max_names, maxima.tolist()))
        return out


def average_steps(steps: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Mean of each metric over optimizer steps (missing keys are averaged over the steps that have them)."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for step in steps:
        for key, value in step.items():
            sums[key] = sums.get(key, 0.0) + float(value)
            counts[key] = counts.get(key, 0) + 1
    return {key: sums[key] / counts[key] for key in sums}
