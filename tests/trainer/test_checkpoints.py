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
