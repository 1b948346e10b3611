"""verl's keys at verl's own defaults: taken as changing nothing, so a whole verl config file plans.

A whole verl YAML (verl's generated trainer config, or the `.hydra/config.yaml` a verl run saves) writes every key
verl has, most at verl's default: the feature off, null, `{}`. hybridrl has no field for hundreds of them. Each
such key whose value is verl's default (`verl_default_values.VERL_DEFAULTS`) asks for nothing beyond what verl does
by default, and is taken as changing nothing; the plan says how many, and lists them in its JSON. The same key at
any other value is a setting of the user's and stays refused by name (with verl's default, or its `verl_keys`
reason). A few hybridrl fields have a verl default that means "not set" (`VERL_UNSET`, `VERL_NULL_UNSET`): in the
file it leaves hybridrl's default. verl's mandatory `???` must be given by the command line or the file.

Hydra's `_target_` entries name the class verl instantiates a section as. At the class verl's trainer config names
there (either trainer's: Megatron or FSDP) it is metadata, ignored; any other class is the user's own (a custom
config, reward manager or engine class) that hybridrl cannot instantiate, and is refused naming it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybridrl.config.verl_default_values import VERL_DEFAULTS, VERL_NULL_UNSET, VERL_VERSION
from hybridrl.config.verl_interpolation import MARK, InterpolatedConfig

TARGET = "_target_"
MISSING = "???"  # OmegaConf's mandatory value: verl's config leaves it for the user to set
# hybridrl fields where verl's default means "not set" though it is not null: verl reads the rollout's own nodes and
# GPUs only for a rollout pool of its own (its separate-async trainers), and 0 nodes is none; hybridrl's
# actor_rollout_ref.rollout.mode=colocated (the default) runs vLLM on the training ranks
VERL_UNSET: dict[str, Any] = {
    "actor_rollout_ref.rollout.nnodes": 0,
    "actor_rollout_ref.rollout.n_gpus_per_node": "${oc.select:trainer.n_gpus_per_node,8}",
}


def _same(value: Any, default: Any) -> bool:
    """Equal as YAML values: True is not 1, but 2 is 2.0 (verl's `lr: 1e-6` against a file's `1.0e-06`)."""
    if isinstance(default, bool) or isinstance(value, bool):
        return type(value) is type(default) and value == default
    if isinstance(default, (int, float)) and isinstance(value, (int, float)):
        return value == default
    if isinstance(default, list) and isinstance(value, list):
        return len(value) == len(default) and all(_same(v, d) for v, d in zip(value, default))
    if isinstance(default, dict) and isinstance(value, dict):
        return value.keys() == default.keys() and all(_same(value[k], default[k]) for k in default)
    return type(value) is type(default) and value == default


@dataclass
class VerlDefaults:
    """One load's view of verl's defaults: the file's own config (its interpolated defaults resolve within it), and
    the keys found at verl's defaults."""
    # the file with the command line's overrides of its keys (a command-line value is compared in it), and as the file
    # wrote it (a file's value is: a saved verl config says what its own expressions gave, whatever the line changes)
    context: InterpolatedConfig | None = None
    file_context: InterpolatedConfig | None = None
    taken: list[str] = field(default_factory=list)  # verl keys at verl's defaults (dotted, as written)
    targets: list[str] = field(default_factory=list)  # `_target_` entries ignored as Hydra's metadata
    missing: list[tuple[str, ...]] = field(default_factory=list)  # verl's mandatory values (???) left to set

    def default_of(self, parts: tuple[str, ...]) -> Any:
        """verl's default for the key as its table writes it (an interpolation unresolved); _NONE for none."""
        return VERL_DEFAULTS.get(".".join(parts), _NONE)

    def matches(self, parts: tuple[str, ...], value: Any, from_file: bool = False) -> bool:
        """Whether `value` is verl's default for this key (`from_file`: the value the file gives, after its
        interpolations resolved). An interpolated default (the reference's layout follows the actor's) is met by the
        file writing that same expression, here or for a section above the key (the keys it names are checked
        where they are written), or by a value equal to what it resolves to in this config."""
        if from_file and self._follows(parts):
            return True
        default = self._resolved_default(parts, from_file)
        return default is not _NONE and _same(value, default)

    def unset(self, parts: tuple[str, ...], value: Any, from_file: bool) -> bool:
        """Whether a hybridrl field's value in the file is verl's way of leaving it unset (`VERL_UNSET`,
        `VERL_NULL_UNSET`). Never on the command line: a value given there is the user's (rollout.n_gpus_per_node=1
        for a pool of its own, which verl's default expression would also give)."""
        key = ".".join(parts)
        if not from_file:
            return False
        if key in VERL_NULL_UNSET and value is None:
            return True
        if key not in VERL_UNSET:
            return False
        # the file's own expression (whatever the line gives what it names), or the value it gives in the file
        written = self.file_context.written(parts) if self.file_context is not None else None
        return written == VERL_UNSET[key] or _same(value, self._resolve(parts, VERL_UNSET[key], True))

    def target_known(self, parts: tuple[str, ...], value: Any, from_file: bool = False) -> bool:
        """Whether a `_target_` names the class verl's own trainer config names at this place (or sits in a
        section that follows another by verl's own interpolation)."""
        if from_file and self._follows(parts):
            return True
        default = self._resolved_default(parts, from_file)
        return value in (default if isinstance(default, tuple) else (default,))

    def _resolved_default(self, parts: tuple[str, ...], from_file: bool) -> Any:
        """verl's default for the key, its interpolation resolved in this config; a key under a section whose
        default is an interpolation (`rollout.mtp: ${oc.select:actor_rollout_ref.model.mtp, null}`) takes its
        value from what the section resolves to. _NONE: verl has no such key, or its default does not resolve."""
        default = self.default_of(parts)
        if default is not _NONE:
            return self._resolve(parts, default, from_file)
        for depth in range(len(parts) - 1, 0, -1):
            section = self.default_of(parts[:depth])
            if isinstance(section, str) and MARK in section:
                node = self._resolve(parts[:depth], section, from_file)
                for part in parts[depth:]:
                    node = node.get(part, _NONE) if isinstance(node, dict) else _NONE
                return node
        return _NONE

    def _resolve(self, parts: tuple[str, ...], default: Any, from_file: bool) -> Any:
        if not (isinstance(default, str) and MARK in default):
            return default
        context = self.file_context if from_file else self.context
        if context is None:
            return _NONE
        try:
            return context.evaluate(parts, default)
        except Exception:  # noqa: BLE001 - a default that does not resolve here is not met
            return _NONE

    def _follows(self, parts: tuple[str, ...]) -> bool:
        node: Any = self.file_context.tree if self.file_context is not None else None
        for depth, part in enumerate(parts, 1):
            if not isinstance(node, dict) or part not in node:
                return False
            node = node[part]
            if isinstance(node, str) and MARK in node:
                return VERL_DEFAULTS.get(".".join(parts[:depth]), _NONE) == node
        return False


_NONE = object()


def refusal(parts: tuple[str, ...]) -> str:
    """Why a verl key without a hybridrl field, at a value other than verl's default, is refused."""
    return (f"is a verl setting hybridrl has no field for: it is taken only at verl {VERL_VERSION}'s default "
            f"{_show(VERL_DEFAULTS['.'.join(parts)])} (which changes nothing); remove it or set it back")


def missing_refusal() -> str:
    return "is left unset (???, a value verl's config makes the user give): set it, e.g. on the command line"


def target_refusal(default: Any) -> str:
    known = " or ".join(default) if isinstance(default, tuple) else default if default is not _NONE else None
    where = f"verl's trainer config names {known} here" if known else "verl's trainer config has no class here"
    return (f"names a class for Hydra to instantiate; hybridrl reads this section's keys into its own config and "
            f"instantiates no user class ({where}): remove the _target_ entry, or the custom class's setting")


def _show(value: Any) -> str:
    return "null" if value is None else repr(value)
