"""Checkpoint folders: atomic commit, pruning, resume resolution, interrupted saves never resumed."""
import pytest

from hybridrl.persistence import is_partial
from hybridrl.trainer.checkpoints import LATEST_FILE, CheckpointError, CheckpointManager


def _save(manager, step, payload="w"):
    partial = manager.begin(step)
    (partial / "actor").mkdir()
    (partial / "actor" / "weights.bin").write_text(payload)
    return manager.commit(partial, step, {"dataloader": {"epoch": 0, "position": step}})


def test_commit_makes_checkpoint_visible_and_latest(tmp_path):
    manager = CheckpointManager(tmp_path)
    assert manager.latest() is None and manager.resolve_resume("auto") is None
    path = _save(manager, 3)
    assert path.name == "global_step_3" and (path / "actor" / "weights.bin").read_text() == "w"
    assert manager.latest() == path
    assert manager.read_state(path) == {"global_step": 3, "dataloader": {"epoch": 0, "position": 3}}
    assert (tmp_path / LATEST_FILE).read_text().strip() == "3"


def test_interrupted_save_is_invisible_and_cleaned(tmp_path):
    manager = CheckpointManager(tmp_path)
    good = _save(manager, 1)
    partial = manager.begin(2)
    (partial / "actor").mkdir()  # the writer dies here: no commit
    assert manager.latest() == good and manager.complete_steps() == [1]
    # even a folder renamed into place without its state file is not a checkpoint
    (tmp_path / "global_step_5").mkdir()
    assert manager.latest() == good
    removed = CheckpointManager(tmp_path).remove_partials()
    assert removed == [partial] and not partial.exists()
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        manager.resolve_resume(str(tmp_path / "global_step_5"))


def test_keep_last_n_prunes_oldest(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last_n=2)
    for step in (1, 2, 3, 4):
        _save(manager, step)
    assert manager.complete_steps() == [3, 4]
    assert manager.latest().name == "global_step_4"


def test_keep_last_n_after_resuming_from_an_earlier_step_keeps_what_the_run_saves(tmp_path):
    """A run resumed from step 2 (trainer.resume_mode=<path>) while steps 4 and 6 of the run it left are on disk:
    with keep_last_n=1 its save of step 3 was deleted at once (4 and 6 counted as newer), `latest` named a folder that
    was gone, and the next auto resume went on from the abandoned run's step 6."""
    manager = CheckpointManager(tmp_path, keep_last_n=1)
    for step in (2, 4, 6):
        CheckpointManager(tmp_path).commit(CheckpointManager(tmp_path).begin(step), step, {})
    saved = _save(manager, 3)
    assert saved.is_dir() and manager.complete_steps() == [3, 4, 6]  # 2 pruned; the left run's 4 and 6 kept
    assert manager.resolve_resume("auto") == saved
    replaced = _save(manager, 4, payload="this run's")  # the left run's step 4 replaced, 3 pruned
    assert manager.complete_steps() == [4, 6] and manager.resolve_resume("auto") == replaced
    assert (replaced / "actor" / "weights.bin").read_text() == "this run's"


def test_resolve_resume_modes(tmp_path):
    manager = CheckpointManager(tmp_path)
    first = _save(manager, 1)
    _save(manager, 2)
    assert manager.resolve_resume("disable") is None
    assert manager.resolve_resume("auto").name == "global_step_2"
    assert manager.resolve_resume(str(first)) == first
    with pytest.raises(CheckpointError, match="no such checkpoint folder"):
        manager.resolve_resume(str(tmp_path / "nope"))
    # a file (here the trainer state itself) is said to be a file, not a missing folder
    with pytest.raises(CheckpointError, match="is a file, not a checkpoint folder"):
        manager.resolve_resume(str(first / "trainer_state.json"))


def test_resaving_a_step_replaces_it_whole(tmp_path):
    manager = CheckpointManager(tmp_path)
    _save(manager, 2, payload="old")
    path = _save(manager, 2, payload="new")
    assert (path / "actor" / "weights.bin").read_text() == "new"
    assert [p.name for p in tmp_path.iterdir() if is_partial(p)] == []


def test_stale_latest_pointer_falls_back_to_scan(tmp_path):
    manager = CheckpointManager(tmp_path)
    _save(manager, 1)
    (tmp_path / LATEST_FILE).write_text("7\n")  # points at nothing complete
    assert manager.latest().name == "global_step_1"


def test_a_resume_takes_the_kl_coefficient_back_only_where_it_is_state(tmp_path):
    """The KL coefficient a checkpoint holds is the adaptive controller's state, but a fixed controller's setting: a
    run resumed with another algorithm.kl_ctrl.kl_coef kept the checkpoint's (0.001 logged as
    actor/reward_kl_penalty_coeff after resuming with kl_coef=0.01, measured on the PPO demo). Saved and read back
    through the trainer's own state and checkpoint folder."""
    from hybridrl.algorithms.kl_control import kl_controller_from_config
    from hybridrl.trainer.step import RunState

    def resumed(saved: dict, now: dict) -> tuple[float, str | None]:
        run = RunState(kl_controller_from_config(saved))
        run.kl_controller.update(current_kl=1.0, n_steps=100)  # adaptive: 0.001 x (1 + 0.2 x 100 / 1000)
        manager = CheckpointManager(tmp_path / str(len(list(tmp_path.iterdir()))))
        path = manager.commit(manager.begin(2), 2, run.checkpoint_state())
        again = RunState(kl_controller_from_config(now))
        note = again.restore(manager.read_state(path))
        assert again.global_step == 2
        return again.kl_controller.value, note

    fixed = {"type": "fixed", "kl_coef": 0.001}
    adaptive = {"type": "adaptive", "kl_coef": 0.001, "target_kl": 0.5, "horizon": 1000}
    assert resumed(fixed, fixed) == (0.001, None)
    value, note = resumed(fixed, {**fixed, "kl_coef": 0.01})  # the user's new setting applies
    assert value == 0.01 and note == ("algorithm.kl_ctrl.kl_coef=0.01 applies from here on; the checkpoint's run had "
                                      "the KL coefficient at 0.001 (a fixed coefficient is a setting)")
    assert resumed(adaptive, adaptive) == (pytest.approx(0.001 * 1.02), None)  # the adapted value continues
    # its target and horizon may change; the adapted value still continues
    assert resumed(adaptive, {**adaptive, "target_kl": 2.0})[0] == pytest.approx(0.001 * 1.02)
    value, note = resumed(adaptive, {**adaptive, "kl_coef": 0.05})  # another starting point: it starts there
    assert value == 0.05 and "the adaptive coefficient starts again from kl_coef" in note
    value, note = resumed(adaptive, fixed)  # fixed now: the setting, not the adapted value
    assert value == 0.001 and note is not None and "0.00102" in note
    # a checkpoint written before the controller's settings were recorded: an adaptive controller continues
    run = RunState(kl_controller_from_config(adaptive))
    assert run.restore({"global_step": 2, "kl_coef": 0.0042}) is None and run.kl_controller.value == 0.0042
    run = RunState(kl_controller_from_config({**fixed, "kl_coef": 0.01}))
    assert run.restore({"global_step": 2, "kl_coef": 0.0042}) is not None and run.kl_controller.value == 0.01
