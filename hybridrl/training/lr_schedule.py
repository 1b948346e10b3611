"""Learning-rate schedule of one role's optimizer: linear warmup, then constant, linear or cosine decay.

Counted in optimizer steps. Step k (0-based, the k-th `optimizer.step()`) uses `lr_at(k)`:
    warmup (k < W):  init + (lr - init) * (k + 1) / W   -- from lr_warmup_init (init, default 0); the first step
                                                       already moves the weights
    constant:        lr
    linear/cosine:   from lr at k = W down to min_lr at k = total_steps, then min_lr.
We keep our own schedule rather than megatron's `OptimizerParamScheduler`, whose warmup starts at
`init_lr` exactly, so with init_lr 0 its first optimizer step would be a no-op.

A resume takes back the position (`step_count`); everything else is the resumed job's (lr, min_lr, warmup, decay
style, total). The total is the run's training steps x the optimizer steps each takes (`steps_per_step`); a job
resumed with another count per step (ppo_mini_batch_size, ppo_epochs) has its position rescaled to the same point of
the run, so the decay still ends with the last training step (kept as saved, it ended early or never).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from hybridrl.config.schema import OptimConfig

DECAY_STYLES = ("constant", "linear", "cosine")


@dataclass
class LRSchedule:
    lr: float
    min_lr: float = 0.0
    warmup_steps: int = 0
    decay_style: str = "constant"
    total_steps: int | None = None
    step_count: int = 0  # optimizer steps taken so far
    warmup_init: float = 0.0  # the lr the warmup rises from (lr_warmup_init)
    steps_per_step: int | None = None  # optimizer steps per training step (None: not known)

    def __post_init__(self) -> None:
        if self.decay_style not in DECAY_STYLES:
            raise ValueError(f"lr_decay_style={self.decay_style!r}; expected one of {DECAY_STYLES}")
        if self.decay_style != "constant" and not self.total_steps:
            raise ValueError(f"lr_decay_style={self.decay_style!r} needs the total number of optimizer steps")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")

    @classmethod
    def from_config(cls, optim: OptimConfig, total_steps: int | None = None,
                    steps_per_step: int | None = None) -> LRSchedule:
        """`lr_warmup_steps` (or, when -1, `lr_warmup_steps_ratio * total_steps`) warmup steps."""
        warmup = optim.lr_warmup_steps
        if warmup < 0:
            ratio = optim.lr_warmup_steps_ratio
            if ratio and not total_steps:
                raise ValueError("lr_warmup_steps_ratio needs the total number of optimizer steps")
            warmup = int(ratio * (total_steps or 0))
        return cls(optim.lr, optim.min_lr, warmup, optim.lr_decay_style, total_steps,
                   warmup_init=optim.lr_warmup_init, steps_per_step=steps_per_step)

    def lr_at(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.warmup_init + (self.lr - self.warmup_init) * (step + 1) / self.warmup_steps
        if self.decay_style == "constant":
            return self.lr
        if self.total_steps is None:  # refused by __post_init__, unless decay_style was changed since
            raise ValueError(f"lr_decay_style={self.decay_style!r} needs the total number of optimizer steps")
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        coeff = 1.0 - progress if self.decay_style == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr + coeff * (self.lr - self.min_lr)

    @property
    def current_lr(self) -> float:
        """The lr the next optimizer step uses."""
        return self.lr_at(self.step_count)

    def state_dict(self) -> dict[str, Any]:
        return {"step_count": self.step_count, "lr": self.lr, "min_lr": self.min_lr,
                "warmup_steps": self.warmup_steps, "decay_style": self.decay_style, "total_steps": self.total_steps,
                "warmup_init": self.warmup_init, "steps_per_step": self.steps_per_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The saved position; rescaled to this schedule's optimizer steps per training step where the saved run took
        another number (module docstring)."""
        count = int(state["step_count"])
        saved = state.get("steps_per_step")
        if saved and self.steps_per_step and saved != self.steps_per_step:
            count = round(count * self.steps_per_step / saved)
        self.step_count = count
