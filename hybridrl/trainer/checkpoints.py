"""Step checkpoints on disk: atomic, pruned, and resolvable for resume.

Layout under `root` (= trainer.default_local_dir/project/experiment):
  global_step_<N>/             one complete checkpoint: worker folders (actor/, critic/) + trainer_state.json
  latest_checkpointed_iteration.txt   N of the newest complete checkpoint
  .partial-global_step_<N>-<token>/   a checkpoint being written (never read; removed on start)

A checkpoint becomes visible only by a rename after every writer finished and `trainer_state.json`
was written last inside it, so a crash at any point leaves the previous checkpoint as the latest.
The staging folder, the rename, the partial names and the layout's reading (`resolve_resume`, shared with
`hybridrl plan`) are `hybridrl.persistence`'s.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hybridrl.persistence import (
    LATEST_FILE,
    STATE_FILE,
    CheckpointError,
    commit_staging_dir,
    complete_steps,
    delete_dir,
    discard_staging_dir,
    is_complete,
    latest_step,
    make_staging_dir,
    read_step_state,
    remove_partials,
    resolve_resume,
    step_dir,
    write_atomic,
)

__all__ = ["LATEST_FILE", "STATE_FILE", "CheckpointError", "CheckpointManager", "is_complete"]


class CheckpointManager:
    def __init__(self, root: str | Path, keep_last_n: int | None = None):
        self.root = Path(root)
        self.keep_last_n = keep_last_n

    # ------------------------------------------------------------------ writing
    def begin(self, step: int) -> Path:
        """A fresh staging folder next to step `step`'s folder, for its writers."""
        return make_staging_dir(self.step_dir(step), force=True)

    def commit(self, partial: Path, step: int, trainer_state: dict[str, Any]) -> Path:
        """Seal a checkpoint: write the trainer state last, rename into place, point `latest` at it."""
        state = {"global_step": step, **trainer_state}
        write_atomic(partial / STATE_FILE, json.dumps(state, indent=2, sort_keys=True))
        final = self.step_dir(step)
        commit_staging_dir(partial, final)  # re-saving a step (e.g. after resume) replaces it whole
        write_atomic(self.root / LATEST_FILE, f"{step}\n")
        self.prune(step)
        return final

    def abort(self, partial: Path) -> None:
        discard_staging_dir(partial)

    def prune(self, newest: int) -> list[Path]:
        """Delete the complete checkpoints before step `newest` (the one just sealed) beyond the `keep_last_n` newest,
        it included; returns what was removed. Later steps are left: they are of the run that a run resumed from an
        earlier checkpoint left behind (replaced one by one as this run saves those steps again). Counted among the
        newest, they made the step just sealed the oldest, deleted at once, and a later resume went on from the
        abandoned run's checkpoint."""
        if not self.keep_last_n:
            return []
        steps = [step for step in self.complete_steps() if step <= newest]
        removed = []
        for step in steps[: max(0, len(steps) - self.keep_last_n)]:
            path = self.step_dir(step)
            delete_dir(path)  # renamed aside first: a crash mid-delete leaves no half checkpoint
            removed.append(path)
        return removed

    def remove_partials(self) -> list[Path]:
        """Remove leftovers of interrupted saves (called at start-up, before anything resumes)."""
        return remove_partials(self.root)

    # ------------------------------------------------------------------ reading (`hybridrl.persistence`'s layout)
    def step_dir(self, step: int) -> Path:
        return step_dir(self.root, step)

    def complete_steps(self) -> list[int]:
        return complete_steps(self.root)

    def latest(self) -> Path | None:
        """The newest complete checkpoint (the `latest` file if it points at one, else a scan)."""
        return latest_step(self.root)

    def resolve_resume(self, resume_mode: str) -> Path | None:
        """`auto`: the latest complete checkpoint or None; `disable`: None; else that checkpoint path."""
        return resolve_resume(self.root, resume_mode)

    @staticmethod
    def read_state(path: Path) -> dict[str, Any]:
        return read_step_state(path)
