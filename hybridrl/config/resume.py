"""Which checkpoint a job resumes from, and whether it can: checked by the plan before any process starts.

`train` resumes (`trainer.resume_mode`: auto finds the newest complete checkpoint under
trainer.default_local_dir/<project>/<experiment>, or an explicit checkpoint folder) only once Ray and every
worker are up; what it would refuse there, and the plan can tell from a few small files, is refused here:

* the checkpoint folder itself: a file, missing, an interrupted save, an unreadable trainer state
  (`hybridrl.persistence.resolve_resume` / `read_step_state`, what the trainer calls);
* a role this job trains with no complete folder in it (a GRPO checkpoint has no critic/ for a PPO job):
  each role's `role_checkpoint.json` is written last, so its presence is the folder's completeness;
* the data loader's saved state against this job's loader (`hybridrl.data.loader_state.state_mismatches`, the
  loader's own rule): seed, batch size, shuffle, and the dataset's size where the plan can know it: exactly when
  no prompt can be dropped (data.filter_overlong_prompts=false, data.on_malformed=error), else only that fewer
  rows than the saved loader's prompts cannot match; the rows of data.train_files when the checkpoint recorded
  them (`train_rows`, written since the plan checks them).

* another model than a trained role's checkpoint was saved from (its `role_checkpoint.json` records the model's
  shape; compared field by field as the workers compare it at load, `training.checkpointing._check_model`).

What needs the model's tensors (a damaged file, LoRA settings) stays the workers' check at load.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridrl.algorithms.kl_control import kl_controller_from_config
from hybridrl.config.errors import ConfigIssue
from hybridrl.config.model_shapes import own_model_shape
from hybridrl.config.schema import JobConfig, OptimConfig
from hybridrl.data.loader_state import state_mismatches
from hybridrl.models.arch import ModelShape
from hybridrl.names import Role
from hybridrl.persistence import ROLE_CHECKPOINT_FILE, CheckpointError, read_step_state, resolve_resume

FIELD = "trainer.resume_mode"
# the loader's checked fields -> the config field that sets each (drop_last is always on for training)
LOADER_FIELDS = {"seed": "trainer.seed", "batch_size": "data.train_batch_size", "shuffle": "data.shuffle",
                 "dataset_size": "data.train_files"}


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint `train` resumes from: its folder, its step, and how it was chosen (auto or a path)."""

    path: str
    step: int
    mode: str
    # what the resumed run takes otherwise than from the checkpoint, as `train` will say it ("resumed from ...; ")
    notes: tuple[str, ...] = ()
    # each trained role's optimizer steps taken by the checkpoint (its role_checkpoint.json): the schedules' position
    optimizer_steps: tuple[tuple[str, int], ...] = ()


def checkpointed_roles(critic: bool) -> tuple[Role, ...]:
    """The roles whose training state a checkpoint holds and a resume loads (the reference and a teacher are
    read from their model folders)."""
    return (Role.ACTOR, Role.CRITIC) if critic else (Role.ACTOR,)


def check_resume(config: JobConfig, issues: list[ConfigIssue], *, critic: bool,
                 train_rows: int | None, model: ModelShape | None = None) -> ResumePoint | None:
    """The checkpoint this job resumes from (None: a fresh start), appending to `issues` every reason `train`
    would refuse it after start-up. `train_rows`: the rows of data.train_files as the data check counted them
    (None: not known, the files being refused); `model`: the actor's model (None: not known)."""
    mode = config.trainer.resume_mode
    if not isinstance(mode, str) or mode not in ("auto", "disable") and not Path(mode).exists():
        return None  # a wrong type is the schema's refusal, a missing path validate's
    try:
        found = resolve_resume(config.trainer.checkpoint_root, mode)
        if found is None:
            return None
        state = read_step_state(found)
    except CheckpointError as error:
        issues.append(ConfigIssue(FIELD, mode, str(error).removeprefix(f"{FIELD}={mode}: ")))
        return None
    roles = checkpointed_roles(critic)
    metadata = {role: _role_metadata(found / role / ROLE_CHECKPOINT_FILE) for role in roles}  # read once each
    point = ResumePoint(str(found), state["global_step"], mode, _kl_notes(config, state), _optimizer_steps(metadata))
    where, outs = _where_and_outs(found, point.step, mode)
    for role in roles:
        if not (found / role / ROLE_CHECKPOINT_FILE).is_file():
            what, why = (("no", "it was saved by a job without one (a critic-free estimator, such as grpo)")
                         if not (found / role).exists() else ("an incomplete", "its save did not finish"))
            issues.append(ConfigIssue(FIELD, mode, (
                f"resumes from {found} (step {point.step}), which holds {what} {role} checkpoint "
                f"(no {role}/{ROLE_CHECKPOINT_FILE}), but this job trains the {role}: {why}; {outs}")))
        else:
            _check_model(config, role, metadata[role], model, where, outs, issues)
    _check_loader(config, state, where, outs, train_rows, issues)
    return point


