"""Writing to disk so that nothing half-written is ever read: one helper for every checkpoint and export.

Torch-free and importing no other hybridrl module (like `hybridrl.names`), so every package may use
it: the trainer's step checkpoints (`trainer/checkpoints.py`), the role checkpoints
(`training/checkpointing.py`), the converter and the bridge's save and HF export (`models/`).

- `CheckpointError`: the one error of a checkpoint or export that is missing, incomplete,
  inconsistent or damaged (the trainer's and the converter's); the role checkpoints'
  `RoleCheckpointError` subclasses it.
- `atomic_file` / `write_atomic`: a file written under a partial name, fsynced, then renamed over
  the target, so a reader sees the old file or the whole new one.
- `make_staging_dir` / `commit_staging_dir` / `atomic_dir`: a folder written as a hidden staging
  folder next to its target and renamed into place once complete; an existing target is replaced
  whole: swapped with the staging folder in one step (Linux `renameat2(RENAME_EXCHANGE)`), so the
  target always holds the old or the new folder, then the old one (now under the staging folder's
  partial name) is deleted.
- The partial-name convention: everything in progress (a staging folder, a replaced target awaiting
  deletion, a file being written) is named `.partial-<target name>-<token>` next to its target;
  `is_partial` tells such leftovers apart and `remove_partials` clears a folder of them at start-up.
- `delete_dir`: a complete folder renamed to a partial name before it is removed.
- `check_output_dir`, `check_apart`, `check_free_space`: refuse an output before anything is written (one
  that exists as a file, lies under a file or an unwritable folder, is non-empty without `force`, or is,
  holds or lies inside one of the inputs it is written from).
- The step checkpoints' layout and reading (`STATE_FILE`, `LATEST_FILE`, `ROLE_CHECKPOINT_FILE`, `latest_step`,
  `resolve_resume`, `read_step_state`): what the trainer resumes from (`trainer/checkpoints.py` writes them) and
  what `hybridrl plan` checks before any process starts (`config/resume.py`), one definition for both.

Where the file system cannot exchange (not Linux, or a file system without it), a replaced target is
moved aside first and the new folder renamed in: a crash between those two renames leaves the target
missing, with both copies as partials.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import hashlib
import json
import os
import re
import shutil
import sys
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

PARTIAL_PREFIX = ".partial-"


class CheckpointError(RuntimeError):
    """A checkpoint or export is missing, incomplete, inconsistent with its config, or corrupted."""


class RoleCheckpointError(CheckpointError):
    """A role checkpoint (`hybridrl.training.checkpointing`) is missing, incomplete, damaged, or was
    written for another model or role."""


# ---- names ------------------------------------------------------------------------------------------

def partial_path(target: str | Path, token: str | None = None) -> Path:
    """A fresh in-progress name next to `target`: `.partial-<name>-<token>` (random token by default)."""
    target = Path(target)
    return target.parent / f"{PARTIAL_PREFIX}{target.name}-{token or uuid.uuid4().hex[:8]}"


def is_partial(path: str | Path) -> bool:
    """Whether `path` is named as something in progress (never to be read as a result)."""
    return Path(path).name.startswith(PARTIAL_PREFIX)


def remove_partials(folder: str | Path) -> list[Path]:
    """Delete the leftovers of interrupted writes directly inside `folder`; returns what was removed."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    leftovers = sorted(p for p in folder.iterdir() if is_partial(p))
    for path in leftovers:
        _remove(path)
    return leftovers


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _fsync_dir(folder: Path) -> None:
    """Make a rename inside `folder` durable (the rename is in the folder's entry table)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- files ------------------------------------------------------------------------------------------

@contextlib.contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """Yield a partial path next to `path` to write; on success fsync it and rename it over `path`.

    On any error the partial file is removed and `path` is left as it was.
    """
    path = Path(path)
    tmp = partial_path(path, f"{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        yield tmp
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Write `data` (text as UTF-8) to `path` through `atomic_file`."""
    with atomic_file(path) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)


