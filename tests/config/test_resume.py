"""`hybridrl plan` says which checkpoint a job resumes from and refuses, before any process starts, a resume
`train` would die on after Ray and the workers are up: a data loader state this job's loader refuses, a role
this job trains that the checkpoint holds no complete folder for, a resume path that is a file; and output
folders (checkpoints, the run folder, rollout dumps) that exist as files, or lie under one.

The checkpoints are written as `train` lays them out (`hybridrl.persistence`), with role folders holding only
their last-written metadata file: all the plan reads.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridrl.config import ConfigError, plan_from_sources
from hybridrl.config.report import render_plan, resume_line
from hybridrl.data.io import write_rows
from hybridrl.persistence import LATEST_FILE, ROLE_CHECKPOINT_FILE, STATE_FILE
from tools.demo_assets import demo_overrides

ROOT = Path(__file__).resolve().parents[2]
GRPO = str(ROOT / "configs/examples/cpu_tiny_grpo.yaml")
PPO = str(ROOT / "configs/examples/cpu_tiny_ppo.yaml")


def _rows(assets: Path) -> int:
    return sum(1 for line in (assets / "data" / "train.jsonl").read_text().splitlines() if line.strip())


def _checkpoint(root: Path, step: int, *, roles=("actor",), batch_size=8, dataset_size: int, seed=42,
                train_rows: int | None = None, kl_coef: float = 0.001) -> Path:
    """A complete step checkpoint as the trainer seals it: role folders, then the trainer state last."""
    folder = root / f"global_step_{step}"
    for role in roles:
        (folder / role).mkdir(parents=True)
        (folder / role / ROLE_CHECKPOINT_FILE).write_text("{}")
    loader = {"epoch": 0, "batches_done": step, "seed": seed, "dataset_size": dataset_size,
              "batch_size": batch_size, "shuffle": True, "drop_last": True}
    state = {"global_step": step, "dataloader": loader, "kl_coef": kl_coef,
             **({"train_rows": train_rows} if train_rows is not None else {})}
    (folder / STATE_FILE).write_text(json.dumps(state))
    (root / LATEST_FILE).write_text(f"{step}\n")
    return folder


@pytest.fixture
def job(demo_assets: Path, tmp_path: Path):
    """(overrides of the demo GRPO job run in tmp_path, its checkpoint root, the rows of its train file)."""
    overrides = demo_overrides(demo_assets, tmp_path / "run")
    return overrides, tmp_path / "run" / "ckpt" / "demo" / "cpu_tiny_grpo", _rows(demo_assets)


def _refusal(config: str, overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as caught:
        plan_from_sources(config, overrides, check_files=True)
    return str(caught.value)


def test_plan_says_where_a_run_starts(job):
    overrides, root, rows = job
    fresh = plan_from_sources(GRPO, overrides, check_files=True)
    assert fresh.resume is None and f"Resume: none, a fresh start (no complete checkpoint under {root}" \
        in render_plan(fresh)
    _checkpoint(root, 1, dataset_size=rows)
    latest = _checkpoint(root, 2, dataset_size=rows, train_rows=rows)
    plan = plan_from_sources(GRPO, overrides, check_files=True)
    assert plan.resume is not None and (plan.resume.path, plan.resume.step) == (str(latest), 2)
    assert f"Resume: from {latest} at step 2 (the newest complete checkpoint" in render_plan(plan)
    earlier = plan_from_sources(GRPO, [*overrides, f"trainer.resume_mode={root / 'global_step_1'}"],
                                check_files=True)
    assert earlier.resume.step == 1 and "(trainer.resume_mode)" in resume_line(earlier)
    off = plan_from_sources(GRPO, [*overrides, "trainer.resume_mode=disable"], check_files=True)
    assert off.resume is None and resume_line(off) == "Resume: none, a fresh start (trainer.resume_mode=disable)"
    # the plan's JSON carries it (what a user's tooling reads)
    assert json.loads(plan.to_json())["resume"] == {"path": str(latest), "step": 2, "mode": "auto", "notes": [],
                                                    "optimizer_steps": []}


def test_plan_says_which_kl_coefficient_a_resume_goes_on_with(job):
    """A fixed KL coefficient is the job's setting, not the checkpoint's: `train` says so on resuming, and the plan
    says it first (a user who changed kl_coef between the runs sees which applies before the run starts)."""
    overrides, root, rows = job
    latest = _checkpoint(root, 2, dataset_size=rows, train_rows=rows, kl_coef=0.002)
    plan = plan_from_sources(GRPO, [*overrides, "algorithm.kl_ctrl.kl_coef=0.001"], check_files=True)
    assert resume_line(plan) == (
        f"Resume: from {latest} at step 2 (the newest complete checkpoint under trainer.default_local_dir); "
        "trainer.resume_mode=disable starts fresh; algorithm.kl_ctrl.kl_coef=0.001 applies from here on; the "
        "checkpoint's run had the KL coefficient at 0.002 (a fixed coefficient is a setting)")
    same = plan_from_sources(GRPO, [*overrides, "algorithm.kl_ctrl.kl_coef=0.002"], check_files=True)
    assert same.resume is not None and same.resume.notes == ()


def test_plan_says_where_a_rescaled_learning_rate_schedule_goes_on_from(job):
    """A job resumed with another number of optimizer steps a training step (here 1 mini-batch a step where the
    checkpoint's run took 2) goes on from the same point of the run: the workers scale the schedule's optimizer-step
    count (`LRSchedule.load_state_dict`, checked against it here); the plan says where, before the run starts, where
    the position moves the rate (a decay or a warmup); a constant rate, or the same count a step, says nothing."""
    from hybridrl.training.lr_schedule import LRSchedule

    overrides, root, rows = job
    latest = _checkpoint(root, 3, dataset_size=rows, train_rows=rows)
    (latest / "actor" / ROLE_CHECKPOINT_FILE).write_text(json.dumps({"optimizer_steps": 6}))  # 2 a training step
    decay = ["actor_rollout_ref.actor.optim.lr_decay_style=cosine"]
    plan = plan_from_sources(GRPO, [*overrides, *decay], check_files=True)
    assert plan.update("actor").optimizer_steps_per_step == 1
    schedule = LRSchedule.from_config(plan.config.actor_rollout_ref.actor.optim, 100, steps_per_step=1)
    schedule.load_state_dict({"step_count": 6, "steps_per_step": 2})  # what the actor's workers do at load
    assert schedule.step_count == 3
    assert resume_line(plan).endswith(
        "; the actor's learning-rate schedule goes on from optimizer step 3 (the checkpoint's 6 at 2 a training step, "
        "this job's 1: the same point of the run)")
    assert json.loads(plan.to_json())["resume"]["optimizer_steps"] == [["actor", 6]]
    assert plan_from_sources(GRPO, overrides, check_files=True).resume.notes == ()  # a constant rate
    (latest / "actor" / ROLE_CHECKPOINT_FILE).write_text(json.dumps({"optimizer_steps": 3}))  # 1 a step, as now
    assert plan_from_sources(GRPO, [*overrides, *decay], check_files=True).resume.notes == ()


def test_a_changed_batch_size_or_seed_is_refused_naming_saved_and_new(job):
    overrides, root, rows = job
    latest = _checkpoint(root, 2, dataset_size=rows)
    text = _refusal(GRPO, [*overrides, "data.train_batch_size=16", "trainer.seed=7"])
    assert (f"data.train_batch_size=16 differs from the checkpoint it resumes from ({latest}, step 2): its data "
            "loader saved batch_size 8, this job's is 16") in text
    assert "trainer.seed=7 differs" in text and "saved seed 42, this job's is 7" in text
    assert "start fresh with trainer.resume_mode=disable, or give this run a new trainer.default_local_dir" in text
    assert "Traceback" not in text
    # the ways out are valid: neither refuses
    plan_from_sources(GRPO, [*overrides, "data.train_batch_size=16", "trainer.resume_mode=disable"], check_files=True)
    plan_from_sources(GRPO, [*overrides, "data.train_batch_size=16", f"trainer.default_local_dir={root / 'new'}"],
                      check_files=True)


def test_other_data_is_refused(job, tmp_path):
    overrides, root, rows = job
    _checkpoint(root, 1, dataset_size=rows)  # an older checkpoint: no train_rows; only the loader's size
    small = write_rows([{"prompt": "repeat: a", "reward_model": {"ground_truth": "a"}}] * 40, tmp_path / "s.jsonl")
    text = _refusal(GRPO, [*overrides, f"data.train_files=[{small}]"])
    assert f"data.train_files=['{small}'] hold 40 rows, fewer than the {rows} prompts the data loader" in text
    # more rows, while over-long prompts could be filtered out: the recorded rows of the checkpoint tell
    big = write_rows([{"prompt": "repeat: a", "reward_model": {"ground_truth": "a"}}] * (rows + 8),
                     tmp_path / "b.jsonl")
    _checkpoint(root, 2, dataset_size=rows, train_rows=rows)
    text = _refusal(GRPO, [*overrides, f"data.train_files=[{big}]"])
    assert f"hold {rows + 8} rows; the data loader of the checkpoint it resumes from" in text
    assert f"was built from {rows} rows ({rows} prompts kept)" in text
    # nothing dropped (no filtering, malformed rows refused): the size is known and compared as the loader does
    text = _refusal(GRPO, [*overrides, f"data.train_files=[{big}]", "data.filter_overlong_prompts=false",
                           f"trainer.resume_mode={root / 'global_step_1'}"])
    assert f"its data loader saved dataset_size {rows} prompts, this job's is {rows + 8} prompts" in text
    assert "name another checkpoint, or start fresh with trainer.resume_mode=disable" in text


def test_a_role_the_checkpoint_lacks_is_refused(job, tmp_path):
    overrides, root, rows = job
    grpo = _checkpoint(root, 1, dataset_size=rows, batch_size=16)  # actor only, the PPO job's batch size
    text = _refusal(PPO, [*overrides, f"trainer.resume_mode={grpo}"])
    assert (f"trainer.resume_mode={grpo} resumes from {grpo} (step 1), which holds no critic checkpoint "
            f"(no critic/{ROLE_CHECKPOINT_FILE}), but this job trains the critic") in text
    (grpo / "critic").mkdir()  # a critic folder whose save never finished
    assert "which holds an incomplete critic checkpoint" in _refusal(PPO, [*overrides, f"trainer.resume_mode={grpo}"])
    (grpo / "critic" / ROLE_CHECKPOINT_FILE).write_text("{}")
    assert plan_from_sources(PPO, [*overrides, f"trainer.resume_mode={grpo}"], check_files=True).resume.step == 1
    # a file is not a checkpoint folder
    text = _refusal(GRPO, [*overrides, f"trainer.resume_mode={grpo / STATE_FILE}"])
    assert f"trainer.resume_mode={grpo / STATE_FILE} is a file, not a checkpoint folder" in text


def test_another_model_is_refused_naming_what_differs(job, demo_assets):
    """A checkpoint of another model (another actor path, or a critic of its own) was refused by the workers at load,
    after Ray, vLLM and every worker had started; the plan now compares the shape each trained role's
    role_checkpoint.json records, as the workers do. Written here with the workers' own shape of each model
    (ModelSource, value_model_source): the same model plans."""
    from hybridrl.models.bridge import ModelSource
    from hybridrl.training.value_head import value_model_source

    overrides, root, rows = job
    folder = _checkpoint(root, 2, roles=("actor", "critic"), dataset_size=rows, batch_size=16)
    overrides = [*overrides, f"trainer.resume_mode={folder}"]
    model = demo_assets / "model"
    shapes = {"actor": ModelSource.from_path(model).shape.to_dict(),
              "critic": value_model_source(model).shape.to_dict()}
    for role, shape in shapes.items():
        (folder / role / ROLE_CHECKPOINT_FILE).write_text(json.dumps({"role": role, "shape": shape}))
    assert plan_from_sources(PPO, overrides, check_files=True).resume.step == 2
    assert shapes["actor"]["num_layers"] == 4 and shapes["critic"]["tie_word_embeddings"] is False
    for role in shapes:  # saved from a 2-layer model
        (folder / role / ROLE_CHECKPOINT_FILE).write_text(json.dumps({"shape": {**shapes[role], "num_layers": 2}}))
    text = _refusal(PPO, overrides)
    where = f"the checkpoint it resumes from ({folder}, step 2)"
    assert (f"actor_rollout_ref.model.path={model} is another model than the one {where} saved its actor from: "
            "num_layers=2 (this model: 4) there; a resume continues that model's weights and optimizer state: give "
            "the model it trained, or name another checkpoint, or start fresh with trainer.resume_mode=disable") in text
    assert f"critic.model.path={model} is another model than the one {where} saved its critic from" in text
    assert "2 config error(s)" in text


def test_a_verl_checkpoint_or_a_folder_of_checkpoints_is_refused_saying_what_it_is(job, tmp_path):
    """A user moving from verl names its checkpoint (global_step_N with actor/dist_ckpt and data.pt), or names the
    experiment's folder instead of one step: both were 'not a complete checkpoint (no trainer_state.json; an
    interrupted save is never resumed from)', which neither is."""
    overrides, root, rows = job
    verl = tmp_path / "verl" / "global_step_10"
    (verl / "actor" / "dist_ckpt").mkdir(parents=True)
    (verl / "data.pt").write_bytes(b"")
    text = _refusal(GRPO, [*overrides, f"trainer.resume_mode={verl}"])
    assert (f"trainer.resume_mode={verl} is a verl checkpoint ({verl}: actor/dist_ckpt, data.pt), not hybridrl's; "
            "verl's megatron dist-checkpointing state (weights, optimizer, data position) is not read here: to go on "
            "from its weights as a fresh start, merge its actor's weights into an HF folder with verl's model merger "
            f"(python -m verl.model_merger merge --backend megatron --local_dir {verl / 'actor'} --target_dir HF_DIR)"
            ) in text
    (verl / "actor" / "huggingface").mkdir()  # saved with verl's hf_model contents: the weights are there
    (verl / "actor" / "huggingface" / "model.safetensors").write_bytes(b"")
    text = _refusal(GRPO, [*overrides, f"trainer.resume_mode={verl / 'actor'}"])
    assert (f"its actor's HF weights are in {verl / 'actor' / 'huggingface'}: give that folder as "
            "actor_rollout_ref.model.path (with trainer.resume_mode=disable, or a new trainer.default_local_dir)"
            ) in text
    latest = _checkpoint(root, 3, dataset_size=rows)
    text = _refusal(GRPO, [*overrides, f"trainer.resume_mode={root}"])
    assert (f"trainer.resume_mode={root} is a folder of checkpoints, not one: name one of its global_step_<N> folders "
            f"(the newest: {latest})") in text


def test_output_folders_that_are_files_are_refused(job, tmp_path):
    overrides, _, _ = job
    file = tmp_path / "a_file"
    file.write_text("x")
    text = _refusal(GRPO, [*overrides, f"trainer.default_local_dir={file}", f"trainer.rollout_data_dir={file}",
                           f"trainer.run_dir={file / 'run'}"])
    assert (f"trainer.default_local_dir={file} needs the folder {file}/demo/cpu_tiny_grpo, but {file} is a file, "
            "not a folder: train writes checkpoints there") in text
    assert f"trainer.rollout_data_dir={file} is a file, not a folder" in text
    assert f"trainer.run_dir={file / 'run'} needs the folder {file / 'run'}, but {file} is a file" in text
    assert "3 config error(s)" in text


def test_output_folders_the_file_system_refuses_to_create_files_in_are_refused(job, tmp_path):
    """Where the mode bits allow writing but the file system refuses a new file (root passes os.access everywhere:
    an NFS export squashing root, a pseudo file system, here /proc), the plan refused nothing and train failed at
    its first checkpoint, after Ray, the workers and the first steps (seen: FileNotFoundError '/proc/ckpt'). The plan
    creates a file there and removes it: nothing is left in a folder it may write in."""
    overrides, _, _ = job
    text = _refusal(GRPO, [*overrides, "trainer.default_local_dir=/proc/hybridrl-ckpt", "trainer.save_freq=2"])
    assert ("trainer.default_local_dir=/proc/hybridrl-ckpt cannot be written: creating a file in /proc fails (") in text
    assert "1 config error(s)" in text
    run = tmp_path / "writable"
    run.mkdir()
    plan_from_sources(GRPO, [*overrides, f"trainer.default_local_dir={run}", "trainer.save_freq=2",
                             f"trainer.run_dir={run}"], check_files=True)
    assert list(run.iterdir()) == []  # the probe file went


def test_output_folders_on_a_read_only_file_system_are_refused(job, tmp_path):
    """A run folder or checkpoint root the run may not write (here a real read-only mount) passed the plan, and train
    failed at its first write: after loading the data, or at its first checkpoint after Ray, the workers and the first
    steps. A checkpoint root that is only read (save_freq=-1: a resume without saves) stays allowed."""
    import os
    import subprocess

    overrides, _, _ = job
    read_only = tmp_path / "read_only"
    read_only.mkdir()
    if os.geteuid() == 0:  # a real read-only file system (the kernel refuses root too)
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(read_only)],
                                 capture_output=True)
        if mounted.returncode != 0:
            pytest.skip(f"cannot mount a read-only tmpfs here: {mounted.stderr.decode().strip()}")
        why = f"{read_only} is on a read-only file system"
    else:
        read_only.chmod(0o555)
        why = f"no permission to write in {read_only}"
    try:
        text = _refusal(GRPO, [*overrides, f"trainer.default_local_dir={read_only / 'ckpt'}", "trainer.save_freq=2",
                               f"trainer.run_dir={read_only / 'run'}"])
        assert (f"trainer.default_local_dir={read_only / 'ckpt'} cannot be written: {why}; train writes checkpoints "
                "there") in text
        assert f"trainer.run_dir={read_only / 'run'} cannot be written: {why}; train writes logs" in text
        assert "2 config error(s)" in text
        plan_from_sources(GRPO, [*overrides, f"trainer.default_local_dir={read_only / 'ckpt'}", "trainer.save_freq=-1"],
                          check_files=True)
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", str(read_only)], check=True)
        else:
            read_only.chmod(0o755)