def _kl_notes(config: JobConfig, state: dict[str, Any]) -> tuple[str, ...]:
    """`train`'s word on the KL coefficient a resume goes on with, where it is not the checkpoint's (a fixed one is the
    job's setting; an adaptive one whose settings changed starts again): `RunState.restore`'s note. Nothing where the
    job's controller settings are refused (validate names them)."""
    try:
        note = kl_controller_from_config(config.algorithm.kl_ctrl).resume(state.get("kl_coef"), state.get("kl_ctrl"))
    except (TypeError, ValueError):
        return ()
    return (note,) if note else ()


def _role_metadata(path: Path) -> dict[str, Any] | None:
    """A role's role_checkpoint.json, None where it is absent or unreadable (the workers name that at load)."""
    try:
        metadata = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return metadata if isinstance(metadata, dict) else None


def _optimizer_steps(metadata: dict[Role, dict[str, Any] | None]) -> tuple[tuple[str, int], ...]:
    """The optimizer steps each role's checkpoint records (`optimizer_steps` of its role_checkpoint.json; a role
    without a readable count is left out: its folder's problems are the checks' below, or the workers')."""
    counts = []
    for role, saved in metadata.items():
        count = saved.get("optimizer_steps") if saved is not None else None
        if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
            counts.append((str(role), count))
    return tuple(counts)


def schedule_notes(point: ResumePoint, steps_per_step: dict[str, int], schedules: dict[str, OptimConfig]
                   ) -> tuple[str, ...]:
    """`train`'s workers' word on a learning-rate schedule whose position a resume rescales: a job that takes another
    number of optimizer steps a training step (ppo_mini_batch_size, ppo_epochs) than the checkpoint's run goes on
    from the same point of the run, its optimizer-step count scaled (`training.lr_schedule.LRSchedule.
    load_state_dict`). Said only where the position moves the rate (a warmup or a decay)."""
    notes = []
    for role, saved in point.optimizer_steps:
        now, optim = steps_per_step.get(role), schedules.get(role)
        if now is None or optim is None or point.step <= 0 or saved % point.step:
            continue
        before = saved // point.step
        # a warmup as `LRSchedule.from_config` reads it: lr_warmup_steps, or the ratio where that is -1
        warmup = optim.lr_warmup_steps > 0 or (optim.lr_warmup_steps < 0 and optim.lr_warmup_steps_ratio > 0)
        if before and before != now and (warmup or optim.lr_decay_style != "constant"):
            position = round(saved * now / before)
            notes.append(f"the {role}'s learning-rate schedule goes on from optimizer step {position} (the "
                         f"checkpoint's {saved} at {before} a training step, this job's {now}: the same point of the "
                         "run)")
    return tuple(notes)


def _where_and_outs(found: Path, step: int, mode: str) -> tuple[str, str]:
    """How a refusal names the checkpoint, and the ways out of it."""
    outs = ("start fresh with trainer.resume_mode=disable, or give this run a new trainer.default_local_dir"
            if mode == "auto" else "name another checkpoint, or start fresh with trainer.resume_mode=disable")
    return f"the checkpoint it resumes from ({found}, step {step})", outs


