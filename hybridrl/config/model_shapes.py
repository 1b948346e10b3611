"""The models a job names, as shapes: the actor's (`load_model_shape`, its config.json read once per plan) and each
role's own (`role_model_shape`: the critic's, reward model's or teacher's folder where it has one).

Torch-free; file reads only. Below `validate` in the config line, so that both the rules (e.g. the teacher's own
layout, `distillation_rules`) and the plan read a shape the same way: one refusal for an unsupported or unreadable
config.json.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

from hybridrl.config.errors import ConfigIssue
from hybridrl.config.resolve import model_section_of
from hybridrl.config.schema import JobConfig
from hybridrl.models.arch import NOT_A_CONFIG, ModelShape, UnsupportedModelError, value_model_hf_config
from hybridrl.names import Role


def load_model_shape(path: str, issues: list[ConfigIssue], warnings: list[str], field: str, *,
                     quiet: bool = False) -> ModelShape | None:
    """The model's shape from `<path>/config.json`, or None (with a warning, unless `quiet`: the input checks
    then refuse the folder) when not available."""
    config_file = Path(path) / "config.json" if path else None
    if config_file is None or not config_file.is_file():
        if quiet:
            return None
        warnings.append(
            f"{field}={path or '<empty>'}: no config.json there; model-dependent checks (heads, layers, "
            "vocab, lengths) and memory estimates skipped"
        )
        return None
    try:
        return _shape_of_folder(str(Path(path).resolve()), config_file.read_bytes())
    except UnsupportedModelError as exc:
        issues.append(ConfigIssue(field, path, str(exc)))
    except (KeyError, ValueError, json.JSONDecodeError) as exc:
        issues.append(ConfigIssue(field, path, f"config.json is unreadable or incomplete: {exc}"))
    return None


@functools.lru_cache(maxsize=32)
def _shape_of_folder(folder: str, config_json: bytes) -> ModelShape:
    """A folder's shape, built once while its config.json holds the same bytes (part of the key: a file rewritten
    within the clock's granularity still counts as new): `hybridrl plan --search` plans hundreds of layouts of one
    model, and a shape keeps its per-layer counts."""
    return ModelShape.from_hf_dir(folder)


def own_model_shape(config: JobConfig, role: Role, issues: list[ConfigIssue] | None = None) -> ModelShape | None:
    """The model in a role's own folder (the critic's, reward model's or teacher's), as its workers build it: None
    where the role has none (no path, the actor's path, or no config.json there: the input checks refuse a missing
    folder). A config.json hybridrl cannot build (unsupported, unreadable, not an object) is a problem in `issues`
    naming the role's field, and None."""
    sections = {Role.CRITIC: config.critic, Role.REWARD_MODEL: config.reward_model, Role.TEACHER: config.teacher}
    section = sections.get(role)
    path = section.model.path if section is not None else None
    if not path or path == config.actor_rollout_ref.model.path:
        return None
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        return None
    field = f"{model_section_of(role)}.model.path"
    try:
        return _role_shape_of(config_file.read_bytes(), value_model=role != Role.TEACHER)
    except UnsupportedModelError as exc:
        problem = str(exc)
    except (KeyError, ValueError, OSError) as exc:
        problem = f"config.json is unreadable or incomplete: {exc}"
    if issues is not None:
        issues.append(ConfigIssue(field, path, problem))
    return None


@functools.lru_cache(maxsize=32)
def _role_shape_of(config_json: bytes, *, value_model: bool) -> ModelShape:
    """A role's shape from its config.json's bytes, built once (the layout search plans hundreds of layouts); a
    value model (critic, reward model) as `training.value_head.value_model_source` builds it, the teacher as a
    causal LM."""
    try:
        hf_config = json.loads(config_json)
    except ValueError as exc:  # JSONDecodeError, or bytes that are not UTF-8
        raise UnsupportedModelError(f"config.json is not valid JSON ({exc}): {NOT_A_CONFIG}") from exc
    if isinstance(hf_config, dict) and value_model:
        hf_config = value_model_hf_config(hf_config)
    return ModelShape.from_hf_config(hf_config)


def role_model_shape(config: JobConfig, role: str, actor_shape: ModelShape) -> ModelShape:
    """The model a role runs: its own folder's (`own_model_shape`; validation has refused one it cannot build), else
    the actor's shape (value models default to the policy's backbone)."""
    return own_model_shape(config, Role(role)) or actor_shape
