"""`hybridrl.persistence` on hand-made folders: nothing half-written is ever visible under a target's name."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from hybridrl import persistence
from hybridrl.persistence import (
    CheckpointError,
    atomic_dir,
    atomic_file,
    check_free_space,
    check_output_dir,
    commit_staging_dir,
    delete_dir,
    is_partial,
    make_staging_dir,
    partial_path,
    remove_partials,
    write_atomic,
)


def _tree(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): p.read_text() for p in sorted(folder.rglob("*")) if p.is_file()}


def _target(tmp_path: Path) -> Path:
    target = tmp_path / "out"
    (target / "sub").mkdir(parents=True)
    (target / "old.txt").write_text("old")
    (target / "sub" / "deep.txt").write_text("deep")
    return target


def test_a_failing_body_leaves_the_target_untouched_and_no_staging(tmp_path):
    target = _target(tmp_path)
    before = _tree(target)
    with pytest.raises(ValueError, match="writer died"), atomic_dir(target, force=True) as staging:
        assert is_partial(staging) and staging.parent == target.parent
        (staging / "new.txt").write_text("half")
        raise ValueError("writer died")
    assert _tree(target) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_replaced_target_is_swapped_whole(tmp_path):
    target = _target(tmp_path)
    with atomic_dir(target, force=True) as staging:
        (staging / "new.txt").write_text("new")
        assert _tree(target)["old.txt"] == "old"  # the old copy stays readable until the commit
    assert _tree(target) == {"new.txt": "new"}  # nothing of the old copy is left inside
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nor beside it (trash deleted)


def test_a_crash_during_a_replace_never_leaves_the_target_missing(tmp_path, monkeypatch):
    """The writer dies inside the commit — after one rename (moving the old copy aside), or while
    deleting the old copy: the target holds the old or the new folder whole; the rest is partials."""
    real_rename = persistence.os.rename
    renames = []

    def rename_then_die(*args, **kwargs):
        renames.append(args)
        if len(renames) > 1:
            raise KeyboardInterrupt("killed between two renames")
        real_rename(*args, **kwargs)

    def die(*args, **kwargs):
        raise KeyboardInterrupt("killed while deleting the old copy")

    for step in ("second rename", "rmtree"):
        target = _target(tmp_path / step.replace(" ", "_"))
        before = _tree(target)
        staging = make_staging_dir(target, force=True)
        (staging / "new.txt").write_text("new")
        renames.clear()
        if step == "second rename":
            monkeypatch.setattr(persistence.os, "rename", rename_then_die)
        else:
            monkeypatch.setattr(persistence.shutil, "rmtree", die)
        try:
            commit_staging_dir(staging, target)
        except KeyboardInterrupt:
            pass
        monkeypatch.undo()
        assert target.is_dir() and _tree(target) in (before, {"new.txt": "new"}), step
        assert all(is_partial(p) for p in target.parent.iterdir() if p != target), step
        remove_partials(target.parent)
        assert sorted(p.name for p in target.parent.iterdir()) == ["out"]


def test_exchange_swaps_two_folders_and_a_commit_without_it_still_replaces(tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    (a / "x").write_text("from a")
    (b / "y").write_text("from b")
    assert persistence.exchange_paths(a, b)  # Linux and a file system that supports it, as here
    assert _tree(a) == {"y": "from b"} and _tree(b) == {"x": "from a"}
    monkeypatch.setattr(persistence, "exchange_paths", lambda *paths: False)  # e.g. not Linux
    target = _target(tmp_path / "fallback")
    with atomic_dir(target, force=True) as staging:
        (staging / "new.txt").write_text("new")
    assert _tree(target) == {"new.txt": "new"}
    assert sorted(p.name for p in target.parent.iterdir()) == ["out"]


def test_commit_into_a_missing_or_empty_target(tmp_path):
    for target in (tmp_path / "a" / "missing", tmp_path / "empty"):
        if target.name == "empty":
            target.mkdir()
        staging = make_staging_dir(target)
        (staging / "x").write_text("1")
        assert commit_staging_dir(staging, target) == target.absolute()
        assert _tree(target) == {"x": "1"} and not staging.exists()


def test_a_non_empty_target_needs_force_and_a_file_is_refused(tmp_path):
    target = _target(tmp_path)
    with pytest.raises(CheckpointError, match=f"output folder {target} is not empty .pass --force"):
        make_staging_dir(target)
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="exists and is not a folder"):
        check_output_dir(tmp_path / "file", force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "out"]


def test_a_target_under_a_file_is_refused_naming_the_file(tmp_path):
    """A file where a parent folder must be created: refused before anything is made (mkdir would raise
    FileExistsError or NotADirectoryError part way)."""
    (tmp_path / "afile").write_text("x")
    for target in (tmp_path / "afile" / "y", tmp_path / "afile" / "y" / "z"):
        with pytest.raises(CheckpointError, match=f"cannot write output {target}: {tmp_path / 'afile'} is a file"):
            make_staging_dir(target, force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_a_target_over_an_input_is_refused_whatever_force(tmp_path):
    """The folder written from `inputs` may not be one of them, hold one, or lie inside one: the commit replaces the
    target whole. Symlinks are seen through; a sibling is fine."""
    source = _target(tmp_path)
    before = _tree(tmp_path)
    link = tmp_path / "link"
    link.symlink_to(source)
    for target, relation in ((source, "is"), (tmp_path, "contains"), (source / "sub", "is inside"), (link, "is")):
        with pytest.raises(CheckpointError, match=f"output {target} {relation} the input {source}"):
            with atomic_dir(target, force=True, inputs={"the input": source}) as staging:
                (staging / "new.txt").write_text("new")
    link.unlink()
    assert _tree(tmp_path) == before
    with atomic_dir(tmp_path / "beside", inputs={"the input": source}) as staging:
        (staging / "new.txt").write_text("new")
    assert _tree(tmp_path / "beside") == {"new.txt": "new"}


def test_is_partial_and_remove_partials(tmp_path):
    target = tmp_path / "global_step_3"
    staging = partial_path(target)
    assert staging.name.startswith(".partial-global_step_3-") and is_partial(staging)
    assert partial_path(target, "1234").name == ".partial-global_step_3-1234"
    assert partial_path(target) != partial_path(target)
    for name in ("global_step_3", ".hidden", "partial-x", "x.partial-y"):
        assert not is_partial(tmp_path / name)
    staging.mkdir()
    (staging / "f").write_text("x")
    (tmp_path / ".partial-latest.txt-77").write_text("half")  # a file caught mid-write
    target.mkdir()
    assert remove_partials(tmp_path) == sorted([staging, tmp_path / ".partial-latest.txt-77"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_3"]
    assert remove_partials(tmp_path / "nowhere") == []


def test_atomic_file_replaces_or_keeps_the_old_file(tmp_path):
    path = tmp_path / "state.json"
    write_atomic(path, "one")
    write_atomic(path, b"two")
    assert path.read_text() == "two"
    with pytest.raises(RuntimeError), atomic_file(path) as tmp:
        assert is_partial(tmp) and tmp.parent == tmp_path
        tmp.write_text("half")
        raise RuntimeError
    assert path.read_text() == "two" and [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_delete_dir_renames_before_removing(tmp_path):
    target = _target(tmp_path)
    delete_dir(target)
    delete_dir(target)  # already gone: nothing to do
    assert list(tmp_path.iterdir()) == []


def test_free_space_is_checked_before_writing(tmp_path, monkeypatch):
    usage = persistence.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(persistence.shutil, "disk_usage", lambda path: usage._replace(free=1000))
    with pytest.raises(CheckpointError, match=r"not enough free disk space for .*need about 1\.0 KiB, 1000\.0 B free"):
        check_free_space(tmp_path / "new" / "out", 1000)
    check_free_space(tmp_path / "out", 900)


def test_every_checkpoint_error_is_one_class():
    from hybridrl.models.checkpoint import CheckpointError as converter_error
    from hybridrl.trainer.checkpoints import CheckpointError as trainer_error
    from hybridrl.training.checkpointing import RoleCheckpointError

    assert converter_error is trainer_error is CheckpointError
    assert issubclass(RoleCheckpointError, CheckpointError)


def test_importing_it_imports_no_torch():
    code = "import sys, hybridrl.persistence; assert 'torch' not in sys.modules, 'torch imported'"
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002])
def test_weight_files_get_the_mode_every_other_file_gets(tmp_path, umask):
    """safetensors' save_file writes through a temporary file created 0600: weights (a checkpoint's rank files, an
    HF export's model.safetensors) were the one file others could not read. Written through `save_safetensors`,
    the same call a checkpoint's rank files and `hybridrl convert`'s outputs use, they get 0666 less the umask, as
    a text file written beside them does."""
    import torch

    from hybridrl.models.checkpoint import write_rank_file

    def modes() -> dict[str, str]:
        return {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in tmp_path.iterdir()}

    expected = oct(0o666 & ~umask)
    previous = os.umask(umask)
    try:
        write_rank_file(tmp_path / "rank.safetensors", {"w": torch.ones(3)})  # a checkpoint's weights
        persistence.write_atomic(tmp_path / "config.json", "{}")
        assert modes() == {"rank.safetensors": expected, "config.json": expected}
        persistence.save_safetensors({"w": torch.zeros(2)}, tmp_path / "model.safetensors", metadata={"format": "pt"})
        assert modes()["model.safetensors"] == expected
        assert persistence.process_umask() == umask
    finally:
        os.umask(previous)


def test_every_safetensors_file_is_written_through_save_safetensors():
    """The one place weights are written: any other call of safetensors' save_file would write 0600 files again."""
    package = Path(persistence.__file__).parent
    callers = [f"{path.relative_to(package)}:{n}" for path in sorted(package.rglob("*.py"))
               for n, line in enumerate(path.read_text().splitlines(), 1)
               if "save_file(" in line and path.name != "persistence.py"]
    assert not callers, callers