def check_kept_prompts(config: JobConfig, found: Path, state: dict[str, Any], loader: dict[str, Any],
                       kept: str) -> list[ConfigIssue]:
    """`train`'s check once it has read data.train_files whole, before Ray or any worker starts: the prompts its
    loader kept (`loader`, its state; `kept`, how many of how many rows) against those the checkpoint's loader was
    built from. Filtering (data.max_prompt_length with filter_overlong_prompts, data.on_malformed=skip) decides
    them, which the plan cannot count without tokenizing every prompt; the workers' loader refused the resume at
    load, after every worker had started, naming no setting."""
    saved = state.get("dataloader")
    if not isinstance(saved, dict):
        return []
    differ = [(was, now) for name, was, now in state_mismatches(saved, loader) if name == "dataset_size"]
    if not differ:
        return []
    was, now = differ[0]
    where, outs = _where_and_outs(found, int(state["global_step"]), config.trainer.resume_mode)
    data = config.data
    field, value = (("data.max_prompt_length", data.max_prompt_length) if data.filter_overlong_prompts
                    else ("data.train_files", data.train_files))
    return [ConfigIssue(field, value, (
        f"leaves {now} prompts to train on ({kept}); the data loader of {where} saved {was} prompts: the saved data "
        "order cannot continue with another number of prompts; keep the prompts it kept (the data.train_files, "
        f"data.max_prompt_length, data.filter_overlong_prompts, data.on_malformed and tokenizer it ran with), or {outs}"
    ))]


def _check_model(config: JobConfig, role: Role, metadata: dict[str, Any] | None, actor: ModelShape | None, where: str,
                 outs: str, issues: list[ConfigIssue]) -> None:
    """A trained role's model against the one its checkpoint was saved from (the shape `role_checkpoint.json`
    records), as the workers compare them at load: the actor's model; the critic's own folder, else the actor's
    backbone, as a value model (untied)."""
    if metadata is None:
        return  # unreadable: the workers name it at load
    saved = metadata.get("shape")
    if role == Role.ACTOR:
        field, path, shape = "actor_rollout_ref.model.path", config.actor_rollout_ref.model.path, actor
    else:
        own = config.critic.model.path
        field = "critic.model.path"
        path = own or config.actor_rollout_ref.model.path
        shape = own_model_shape(config, role) or (
            dataclasses.replace(actor, tie_word_embeddings=False) if actor is not None else None)
    if not isinstance(saved, dict) or shape is None:
        return
    now = json.loads(json.dumps(shape.to_dict()))
    differ = [f"{k}={saved.get(k)!r} (this model: {now.get(k)!r})" for k in sorted(set(now) | set(saved))
              if now.get(k) != saved.get(k)]
    if differ:
        issues.append(ConfigIssue(field, path, (
            f"is another model than the one {where} saved its {role} from: " + ", ".join(differ)
            + f" there; a resume continues that model's weights and optimizer state: give the model it trained, or "
            f"{outs}")))


def _check_loader(config: JobConfig, state: dict[str, Any], where: str, outs: str, train_rows: int | None,
                  issues: list[ConfigIssue]) -> None:
    saved = state.get("dataloader")
    if not isinstance(saved, dict):
        return  # the trainer state is the trainer's to refuse at load
    data = config.data
    current: dict[str, Any] = {"seed": config.trainer.seed, "batch_size": data.train_batch_size,
                               "shuffle": data.shuffle, "drop_last": True}
    exact = not data.filter_overlong_prompts and data.on_malformed == "error"
    if train_rows is not None and exact:
        current["dataset_size"] = train_rows
    rule = f"the saved data order cannot continue with another one (the data loader refuses it at resume); {outs}"
    for name, was, now in state_mismatches(saved, current):
        field = LOADER_FIELDS.get(name, FIELD)
        value = now if field != "data.train_files" else data.train_files
        noun = " prompts" if name == "dataset_size" else ""
        issues.append(ConfigIssue(field, value, f"differs from {where}: its data loader saved {name} {was!r}{noun}, "
                                                f"this job's is {now!r}{noun}: {rule}"))
    if train_rows is None or "dataset_size" in current:
        return
    saved_size, saved_rows = saved.get("dataset_size"), state.get("train_rows")
    if isinstance(saved_rows, int) and saved_rows != train_rows:
        issues.append(ConfigIssue("data.train_files", data.train_files, (
            f"hold {train_rows} rows; the data loader of {where} was built from {saved_rows} rows "
            f"({saved_size} prompts kept): other data than it trained on: {rule}")))
    elif isinstance(saved_size, int) and train_rows < saved_size:
        issues.append(ConfigIssue("data.train_files", data.train_files, (
            f"hold {train_rows} rows, fewer than the {saved_size} prompts the data loader of {where} saved "
            f"(dataset_size): {rule}")))
