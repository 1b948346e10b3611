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
from hybridrl.config.schema import JobConfig
from hybridrl.models.arch import ModelShape, UnsupportedModelError, read_hf_config, value_model_hf_config
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


def role_model_shape(config: JobConfig, role: str, actor_shape: ModelShape) -> ModelShape:
    """The model a role runs: the critic's, reward model's or teacher's own folder when it has a readable config,
    else the actor's shape (value models default to the policy's backbone)."""
    sections = {Role.CRITIC: config.critic, Role.REWARD_MODEL: config.reward_model, Role.TEACHER: config.teacher}
    section = sections.get(role)
    path = section.model.path if section is not None else None
    if not path or path == config.actor_rollout_ref.model.path or not (Path(path) / "config.json").is_file():
        return actor_shape
    try:  # as the workers build it (`training.value_head.value_model_source`; the teacher is a causal LM)
        hf_config = read_hf_config(path)
        return ModelShape.from_hf_config(hf_config if role == Role.TEACHER else value_model_hf_config(hf_config))
    except (UnsupportedModelError, ValueError, KeyError, OSError):
        return actor_shape