def process_umask() -> int:
    """This process's umask, read without changing it (/proc's Umask line; else set and restored at once)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def save_safetensors(tensors: Any, path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """Write a dict of torch tensors as a safetensors file, with the mode every other file gets (0666 less the
    umask). safetensors' `save_file` writes through a temporary file it renames, created 0600, so weights were
    the one file of a checkpoint or an export that others could not read. Every safetensors file hybridrl writes
    goes through here (imported lazily: this module stays torch-free)."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, 0o666 & ~process_umask())


# ---- folders ----------------------------------------------------------------------------------------

def file_sha256(path: str | Path) -> str:
    """The sha256 of a file's bytes, read in 1 MiB blocks (checkpoint files record it and are checked against it)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def check_apart(out_dir: str | Path, inputs: Mapping[str, str | Path], out_name: str = "output") -> None:
    """Refuse an output folder that is one of `inputs` (name -> path, as the user named them), holds one or lies
    inside one: committing it replaces the whole folder, so it would delete the input (and, for a folder above
    it, everything beside it) once a non-empty output is allowed (`force`). Compared after resolving symlinks."""
    out = Path(out_dir)
    out_real = out.resolve()
    for name, source in inputs.items():
        src_real = Path(source).resolve()
        if out_real == src_real:
            relation, harm = "is", "the output would replace the input"
        elif out_real in src_real.parents:
            relation, harm = "contains", "the output would replace that folder, deleting the input and all beside it"
        elif src_real in out_real.parents:
            relation, harm = "is inside", "the output would be written into the input, changing it"
        else:
            continue
        resolved = "" if (out_real, src_real) == (out.absolute(), Path(source).absolute()) else \
            f" (resolved: {out_real} and {src_real})"
        raise CheckpointError(f"{out_name} {out} {relation} {name} {source}{resolved}: {harm}; choose an "
                              f"{out_name} that neither is, contains nor lies inside {source}")


def check_output_dir(out_dir: str | Path, force: bool, inputs: Mapping[str, str | Path] | None = None) -> None:
    """Refuse, up front, an output that is, holds or lies inside one of `inputs` (`check_apart`), exists as a file,
    cannot be created (a file or an unwritable folder on its path), or is a non-empty folder without `force`."""
    out_dir = Path(out_dir)
    check_apart(out_dir, inputs or {})
    if out_dir.exists() and not out_dir.is_dir():
        raise CheckpointError(f"output {out_dir} exists and is not a folder")
    problem = creation_problem(out_dir.absolute().parent)
    if problem:
        raise CheckpointError(f"cannot write output {out_dir}: {problem}")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise CheckpointError(f"output folder {out_dir} is not empty (pass --force to replace it)")


def nearest_existing(path: str | Path) -> Path:
    """`path` itself if it exists, else its nearest existing ancestor (absolute, normalized): where creating it would
    start. (os.path's string functions: the layout search checks the job's folders in each of its ~2,000 plans.)"""
    existing = os.path.abspath(path)
    while not os.path.exists(existing) and existing != os.path.dirname(existing):
        existing = os.path.dirname(existing)
    return Path(existing)


def creation_problem(folder: str | Path) -> str | None:
    """Why `folder` cannot be created (its parents included) or written into, or None: its nearest existing
    ancestor is a file, or a folder this process may not write to."""
    existing = nearest_existing(folder)
    if not os.path.isdir(existing):
        return f"{existing} is a file, not a folder"
    return write_problem(existing)


def write_problem(folder: Path) -> str | None:
    """Why this process may not create files in the existing `folder`, or None."""
    if os.statvfs(folder).f_flag & os.ST_RDONLY:  # os.access refuses it too, but it is no permission to change
        return f"{folder} is on a read-only file system"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"no permission to write in {folder}"
    return _create_problem(os.fspath(folder))


@functools.lru_cache(maxsize=64)
def _create_problem(folder: str) -> str | None:
    """Why creating a file in `folder` fails, found by creating (and removing) one: os.access answers from the mode
    bits, and root passes it everywhere, where the file system still refuses: an NFS export squashing root, a
    pseudo file system (/proc, /sys). Once per folder and process (a layout search checks the same folders in each of
    its plans)."""
    probe = os.path.join(folder, f".hybridrl-write-check-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except OSError as error:
        return f"creating a file in {folder} fails ({error.strerror or type(error).__name__})"
    with contextlib.suppress(OSError):
        os.unlink(probe)
    return None


def check_free_space(out_dir: str | Path, needed_bytes: int, margin: float = 1.05) -> None:
    """Refuse to start writing `needed_bytes` (times `margin`) where the disk has less free."""
    out_dir = Path(out_dir)
    parent = out_dir.parent
    while not parent.exists():
        parent = parent.parent
    free = shutil.disk_usage(parent).free
    if needed_bytes * margin > free:
        raise CheckpointError(f"not enough free disk space for {out_dir}: need about "
                              f"{format_bytes(needed_bytes * margin)}, {format_bytes(free)} free")


def make_staging_dir(target: str | Path, force: bool = False,
                     inputs: Mapping[str, str | Path] | None = None) -> Path:
    """Check `target` may be written (`check_output_dir`: never over one of `inputs`), then create an empty
    staging folder next to it."""
    target = Path(target).absolute()
    check_output_dir(target, force, inputs)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = partial_path(target)
    staging.mkdir()
    return staging


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def exchange_paths(a: str | Path, b: str | Path) -> bool:
    """Swap two existing paths in one atomic step (Linux `renameat2` with RENAME_EXCHANGE).

    Returns False where the platform or the file system cannot (the caller falls back to renames).
    """
    if not sys.platform.startswith("linux"):
        return False
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:  # glibc < 2.28
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))


def commit_staging_dir(staging: str | Path, target: str | Path) -> Path:
    """Rename a complete staging folder into place; an existing `target` is replaced whole (deleted last).

    The target always holds the old or the new folder: the two are exchanged in one step where the
    file system allows it, and the old one (then under the staging folder's partial name) is deleted.
    """
    staging, target = Path(staging), Path(target).absolute()
    if target.is_dir() and not any(target.iterdir()):
        target.rmdir()
    if target.is_dir():
        if exchange_paths(staging, target):
            _fsync_dir(target.parent)
            shutil.rmtree(staging, ignore_errors=True)
            return target
        trash = partial_path(target)
        os.rename(target, trash)
        os.rename(staging, target)
        _fsync_dir(target.parent)
        shutil.rmtree(trash, ignore_errors=True)
        return target
    os.rename(staging, target)
    _fsync_dir(target.parent)
    return target


def delete_dir(path: str | Path) -> None:
    """Delete a complete folder so that no half-deleted copy can be read: renamed to a partial name
    first (one step), then removed (a crash in between leaves a leftover for `remove_partials`)."""
    path = Path(path)
    if not path.is_dir():
        return
    trash = partial_path(path)
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def discard_staging_dir(staging: str | Path) -> None:
    """Delete a staging folder that will not be committed (nothing else is touched)."""
    shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def atomic_dir(target: str | Path, force: bool = False,
               inputs: Mapping[str, str | Path] | None = None) -> Iterator[Path]:
    """Yield a staging folder next to `target`; rename it into place only if the body succeeds. `inputs`: what
    the body reads (name -> path), never replaced or deleted by the commit (`check_apart`).

    On any error the staging folder is removed and `target` is left exactly as it was.
    """
    staging = make_staging_dir(target, force, inputs)
    try:
        yield staging
        commit_staging_dir(staging, target)
    except BaseException:
        discard_staging_dir(staging)
        raise


def write_folder(files: dict[str, bytes], folder: str | Path, *, force: bool = False) -> Path:
    """`files` (name -> bytes) as the folder `folder`, written whole or not at all (`atomic_dir`)."""
    with atomic_dir(folder, force=force) as staging:
        for name, data in files.items():
            (staging / name).write_bytes(data)
    return Path(folder)


# ---- step checkpoints: layout and reading -----------------------------------------------------------
# Under a checkpoint root (trainer.default_local_dir/<project>/<experiment>):
#   global_step_<N>/                    one complete checkpoint: a folder per checkpointed role (actor/, critic/),
#                                       each complete once its ROLE_CHECKPOINT_FILE is written (last), and
#                                       STATE_FILE, written last of all
#   latest_checkpointed_iteration.txt   N of the newest complete checkpoint

STATE_FILE = "trainer_state.json"
LATEST_FILE = "latest_checkpointed_iteration.txt"
ROLE_CHECKPOINT_FILE = "role_checkpoint.json"  # `training/checkpointing.py`'s metadata, written last in a role folder
# a megatron checkpoint's metadata (`models/checkpoint.py`'s format), here so torch-free readers (the plan) name it too
METADATA_FILE = "hybridrl_checkpoint.json"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"global_step_{step}"


def is_complete(path: str | Path) -> bool:
    """Whether a step checkpoint folder was sealed (its trainer state is written last)."""
    return (Path(path) / STATE_FILE).is_file()


def complete_steps(root: str | Path) -> list[int]:
    root = Path(root)
    if not root.is_dir():
        return []
    steps = []
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and is_complete(path):
            steps.append(int(match.group(1)))
    return sorted(steps)


def latest_step(root: str | Path) -> Path | None:
    """The newest complete checkpoint under `root` (the `latest` file if it points at one, else a scan)."""
    pointer = Path(root) / LATEST_FILE
    if pointer.is_file():
        text = pointer.read_text().strip()
        if text.isdigit() and is_complete(step_dir(root, int(text))):
            return step_dir(root, int(text))
    steps = complete_steps(root)
    return step_dir(root, steps[-1]) if steps else None


def verl_checkpoint_hint(path: str | Path) -> str | None:
    """What a verl checkpoint is and how to go on from its weights (a `global_step_N` folder, or its `actor/` or
    `actor/dist_ckpt/` folder: megatron dist-checkpointing state, which hybridrl does not read), or None when `path`
    is not one."""
    path = Path(path)
    step = next((p for p in (path, path.parent, path.parent.parent)
                 if (p / "actor" / "dist_ckpt").is_dir() or (p / "actor" / "huggingface").is_dir()
                 or (p / "data.pt").is_file() and _STEP_DIR.match(p.name)), None)
    if step is None or is_complete(step):
        return None
    actor = step / "actor"
    hf = actor / "huggingface"
    weights = hf.is_dir() and any(hf.glob("*.safetensors"))
    start = (f"its actor's HF weights are in {hf}: give that folder as actor_rollout_ref.model.path" if weights
             else f"merge its actor's weights into an HF folder with verl's model merger (python -m "
                  f"verl.model_merger merge --backend megatron --local_dir {actor} --target_dir HF_DIR) and give that "
                  "folder as actor_rollout_ref.model.path")
    return (f"a verl checkpoint ({step}: actor/dist_ckpt, data.pt), not hybridrl's; verl's megatron "
            f"dist-checkpointing state (weights, optimizer, data position) is not read here: to go on from its weights "
            f"as a fresh start, {start}")


def resolve_resume(root: str | Path, resume_mode: str) -> Path | None:
    """`auto`: the latest complete checkpoint under `root` or None; `disable`: None; else that checkpoint path."""
    if resume_mode == "disable":
        return None
    if resume_mode == "auto":
        return latest_step(root)
    path = Path(resume_mode)
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"trainer.resume_mode={resume_mode}: is a file, not a checkpoint folder "
                              f"(a global_step_<N> folder holding {STATE_FILE})")
    if not path.is_dir():
        raise CheckpointError(f"trainer.resume_mode={resume_mode}: no such checkpoint folder")
    if not is_complete(path):
        verl = verl_checkpoint_hint(path)
        if verl is not None:
            raise CheckpointError(f"trainer.resume_mode={resume_mode}: is {verl} (with trainer.resume_mode=disable, "
                                  "or a new trainer.default_local_dir)")
        newest = latest_step(path)
        if newest is not None:  # a checkpoint root: its steps are the checkpoints
            raise CheckpointError(f"trainer.resume_mode={resume_mode}: is a folder of checkpoints, not one: name one "
                                  f"of its global_step_<N> folders (the newest: {newest})")
        raise CheckpointError(
            f"trainer.resume_mode={resume_mode}: not a complete checkpoint (no {STATE_FILE}; "
            "an interrupted save is never resumed from)"
        )
    return path


def read_step_state(path: str | Path) -> dict[str, Any]:
    """A complete checkpoint's trainer state (global_step, the data loader's state, the KL coefficient)."""
    file = Path(path) / STATE_FILE
    try:
        state = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{file} is unreadable ({type(exc).__name__}: {exc})") from exc
    if not isinstance(state, dict) or not isinstance(state.get("global_step"), int):
        raise CheckpointError(f"{file} has no integer global_step")
    return state
