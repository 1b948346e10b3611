"""Step checkpoints on disk: atomic, pruned, and resolvable for resume.

Layout under `root` (= trainer.default_local_dir/project/experiment):
  global_step_<N>/             one complete checkpoint: worker folders (actor/, critic/) + trainer_state.json
  latest_checkpointed_iteration.txt   N of the newest complete checkpoint
  .partial-global_step_<N>-<token>/   a checkpoint being written (never read; removed on start)

A checkpoint becomes visible only by a rename after every writer finished and `trainer_state.json`
was written last inside it, so a crash at any point leaves the previous checkpoint as the latest.
The staging folder, the rename and the partial names are `hybridrl.persistence`'s.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from hybridrl.persistence import (
    CheckpointError,
    commit_staging_dir,
    delete_dir,
    discard_staging_dir,
    make_staging_dir,
    remove_partials,
    write_atomic,
)

__all__ = ["LATEST_FILE", "STATE_FILE", "CheckpointError", "CheckpointManager", "is_complete"]

STATE_FILE = "trainer_state.json"
LATEST_FILE = "latest_checkpointed_iteration.txt"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")


def is_complete(path: Path) -> bool:
    return (path / STATE_FILE).is_file()


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
        self.prune()
        return final

    def abort(self, partial: Path) -> None:
        discard_staging_dir(partial)

    def prune(self) -> list[Path]:
        """Delete complete checkpoints beyond the newest `keep_last_n`; returns what was removed."""
        if not self.keep_last_n:
            return []
        steps = self.complete_steps()
        removed = []
        for step in steps[: max(0, len(steps) - self.keep_last_n)]:
            path = self.step_dir(step)
            delete_dir(path)  # renamed aside first: a crash mid-delete leaves no half checkpoint
            removed.append(path)
        return removed

    def remove_partials(self) -> list[Path]:
        """Remove leftovers of interrupted saves (called at start-up, before anything resumes)."""
        return remove_partials(self.root)

    # ------------------------------------------------------------------ reading
    def step_dir(self, step: int) -> Path:
        return self.root / f"global_step_{step}"

    def complete_steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        steps = []
        for path in self.root.iterdir():
            match = _STEP_DIR.match(path.name)
            if match and is_complete(path):
                steps.append(int(match.group(1)))
        return sorted(steps)

    def latest(self) -> Path | None:
        """The newest complete checkpoint (the `latest` file if it points at one, else a scan)."""
        pointer = self.root / LATEST_FILE
        if pointer.is_file():
            text = pointer.read_text().strip()
            if text.isdigit() and is_complete(self.step_dir(int(text))):
                return self.step_dir(int(text))
        steps = self.complete_steps()
        return self.step_dir(steps[-1]) if steps else None

    def resolve_resume(self, resume_mode: str) -> Path | None:
        """`auto`: the latest complete checkpoint or None; `disable`: None; else that checkpoint path."""
        if resume_mode == "disable":
            return None
        if resume_mode == "auto":
            return self.latest()
        path = Path(resume_mode)
        if not path.is_dir():
            raise CheckpointError(f"trainer.resume_mode={resume_mode}: no such checkpoint folder")
        if not is_complete(path):
            raise CheckpointError(
                f"trainer.resume_mode={resume_mode}: not a complete checkpoint (no {STATE_FILE}; "
                "an interrupted save is never resumed from)"
            )
        return path

    @staticmethod
    def read_state(path: Path) -> dict[str, Any]:
        file = Path(path) / STATE_FILE
        try:
            state = json.loads(file.read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{file} is unreadable ({type(exc).__name__}: {exc})") from exc
        if not isinstance(state, dict) or not isinstance(state.get("global_step"), int):
            raise CheckpointError(f"{file} has no integer global_step")
        return state
