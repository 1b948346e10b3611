"""KL coefficient controllers: the only state in `hybridrl.algorithms`.

`FixedKLController` keeps beta constant. `AdaptiveKLController` follows Ziegler et al. 2019
("Fine-Tuning Language Models from Human Preferences"): after each step,
    error = clip(current_kl / target_kl - 1, -0.2, 0.2)
    beta <- beta * (1 + error * n_steps / horizon)
so beta grows when the policy drifts past the target KL and shrinks when it stays under it.

A checkpoint keeps the coefficient and the controller's settings (`settings`); a resumed run takes the coefficient
back only where it is state (`resume`): an adaptive controller's adapted value, saved by the same controller. A fixed
coefficient is a setting: the resumed job's `algorithm.kl_ctrl.kl_coef` applies, whatever the checkpoint's run used.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridrl.algorithms.names import KL_CONTROLLER_KINDS, unknown_name_message

PROPORTIONAL_ERROR_BOUND = 0.2


class FixedKLController:
    """A constant KL coefficient; `update` does nothing."""

    kind = "fixed"

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)
        self.initial = self.value  # the configured coefficient (algorithm.kl_ctrl.kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Kept for interface parity with `AdaptiveKLController`."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        self.value = float(state["value"])

    def settings(self) -> dict[str, Any]:
        """What a checkpoint records of the controller besides its coefficient: its kind and configured coefficient
        (`resume` compares them)."""
        return {"type": self.kind, "kl_coef": self.initial}

    def resume(self, saved_value: float | None, saved_settings: Mapping[str, Any] | None) -> str | None:
        """Continue from a checkpoint's coefficient (`saved_value`) where it is state: an adaptive controller's,
        saved by an adaptive controller with the same configured coefficient (a checkpoint without settings, written
        before they were recorded, counts as such). A fixed coefficient is this job's setting and stays. Returns a
        line saying which coefficient applies when the checkpoint's differs and is not taken, else None."""
        if saved_value is None:
            return None
        saved = float(saved_value)
        same = saved_settings is None or dict(saved_settings) == self.settings()
        if self.kind == "adaptive" and same:
            self.value = saved
            return None
        if saved == self.value:
            return None
        why = ("a fixed coefficient is a setting" if self.kind == "fixed" else
               f"the checkpoint's controller was {dict(saved_settings or {})}, this job's is {self.settings()}: "
               "the adaptive coefficient starts again from kl_coef")
        return (f"algorithm.kl_ctrl.kl_coef={self.value:g} applies from here on; the checkpoint's run had the KL "
                f"coefficient at {saved:g} ({why})")


class AdaptiveKLController(FixedKLController):
    """Proportional controller steering the measured KL toward `target_kl` over `horizon` steps."""

    kind = "adaptive"

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int | float):
        if target_kl <= 0:
            raise ValueError(f"target_kl must be positive, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"horizon must be positive, got {horizon}")
        super().__init__(init_kl_coef)
        self.target_kl = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Adjust the coefficient after `n_steps` samples (or steps) with mean KL `current_kl`."""
        error = float(current_kl) / self.target_kl - 1.0
        error = min(max(error, -PROPORTIONAL_ERROR_BOUND), PROPORTIONAL_ERROR_BOUND)
        self.value *= 1.0 + error * n_steps / self.horizon


def make_kl_controller(
    kind: str = "fixed",
    kl_coef: float = 0.001,
    target_kl: float | None = None,
    horizon: int | float | None = None,
) -> FixedKLController:
    """A controller of `kind` (`fixed` or `adaptive`; the adaptive one needs target_kl and horizon)."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        if target_kl is None or horizon is None:
            raise ValueError("an adaptive KL controller needs target_kl and horizon")
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(unknown_name_message("KL controller kind", kind, KL_CONTROLLER_KINDS))


def kl_controller_from_config(config: Any) -> FixedKLController:
    """Build a controller from a config section (a mapping or an object with attributes).

    Reads `type` (or `kind`), `kl_coef` (or `init_kl_coef`), `target_kl` and `horizon`.
    """
    def read(*names: str, default: Any = None) -> Any:
        for name in names:
            if isinstance(config, Mapping):
                if name in config:
                    return config[name]
            elif hasattr(config, name):
                return getattr(config, name)
        return default

    return make_kl_controller(
        kind=read("type", "kind", default="fixed"),
        kl_coef=read("kl_coef", "init_kl_coef", default=0.001),
        target_kl=read("target_kl"),
        horizon=read("horizon"),
    )
